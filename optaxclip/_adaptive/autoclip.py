"""AutoClip: clip to a percentile of the gradient norms seen so far.

Each step appends the global L2 norm to a history and clips with PyTorch's
``clip_grad_norm_`` semantics to ``numpy.percentile(history, percentile)``
(linear interpolation). The history is a fixed-size ring buffer in the state:
the same numbers as the unbounded reference while ``step <= history``, after
which the oldest norm makes room for the newest. ``step`` is the statistics
as a pure function ``(state, norm) -> (factor, new_state)``.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxclip import _core, _validation
from optaxclip._clip import masking, scaling
from optaxclip._stats import counters, registry, running
from optaxclip._types import AxisName, Scalar

PyTree = Any


class AutoClipState(NamedTuple):
  """State of ``auto_clip``: a ring buffer of norms and scalar statistics.

  ``float`` below is float32, or float64 when x64 is on and ``init`` was
  given float64 parameters.

  Attributes:
    norms: float ``[history]``: past finite norms (a ring buffer).
    position: int32 ``[]``: the slot the next norm is written to.
    size: int32 ``[]``: how many slots hold a norm (at most ``history``).
    norm: float ``[]``: the pre-clip global norm of the last update.
    threshold: float ``[]``: the percentile the last update was clipped to.
    scale: float ``[]``: the factor applied last step (1 = not clipped).
    count: int32 ``[]``: steps seen.
    clipped_count: int32 ``[]``: steps with a finite norm and ``scale < 1``.
    nonfinite_count: int32 ``[]``: steps whose norm was NaN or Inf.
  """
  norms: jax.Array
  position: jax.Array
  size: jax.Array
  norm: jax.Array
  threshold: jax.Array
  scale: jax.Array
  count: jax.Array
  clipped_count: jax.Array
  nonfinite_count: jax.Array

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike, history: int) -> "AutoClipState":
    """The state before the first step: an empty buffer of ``history``."""
    return cls(norms=jnp.zeros([history], dtype), position=counters.zero(),
               size=counters.zero(), norm=jnp.zeros([], dtype),
               threshold=jnp.zeros([], dtype), scale=jnp.ones([], dtype),
               count=counters.zero(), clipped_count=counters.zero(),
               nonfinite_count=counters.zero())


registry.register(AutoClipState, "auto_clip", hide=("norms", "position", "size"),
                  extras=lambda state: {"clip_rate": counters.clip_rate(state)})


def percentile_of_prefix(values: jax.Array, size: jax.Array,
                         q: jax.Array) -> jax.Array:
  """``numpy.percentile(values[:size], q)`` (linear) for a traced ``size``.

  Slots at or past ``size`` sort last as ``+inf``; the result interpolates
  between the two order statistics around index ``(size - 1) * q / 100``,
  written as numpy's ``_lerp`` is (from the nearer end). ``+inf`` when
  ``size == 0``. ``size * 100`` must fit in an int32.
  """
  valid = jnp.arange(values.shape[0]) < size
  ordered = jnp.sort(jnp.where(valid, values, jnp.inf))
  last = jnp.maximum(size - 1, 0)
  # The index (size - 1) * q / 100, split into its integer part and weight
  # with integer arithmetic where it can be exact: in plain float32 the
  # weight would be off by ~1e-5 at a few hundred entries, and the threshold
  # by that times the gap between two neighbouring norms.
  whole = jnp.floor(q)
  fraction = last.astype(jnp.float32) * (q - whole)  # in [0, size - 1)
  fraction_whole = jnp.floor(fraction)
  hundredths = last * whole.astype(jnp.int32) + fraction_whole.astype(jnp.int32)
  low_index = jnp.minimum(hundredths // 100, last)
  weight = ((hundredths % 100).astype(jnp.float32) +
            (fraction - fraction_whole)) / 100
  low = ordered[low_index]
  high = ordered[jnp.minimum(low_index + 1, last)]
  difference = high - low  # 0 when low and high are the same slot
  value = jnp.where(weight >= 0.5, high - difference * (1 - weight),
                    low + difference * weight)
  return jnp.where(size > 0, value, jnp.inf)


def step(state: AutoClipState, norm: jax.Array, *, percentile: Scalar,
         eps: Scalar) -> tuple[jax.Array, AutoClipState]:
  """One step of ``auto_clip``'s statistics: the factor for ``norm`` (in
  its accumulation dtype) and the state after it (see ``auto_clip``)."""
  dtype = state.norms.dtype  # the statistics' (see init), every step
  seen = running.to_statistics(norm, dtype)
  finite = jnp.isfinite(norm)
  # The length comes from the state: under inject_hyperparams `history`
  # is traced here.
  length = state.norms.shape[0]
  norms = jnp.where(finite, state.norms.at[state.position].set(seen),
                    state.norms)
  filled = jnp.where(finite, jnp.minimum(state.size + 1, length), state.size)
  position = jnp.where(finite, (state.position + 1) % length, state.position)
  threshold = percentile_of_prefix(norms, filled,
                                   jnp.asarray(percentile, jnp.float32))
  # From the norm itself: a float64 norm beyond float32 statistics.
  factor = scaling.clip_factor(norm, threshold.astype(norm.dtype), eps)
  return factor, AutoClipState(
      norms=norms, position=position.astype(jnp.int32),
      size=filled.astype(jnp.int32), norm=seen,
      threshold=threshold.astype(dtype), scale=factor.astype(dtype),
      **counters.step_counts(state, finite=finite, clipped=factor < 1))


def auto_clip(percentile: Scalar = 10.0, *, history: int = 1000,
              eps: Scalar = 1e-6, axis_name: AxisName = None,
              specs: PyTree = None, mask: masking.Mask = None
              ) -> optax.GradientTransformationExtraArgs:
  """Clips to a percentile of the gradient norms seen so far (AutoClip).

  Each step appends the global L2 norm ``g`` of the updates to the
  history, takes the ``percentile``-th percentile of it
  (``numpy.percentile``, linear, ``g`` included) as the threshold ``c``, and
  scales the updates by ``min(1, c / (g + eps))``: the reference's numbers
  while ``step <= history``, its first step never clipped (``c = g``). A NaN
  or Inf norm propagates, as in the reference, but stays out of the history
  (counted in ``nonfinite_count``). One outlier of any size takes one rank
  of the history for ``history`` steps at most ([docs/which.md](../which.md)).
  Injected hyperparameters: [docs/hyperparameters.md](../hyperparameters.md).

  Args:
    percentile: the percentile of past norms to clip to, in [0, 100]; the
      paper uses 10.
    history: how many past norms to keep (an int >= 1); fixes the state's
      shape (static under ``optax.inject_hyperparams``).
    eps: added to the norm before dividing (1e-6: PyTorch's
      ``clip_grad_norm_``).
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the
      updates are split over ([docs/distributed.md](../distributed.md)).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix).
    mask: leaves in the norm and the clip (a tree prefix of bools, or a
      callable of the updates, as ``optax.masked``'s); the others pass
      through untouched.

  Returns:
    An ``optax.GradientTransformation`` whose state is an ``AutoClipState``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip import auto_clip
    >>> tx = auto_clip(50.0)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> for norm in (1.0, 3.0, 2.0, 10.0):
    ...   updates, state = tx.update({"w": jnp.array([0.0, norm])}, state)
    >>> state.threshold  # median of 1, 3, 2 and 10
    Array(2.5, dtype=float32)
    >>> updates["w"]
    Array([0. , 2.5], dtype=float32)

  References:
    Seetharaman et al., [AutoClip: Adaptive Gradient Clipping for Source
    Separation Networks](https://arxiv.org/abs/2007.14469), 2020.
  """
  fn = "auto_clip"
  percentile = _validation.check_interval(fn, "percentile", percentile, 0, 100)
  size = _validation.check_buffer_size(fn, "history", history)
  eps = _validation.check_nonnegative(fn, "eps", eps)
  where = _core.Where.of(fn, axis_name, specs)
  mask = _validation.check_mask(fn, mask)

  def init_fn(params):
    length = _validation.require_buffer_size(fn, "history", size)
    return AutoClipState.fresh(running.statistics_dtype(params), length)

  def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
    del params, extra_args
    _validation.check_update(fn, updates, state, AutoClipState)
    norm = _core.measure(fn, updates, 2, where, given=grad_norm).total
    factor, new_state = step(state, norm, percentile=percentile, eps=eps)
    return scaling.scale_leaves(updates, factor), new_state

  tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  return tx if mask is None else masking.masked(fn, tx, mask)
