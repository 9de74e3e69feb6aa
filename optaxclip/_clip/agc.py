"""Adaptive gradient clipping (AGC): unit-wise, relative to the parameters.

Each "unit" of a leaf (an output unit of a linear or conv kernel) is clipped
so that its gradient norm is at most ``clipping`` times its parameter norm
(floored at ``eps``). Units follow ``optax.adaptive_grad_clip``: scalars and
vectors (after squeezing) are one unit, 2-D and 3-D leaves reduce over axis 0
(linear ``IO``, multi-head), 4-D over axes 0-2 (conv ``HWIO``), 5-D over
axes 0-3 (conv 3-D ``DHWIO``); ``axis=`` overrides. With ``layer_axis``
(scanned layers) the units are those of each layer's slice, chosen from
the slice's shape, and the layer axis is kept: units never mix layers.
Under ``shard_map`` units are chosen from each leaf's whole shape.

Unit norms are the library's one norm computation (``_norms``) with each
leaf keeping its non-unit axes: float32 at least whatever the leaf dtype,
right at every magnitude (the rescue runs only when a unit's plain sum
overflows or underflows), and, under ``shard_map``, the partial sums of the
gradients' and the parameters' units added with one all-reduce.
"""

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import base as optax_base

from optaxclip import _core, _tree, _validation
from optaxclip._clip import scaling
from optaxclip._stats import counters, registry
from optaxclip._types import AxisName, PyTree, Scalar

# optax's unitwise_clip divides by max(norm, 1e-6): kept for equal numbers.
DIV_EPS = 1e-6


class AGCState(NamedTuple):
  """State of ``adaptive_grad_clip``; every field is a scalar.

  Attributes:
    clipped_fraction: float32 ``[]``: the fraction of units clipped last
      step (of those with entries: a ``(0, n)`` weight's never count).
    clipped_units: int32 ``[]``: the units clipped last step.
    scale: float32 ``[]``: the smallest unit factor applied last step.
    count: int32 ``[]``: steps seen.
    clipped_count: int32 ``[]``: steps with a finite norm and a unit clipped.
    nonfinite_count: int32 ``[]``: steps with a NaN or Inf update norm.
  """
  clipped_fraction: jax.Array
  clipped_units: jax.Array
  scale: jax.Array
  count: jax.Array
  clipped_count: jax.Array
  nonfinite_count: jax.Array

  @classmethod
  def fresh(cls) -> "AGCState":
    """The state before the first step."""
    return cls(clipped_fraction=jnp.zeros([], jnp.float32),
               clipped_units=counters.zero(), scale=jnp.ones([], jnp.float32),
               count=counters.zero(), clipped_count=counters.zero(),
               nonfinite_count=counters.zero())


registry.register(AGCState, "agc",
                  extras=lambda state: {"clip_rate": counters.clip_rate(state)})


# The axes one AGC unit spans: an int or a tuple of ints, or None (optax's
# choice by rank).
Axis = int | tuple[int, ...] | None


def _check_axis(fn: str, axis: Axis) -> tuple[int, ...] | None:
  _validation.check_static(fn, "axis", axis, "None, an int or a tuple of ints")
  if axis is None:
    return None
  axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
  if not all(isinstance(a, numbers.Integral)
             and not isinstance(a, (bool, np.bool_)) for a in axes):
    raise TypeError(f"`{fn}(axis=...)` must be None, an int or a tuple of "
                    f"ints, got {axis!r}")
  return tuple(int(a) for a in axes)


def unit_factors(g_norm: jax.Array, max_norm: jax.Array,
                 div_eps: Scalar = DIV_EPS) -> jax.Array:
  """optax's unitwise clip as a factor: 1 where ``g_norm < max_norm``,
  else ``max_norm / max(g_norm, div_eps)`` (NaN where either is NaN)."""
  # Compared as bits: the same units clipped where subnormals flush.
  return jnp.where(_core.below(g_norm, max_norm), 1,
                   max_norm / jnp.maximum(g_norm, jnp.asarray(div_eps, g_norm.dtype)))


def _clip(fn: str, updates: PyTree, params: PyTree, clipping, eps,
          where: _core.Where, kept: _core.Kept):
  """The clipped updates and ``(clipped units, units, min factor, finite)``."""
  weights = _paired_params(fn, updates, params)
  if not weights:
    one, zero = jnp.ones([], jnp.float32), jnp.zeros([], jnp.float32)
    return updates, (zero, zero, one, jnp.bool_(True))
  # Gradients and parameters together: one all-reduce, one rescue check.
  grads, params = _core.measure_pair(fn, updates, weights, 2, where, kept)
  limits = jnp.asarray(clipping, jnp.float32) * jnp.maximum(
      params.units, jnp.asarray(eps, params.units.dtype))
  # optax: unclipped when g < limit, else limit / max(g, 1e-6); computed once,
  # for every device's units (statistics need no second all-reduce).
  factors = unit_factors(grads.units, limits)
  clipped = scaling.scale_leaves(updates, grads.to_leaves(factors))
  # Units of no entries (a (0, n) weight's) are never clipped: not counted.
  units = sum(math.prod(shape) for shape, entries in
              zip(grads.unit_shapes(), grads.entries_per_unit()) if entries)
  return clipped, (jnp.sum(factors < 1, dtype=jnp.float32),
                   jnp.asarray(units, jnp.float32),
                   jnp.min(factors, initial=1.0),
                   jnp.all(jnp.isfinite(grads.units)))


def _check(fn: str, clipping: Scalar, eps: Scalar, axis: Axis,
           axis_name: AxisName, specs: PyTree, layer_axis: PyTree = None):
  """``(clipping, eps, where, kept)``, checked (clamped when traced)."""
  clipping = _validation.check_nonnegative(fn, "clipping", clipping)
  eps = _validation.check_nonnegative(fn, "eps", eps)
  axes = _check_axis(fn, axis)
  _validation.check_layer_axis(fn, layer_axis)
  where = _core.Where.of(fn, axis_name, specs)
  if where.axis_names and specs is None:
    raise ValueError(
        f"`{fn}(axis_name=...)` needs `specs`: whether a unit's norm is summed "
        f"across devices depends on which dimensions of each leaf are split")
  return clipping, eps, where, _core.agc_units(axes, layer_axis)


def _paired_params(fn: str, updates: PyTree, params: PyTree) -> list[Any]:
  """The param leaf of each clippable update leaf, or a ValueError.

  Units are paired by tree path, so the trees must have one structure (as
  ``jax.tree.map`` requires in Optax's AGC) and paired leaves one shape.
  """
  _validation.check_tree(fn, "updates", updates)
  _validation.check_tree(fn, "params", params)
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
  param_paths, param_treedef = jax.tree_util.tree_flatten_with_path(params)
  if treedef != param_treedef:
    keys = {jax.tree_util.keystr(path) for path, _ in with_paths}
    param_keys = {jax.tree_util.keystr(path) for path, _ in param_paths}
    where = "; ".join(
        f"{what}: {', '.join(sorted(paths)[:5])}"
        for what, paths in (("only in updates", keys - param_keys),
                            ("only in params", param_keys - keys)) if paths)
    raise ValueError(
        f"`{fn}`: params and updates must have the same tree structure, unit "
        f"by unit ({where or f'{param_treedef} != {treedef}'}); pass the "
        f"params that the updates are for")
  weights = []
  for (path, x), (_, w) in zip(with_paths, param_paths):
    if not _tree.is_clippable(x):
      continue
    x, w = _tree.as_array(x), _tree.as_array(w)
    if not _tree.is_clippable(w) or w.shape != x.shape:
      what = (f"has shape {tuple(w.shape)}" if _tree.is_clippable(w)
              else f"is {w!r:.40}, not a floating array")
      raise ValueError(
          f"`{fn}`: leaf {jax.tree_util.keystr(path)} of the updates has shape "
          f"{tuple(x.shape)} but its param {what}; pass the params that the "
          f"updates are for")
    weights.append(w)
  return weights


def adaptive_grad_clip_fn(updates: PyTree, params: PyTree, clipping: Scalar, *,
                          eps: Scalar = 1e-3, axis: Axis = None,
                          axis_name: AxisName = None, specs: PyTree = None,
                          layer_axis: PyTree = None) -> PyTree:
  """Clips each unit of ``updates`` to ``clipping`` times its parameter norm.

  A unit ``u`` with gradient norm ``g`` and parameter norm ``w`` is
  multiplied by ``limit / g`` when ``g >= limit = clipping * max(w, eps)``:
  ``optax.adaptive_grad_clip``'s numbers (units as in the module docstring),
  with norms accumulated in float32 and safe from overflow.

  Args:
    updates: a pytree of gradients.
    params: the parameters, with the structure and leaf shapes of
      ``updates`` (a ValueError names the first leaf that differs).
    clipping: the largest ratio of gradient norm to parameter norm (>= 0).
    eps: the floor of the parameter norm, so zero-initialised parameters
      can still move (>= 0). Traced values:
      [docs/hyperparameters.md](../hyperparameters.md).
    axis: the axes one unit spans (an int or a tuple), for every leaf;
      None chooses them from each leaf's rank, as Optax does.
    axis_name: under ``shard_map``/``pmap``, the axis name(s) leaves are
      split over; needs ``specs`` ([docs/distributed.md](../distributed.md)).
    specs: with ``axis_name``, the leaves' ``PartitionSpec`` (tree prefix);
      ``params`` are split as ``updates``.
    layer_axis: the axis that stacks scanned layers (an int, or a tree
      prefix of int or None): each layer's slice is clipped as Optax's AGC
      clips that layer alone (units never mix layers).

  Returns:
    The clipped updates, with each leaf's dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip.functional import adaptive_grad_clip as adaptive_grad_clip_fn
    >>> params = {"w": jnp.array([[1.0, 1.0], [0.0, 1.0]])}
    >>> grads = {"w": jnp.array([[3.0, 0.1], [4.0, 0.1]])}
    >>> adaptive_grad_clip_fn(grads, params, 0.1)["w"]  # column 0 cut to 0.1
    Array([[0.06, 0.1 ],
           [0.08, 0.1 ]], dtype=float32)
    >>> stacked = {"w": jnp.stack([params["w"], 10 * params["w"]])}
    >>> big = {"w": jnp.stack([grads["w"], grads["w"]])}
    >>> adaptive_grad_clip_fn(big, stacked, 0.1, layer_axis=0)["w"][:, :, 0]
    Array([[0.06, 0.08],
           [0.6 , 0.8 ]], dtype=float32)

  References:
    Brock et al., 2021 (see ``optaxclip.adaptive_grad_clip``).
  """
  fn = "adaptive_grad_clip"
  clipping, eps, where, kept = _check(fn, clipping, eps, axis, axis_name,
                                      specs, layer_axis)
  clipped, _ = _clip(fn, updates, params, clipping, eps, where, kept)
  return clipped


def adaptive_grad_clip(clipping: Scalar, *, eps: Scalar = 1e-3, axis: Axis = None,
                       axis_name: AxisName = None, specs: PyTree = None,
                       layer_axis: PyTree = None
                       ) -> optax.GradientTransformation:
  """Clips each unit's update to ``clipping`` times its parameter norm (AGC).

  ``optax.adaptive_grad_clip``'s numbers and units (``eps`` and ``axis``
  keyword-only here), with float32 norms for half-precision leaves, finite
  norms for huge gradients, ``shard_map`` support, and a state counting the
  clipped units (``optaxclip.stats``; ``state=None`` is a fresh one).
  ``update`` needs ``params`` shaped as the updates (a ValueError names the
  leaves that differ); a NaN or Inf gradient propagates, as in Optax, and
  is counted. Injected hyperparameters:
  [docs/hyperparameters.md](../hyperparameters.md).

  Args:
    clipping: the largest ratio of gradient norm to parameter norm (>= 0);
      the paper's NFNets use 0.01 at batch size 4096.
    eps: the floor of the parameter norm (>= 0).
    axis: the axes one unit spans (an int or a tuple), for every leaf;
      None chooses them from each leaf's rank, as Optax does.
    axis_name: under ``shard_map``/``pmap``, the axis name(s) leaves are
      split over; needs ``specs`` ([docs/distributed.md](../distributed.md)).
    specs: with ``axis_name``, the leaves' ``PartitionSpec`` (tree prefix);
      the params are split as the updates.
    layer_axis: for scanned (stacked) layers, the axis that stacks them (an
      int, or a tree prefix of the updates with int or None leaves): each
      layer's slice is clipped as Optax's AGC clips that layer alone, and
      its units count one per layer in the state.

  Returns:
    An ``optax.GradientTransformation``; its state, an ``AGCState``, counts
    the clipped units.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from optaxclip import adaptive_grad_clip
    >>> tx = optax.chain(adaptive_grad_clip(0.1), optax.sgd(1.0))
    >>> params = {"w": jnp.array([[1.0, 1.0], [0.0, 1.0]])}
    >>> grads = {"w": jnp.array([[3.0, 0.1], [4.0, 0.1]])}
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> updates["w"][:, 0]
    Array([-0.06, -0.08], dtype=float32)
    >>> state[0].clipped_fraction
    Array(0.5, dtype=float32)

  References:
    Brock et al., [High-Performance Large-Scale Image Recognition Without
    Normalization](https://arxiv.org/abs/2102.06171), 2021.
  """
  fn = "adaptive_grad_clip"
  clipping, eps, where, kept = _check(fn, clipping, eps, axis, axis_name,
                                      specs, layer_axis)

  def init_fn(params):
    del params
    return AGCState.fresh()

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(f"`{fn}`: {optax_base.NO_PARAMS_MSG}")
    if state is None:  # stateless use, as optax's AGC allows: a fresh state
      state = init_fn(params)
    _validation.check_state(fn, state, AGCState)
    clipped, (hits, units, smallest, finite) = _clip(
        fn, updates, params, clipping, eps, where, kept)
    new_state = AGCState(
        clipped_fraction=(hits / jnp.maximum(units, 1)).astype(jnp.float32),
        clipped_units=hits.astype(jnp.int32),
        scale=smallest.astype(jnp.float32),
        **counters.step_counts(state, finite=finite, clipped=hits > 0))
    return clipped, new_state

  return optax.GradientTransformation(init_fn, update_fn)


def unitwise_norm(x: jax.typing.ArrayLike, *, axis: Axis = None,
                  layer_axis: int | None = None) -> jax.Array:
  """The L2 norm of each unit of ``x``, broadcast to ``x``'s shape.

  ``optax.transforms.unitwise_norm``'s units and numbers (there ``axis`` may
  be positional): scalars and vectors (after squeezing) are one unit, 2-D
  and 3-D arrays reduce over axis 0, 4-D over axes 0-2, 5-D over axes 0-3;
  ``axis`` overrides. The norm is the library's: accumulated in float32
  at least whatever ``x``'s dtype, and overflow-safe (units whose squares
  overflow float32 get their finite norm, where optax's is ``inf``).

  Args:
    x: an array (a number or a nested list is taken as one).
    axis: the axes one unit spans (an int or a tuple); None chooses them
      from ``x``'s rank. With ``layer_axis``, the axes of one layer's slice.
    layer_axis: the axis that stacks layers (scanned layers), or None: each
      layer's slice gets the units optax would give it alone.

  Returns:
    An array of ``x``'s shape, in float32 (float64 for float64 ``x`` under
    x64): each entry its unit's norm.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip.functional import unitwise_norm
    >>> unitwise_norm(jnp.array([[3.0, 1.0], [4.0, 0.0]]))  # columns
    Array([[5., 1.],
           [5., 1.]], dtype=float32)
    >>> unitwise_norm(jnp.full(4, 1e30))  # optax: inf
    Array([2.e+30, 2.e+30, 2.e+30, 2.e+30], dtype=float32)
  """
  fn = "unitwise_norm"
  axes = _check_axis(fn, axis)
  _validation.check_layer_axis(fn, layer_axis)
  x = jnp.asarray(x)
  if not _tree.is_clippable(x):
    x = x.astype(jnp.float32)  # integer and boolean arrays, as optax
  measured = _core.measure(fn, [x], 2, _core.HERE,
                           _core.agc_units(axes, layer_axis, name="x"))
  return jnp.broadcast_to(measured.to_leaves(measured.units)[0], x.shape)


def unitwise_clip(g_norm: jax.typing.ArrayLike, max_norm: jax.typing.ArrayLike,
                  grad: jax.typing.ArrayLike, *, div_eps: Scalar = DIV_EPS
                  ) -> jax.Array:
  """``grad`` scaled, entry by entry, to the norm ``max_norm``.

  ``optax.transforms.unitwise_clip``'s numbers: where ``g_norm < max_norm``
  the entry is kept, elsewhere it is multiplied by ``max_norm / max(g_norm,
  div_eps)``. The three arrays have one shape (``unitwise_norm`` gives
  ``g_norm`` in it); the result has ``grad``'s dtype.

  Args:
    g_norm: each entry's unit norm (as ``unitwise_norm`` returns it).
    max_norm: each entry's largest unit norm (AGC: ``clipping * max(param
      norm, eps)``).
    grad: the gradient.
    div_eps: the floor of the divisor (a finite number > 0), so that a zero
      norm divides nothing by zero.

  Returns:
    The clipped gradient, with ``grad``'s shape and dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip.functional import unitwise_clip, unitwise_norm
    >>> grad = jnp.array([[3.0, 0.1], [4.0, 0.1]])
    >>> unitwise_clip(unitwise_norm(grad), jnp.full((2, 2), 1.0), grad)
    Array([[0.6, 0.1],
           [0.8, 0.1]], dtype=float32)
  """
  fn = "unitwise_clip"
  div_eps = _validation.check_positive(fn, "div_eps", div_eps, traced=DIV_EPS)
  g_norm, max_norm, grad = (jnp.asarray(a) for a in (g_norm, max_norm, grad))
  shapes = {"g_norm": g_norm.shape, "max_norm": max_norm.shape}
  for name, shape in shapes.items():
    if shape != grad.shape:
      raise ValueError(
          f"`{fn}({name}=...)` must have grad's shape {tuple(grad.shape)}, got "
          f"{tuple(shape)}; unitwise_norm(grad) gives norms in that shape")
  clipped = grad * unit_factors(g_norm, max_norm, div_eps)
  return clipped.astype(grad.dtype) if _tree.is_clippable(grad) else clipped
