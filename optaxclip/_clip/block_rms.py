"""Clipping each leaf (block) by its root mean square: ``optax.clip_by_block_rms``.

Each floating leaf ``u`` of ``n`` entries has ``rms = sqrt(sum |u|**2 / n)``
and is multiplied by ``s = threshold / rms`` when ``rms > threshold``, else
by 1: optax's ``u / max(1, rms / threshold)``, computed as one factor per
leaf. The norm is the library's (``_norms``): accumulated in float32 at
least and overflow-safe, so bf16/fp16 leaves and entries above ~1.8e19 get
the right RMS where optax's squares overflow (its update is then 0). With
``layer_axis`` each layer slice of a stacked leaf is a block of its own.
Norm -> factor -> scale -> state, as every clipper here.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxclip import _core, _validation
from optaxclip._clip import scaling
from optaxclip._stats import counters, registry, running
from optaxclip._types import AxisName, PyTree, Scalar


class BlockRMSState(NamedTuple):
  """State of ``clip_by_block_rms``; every field is a scalar.

  ``float`` below is float32, or float64 when x64 is on and ``init`` was
  given float64 parameters.

  Attributes:
    rms: float ``[]``: the largest leaf (or layer slice) RMS of the last
      update (NaN if a leaf's was).
    scale: float ``[]``: the smallest factor applied last step (1.0: no
      leaf clipped).
    count: int32 ``[]``: steps seen.
    clipped_count: int32 ``[]``: steps with finite RMSs and a leaf clipped.
    nonfinite_count: int32 ``[]``: steps with a NaN or Inf RMS.
  """
  rms: jax.Array
  scale: jax.Array
  count: jax.Array
  clipped_count: jax.Array
  nonfinite_count: jax.Array

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike) -> "BlockRMSState":
    """The state before the first step, its floats in ``dtype``."""
    return cls(rms=jnp.zeros([], dtype), scale=jnp.ones([], dtype),
               count=counters.zero(), clipped_count=counters.zero(),
               nonfinite_count=counters.zero())


registry.register(BlockRMSState, "block_rms",
                  extras=lambda state: {"clip_rate": counters.clip_rate(state)})


def _clip(fn: str, tree: PyTree, threshold: Scalar, where: _core.Where,
          kept: _core.Kept) -> tuple[PyTree, jax.Array, jax.Array]:
  """The clipped tree, and the RMS and factor of every clippable leaf (or
  layer slice, on every device), as vectors.

  The RMSs come from the core, finite wherever they are finite numbers
  (a block's norm may overflow float32 where its RMS does not: the core
  divides by the root of its size before any rescaling). A zero block has
  RMS 0 and factor 1, even with ``threshold = 0``.
  """
  _validation.check_tree(fn, "the tree", tree)
  measured = _core.measure(fn, tree, 2, where, kept, rms=True)
  factors = scaling.clip_factor(measured.units, threshold, 0.0)
  clipped = scaling.scale_leaves(tree, measured.to_leaves(factors))
  return clipped, measured.units, factors


def clip_by_block_rms_fn(tree: PyTree, threshold: Scalar, *,
                         axis_name: AxisName = None, specs: PyTree = None,
                         layer_axis: PyTree = None) -> PyTree:
  """Clips every leaf of ``tree`` so that its RMS is at most ``threshold``.

  Each floating leaf ``u`` of ``n`` entries is multiplied by
  ``threshold / rms`` when ``rms = sqrt(sum |u|**2 / n)`` exceeds
  ``threshold``: ``optax.clip_by_block_rms``'s numbers, to a few float32
  ulps, with the RMS accumulated in float32 and overflow-safe (finite for
  entries of any magnitude, where optax's squares overflow). Zero leaves
  stay zero, even with ``threshold = 0`` (where optax gives NaN). Integer
  and boolean leaves pass through.

  Traced (inside ``jit``), a negative or NaN ``threshold`` acts as 0: every
  leaf becomes zero.

  Args:
    tree: a pytree of arrays.
    threshold: the largest RMS a leaf may keep (a number >= 0; ``inf`` never
      clips).
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the updates
      are split over: the norms are then those of the whole, unsplit updates,
      with one all-reduce (see ``functional.global_norm``).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix, as
      ``shard_map``'s ``in_specs``): a leaf replicated on an axis counts once.
    layer_axis: for scanned (stacked) layers, the axis that stacks them (an
      int, or a tree prefix of the tree with int or None leaves): each
      layer's slice is a block of its own, with the RMS of its ``n / L``
      entries (optax's numbers for that layer alone). The layer axis may be
      split over the mesh.

  Returns:
    The clipped tree, with each leaf's dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> grads = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([0.5, -0.5])}
    >>> clipped = oc.functional.clip_by_block_rms(grads, 1.0)
    >>> clipped["w"], clipped["b"]  # rms 3.54: scaled by 1 / 3.54; rms 0.5: kept
    (Array([0.84852815, 1.1313709 ], dtype=float32), Array([ 0.5, -0.5], dtype=float32))
    >>> oc.functional.clip_by_block_rms([jnp.full(4, 1e20)], 1.0)  # no overflow
    [Array([1., 1., 1., 1.], dtype=float32)]
    >>> stacked = jnp.array([[3.0, 4.0], [0.5, -0.5]])  # two layers
    >>> oc.functional.clip_by_block_rms([stacked], 1.0, layer_axis=0)
    [Array([[ 0.84852815,  1.1313709 ],
           [ 0.5       , -0.5       ]], dtype=float32)]
  """
  fn = "clip_by_block_rms"
  threshold = _validation.check_nonnegative(fn, "threshold", threshold,
                                            allow_inf=True)
  where = _core.Where.of(fn, axis_name, specs)
  kept = _core.layers(_validation.check_layer_axis(fn, layer_axis))
  return _clip(fn, tree, threshold, where, kept)[0]


def clip_by_block_rms(threshold: Scalar, *, axis_name: AxisName = None,
                      specs: PyTree = None, layer_axis: PyTree = None
                      ) -> optax.GradientTransformation:
  """Clips every leaf of the updates to an RMS of at most ``threshold``.

  A drop-in for ``optax.clip_by_block_rms`` (the transform form of
  ``optaxclip.functional.clip_by_block_rms``: the same numbers to a few
  float32 ulps, finite where optax's overflow or divide 0 by 0), whose state
  (``BlockRMSState``) logs the largest leaf RMS and the smallest factor.
  Like optax's, its ``update`` accepts ``state=None`` (as a fresh state).

  Hyperparameters injected with ``optax.inject_hyperparams`` are checked
  when ``init`` runs eagerly. Traced (a jitted update after a change of the
  state's hyperparameters), a negative or NaN ``threshold`` acts as 0 (the
  update is zero).

  Args:
    threshold: as in ``functional.clip_by_block_rms``.
    axis_name: as there ([docs/distributed.md](../distributed.md)).
    specs: as there.
    layer_axis: as there: each layer's slice is clipped by its own RMS;
      the state logs the largest
      and smallest over all slices.

  Returns:
    An ``optax.GradientTransformation``; its state, a ``BlockRMSState``,
    logs the largest RMS and the smallest factor.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> tx = oc.clip_by_block_rms(1.0)
    >>> grads = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([0.5, -0.5])}
    >>> updates, state = tx.update(grads, tx.init(grads))
    >>> updates["w"]
    Array([0.84852815, 1.1313709 ], dtype=float32)
    >>> state.rms, state.scale  # the largest leaf RMS, the smallest factor
    (Array(3.535534, dtype=float32), Array(0.2828427, dtype=float32))
  """
  fn = "clip_by_block_rms"
  threshold = _validation.check_nonnegative(fn, "threshold", threshold,
                                            allow_inf=True)
  where = _core.Where.of(fn, axis_name, specs)
  kept = _core.layers(_validation.check_layer_axis(fn, layer_axis))

  def init_fn(params):
    return BlockRMSState.fresh(running.statistics_dtype(params))

  def update_fn(updates, state, params=None):
    del params
    if state is None:  # stateless use, as optax's allows: a fresh state
      state = init_fn(None)
    _validation.check_state(fn, state, BlockRMSState)
    clipped, rms, factors = _clip(fn, updates, threshold, where, kept)
    largest = jnp.max(rms, initial=0)  # NaN if any leaf's is
    smallest = jnp.min(factors, initial=1)
    new_state = BlockRMSState(
        rms=largest.astype(state.rms.dtype),
        scale=smallest.astype(state.scale.dtype),
        **counters.step_counts(state, finite=jnp.isfinite(largest),
                               clipped=smallest < 1))
    return clipped, new_state

  return optax.GradientTransformation(init_fn, update_fn)
