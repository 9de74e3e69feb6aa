"""Clipping by norm: per leaf, global, and PyTorch's ``clip_grad_norm_``.

Every leaf is multiplied by one scalar factor ``s``. With ``eps == 0``
(Optax/TensorFlow) ``s = max_norm / norm`` when ``norm > max_norm``, else 1;
with ``eps > 0`` (PyTorch/MindSpore) ``s = min(1, max_norm / (norm + eps))``.
Both are one formula, ``s = max_norm / (norm + eps)`` unless
``norm + eps <= max_norm``, so ``eps`` may be injected and traced too.

The transforms' ``update`` accepts ``state=None``, as Optax's stateless
clippers do, and starts from a fresh state: the state only logs.

A multiply by a scalar, rather than a ``select`` between the gradient and a
clipped copy, lets XLA fuse the factor into whatever reads the update next
(inside ``optax.chain(clip, adamw)``: the optimizer's own pass).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxclip import (
  _counters,
  _groups,
  _leaf_norms,
  _nonfinite,
  _norms,
  _running_stats,
  _scaling,
  _stats,
  _tree,
  _validation,
)
from optaxclip._types import AxisName, NonFinite, Ord, Scalar

PyTree = Any

PYTORCH_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ divides by norm + 1e-6


class ClipState(NamedTuple):
  """State of the norm-based clippers.

  ``float`` below is float32, or float64 when x64 is on and ``init`` was
  given float64 parameters (so that a float64 norm beyond float32's range
  is logged, not taken for Inf).

  Attributes:
    norm: float ``[]``: the pre-clip norm of the last update (per-leaf
      clippers: the largest leaf norm).
    scale: float ``[]``: the factor applied last step (per leaf: the
      smallest).
    count: int32 ``[]``: steps seen.
    clipped_count: int32 ``[]``: steps with a finite norm and ``scale < 1``.
    nonfinite_count: int32 ``[]``: steps whose norm was NaN or Inf.
    leaf_norms: with ``leaf_norms=True``, the last update's norm of every
      leaf: a tree of the gradients' structure, float ``[]`` per clippable
      leaf (``[layers]`` where ``layer_axis`` gives one), None elsewhere;
      otherwise None (nothing kept).
  """
  norm: jax.Array
  scale: jax.Array
  count: jax.Array
  clipped_count: jax.Array
  nonfinite_count: jax.Array
  leaf_norms: PyTree = None

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike,
            leaf_norms: PyTree = None) -> "ClipState":
    """The state before the first step, its floats in ``dtype``."""
    return cls(norm=jnp.zeros([], dtype), scale=jnp.ones([], dtype),
               count=_counters.zero(), clipped_count=_counters.zero(),
               nonfinite_count=_counters.zero(), leaf_norms=leaf_norms)


_stats.register(ClipState, "clip", hide=("leaf_norms",),
                extras=lambda state: {"clip_rate": _counters.clip_rate(state),
                                      **_leaf_norms.entries(state.leaf_norms)})


class GroupClipState(NamedTuple):
  """State of ``clip_by_global_norm(groups=...)``.

  ``optaxclip.stats`` reports each group's entries as ``clip/<label>/...``.

  Attributes:
    groups: a dict from each group's label to its ``ClipState`` (its norm,
      factor and step counts).
    leaf_norms: as in ``ClipState``.
  """
  groups: dict[str, ClipState]
  leaf_norms: PyTree = None


def _group_stats(state: GroupClipState) -> dict[str, jax.Array]:
  entries = {f"{label}/{key}": value
             for label, group in state.groups.items()
             for key, value in _stats.summary(group).items()}
  return {**entries, **_leaf_norms.entries(state.leaf_norms)}


_stats.register(GroupClipState, "clip", _group_stats)


def init_clip_state(params: PyTree = None, *, keep: Any = None,
                    leaf_norms: bool = False) -> ClipState:
  """A fresh ``ClipState``, its floats in the statistics dtype of ``params``
  (with ``leaf_norms``, zero norms per leaf, per layer where ``keep`` says)."""
  dtype = _running_stats.statistics_dtype(params)
  norms = _leaf_norms.zeros(params, keep, dtype) if leaf_norms else None
  return ClipState.fresh(dtype, norms)


def _check_common(fn: str, max_norm: Any, ord: Any, eps: Any,
                  ord_name: str = "ord") -> tuple[Any, Any, Any]:
  """``(max_norm, p, eps)`` checked (clamped when traced: see ``_validation``)."""
  return (_validation.check_nonnegative(fn, "max_norm", max_norm,
                                        allow_inf=True),
          _validation.check_ord(fn, ord, ord_name),
          _validation.check_nonnegative(fn, "eps", eps))


class _Clipped(NamedTuple):
  tree: PyTree  # the clipped updates
  norm: jax.Array  # the global norm, or per leaf the largest
  factor: jax.Array  # the factor, or per leaf the smallest
  leaf_norms: PyTree  # the tree of leaf (or layer) norms, or None


def _clip_each(fn: str, tree: PyTree, max_norm, p, eps, axis_name, specs, *,
               leaf_norms: bool = False, layer_axis: PyTree = None
               ) -> _Clipped:
  """Every leaf (or, with ``layer_axis``, every layer slice) clipped by its
  own norm."""
  _validation.check_tree(fn, "the tree", tree)
  leaves = _tree.clippable_leaves(tree)
  keep = _leaf_norms.layer_keep(fn, tree, layer_axis)
  reduction = _norms.make_reduction(fn, tree, axis_name, specs, keep)
  if keep is None:
    norms = _norms.leaf_norms(leaves, p, reduction)
    factors = _scaling.clip_factor(norms, max_norm, eps)
    clipped = _scaling.scale_leaves(tree, factors)
    per_leaf = list(norms) if leaf_norms else None
  else:
    units = _norms.units(leaves, p, reduction, keep)
    per_leaf = units.here
    # One factor per layer, shaped to broadcast against its leaf.
    clipped = _scaling.scale_leaves(tree, [
        _scaling.clip_factor(n, max_norm, eps).reshape(
            [d if a in kept else 1 for a, d in enumerate(x.shape)])
        for n, x, kept in zip(per_leaf, leaves, keep)])
    # Every device's layers: the statistics need no second all-reduce.
    norms = jnp.concatenate(units.everywhere or [jnp.zeros([0])])
    factors = _scaling.clip_factor(norms, max_norm, eps)
  norm, factor = jnp.max(norms, initial=0), jnp.min(factors, initial=1)
  return _Clipped(clipped, norm, factor, None if per_leaf is None or not
                  leaf_norms else _leaf_norms.norm_tree(tree, per_leaf))


def _clip_global(fn: str, tree: PyTree, max_norm, p, eps, axis_name, specs,
                 *, leaf_norms: bool = False,
                 layer_axis: PyTree = None) -> _Clipped:
  """The tree clipped by its global norm."""
  _validation.check_tree(fn, "the tree", tree)
  norm, norms = _leaf_norms.measure(fn, tree, p, axis_name, specs,
                                    leaf_norms=leaf_norms,
                                    layer_axis=layer_axis)
  factor = _scaling.clip_factor(norm, max_norm, eps)
  return _Clipped(_scaling.scale_leaves(tree, factor), norm, factor, norms)


def clip_by_norm_fn(tree: PyTree, max_norm: Scalar, *, ord: Ord = 2,
                    eps: Scalar = 0.0, axis_name: AxisName = None,
                    specs: PyTree = None, layer_axis: PyTree = None) -> PyTree:
  """Clips every leaf of ``tree`` by its own ``ord``-norm.

  Each floating leaf ``x`` becomes ``x * s`` with ``s`` computed from
  ``norm(x)`` as in the module docstring (TensorFlow's ``tf.clip_by_norm`` with
  ``eps=0``, MindSpore's ``ops.clip_by_norm`` with ``eps=1e-6``).

  Traced arguments (inside ``jit``) cannot be checked: a negative or NaN
  ``max_norm`` then acts as 0 (the result is zero), a negative or NaN
  ``eps`` as 0, and an ``ord`` that is not > 0 as 2.

  Args:
    tree: a pytree of arrays.
    max_norm: the largest norm a leaf may keep (a number >= 0; ``inf``
      never clips).
    ord: the norm order: any number ``p > 0`` or ``inf``.
    eps: added to the norm before dividing (0: exact threshold).
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the updates
      are split over: the norms are then those of the whole, unsplit updates,
      with one all-reduce (see ``functional.global_norm``).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix, as
      ``shard_map``'s ``in_specs``): a leaf replicated on an axis counts once.
    layer_axis: an int, or a tree prefix of the updates with int or None
      leaves: the axis that stacks scanned layers. Each layer's slice is then
      clipped by its own norm.

  Returns:
    The clipped tree, with each leaf's dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> oc.functional.clip_by_norm([jnp.array([3.0, 4.0]), jnp.array([0.3, 0.4])], 1.0)
    [Array([0.6, 0.8], dtype=float32), Array([0.3, 0.4], dtype=float32)]
  """
  max_norm, p, eps = _check_common("clip_by_norm", max_norm, ord, eps)
  _validation.check_specs("clip_by_norm", specs, axis_name)
  return _clip_each("clip_by_norm", tree, max_norm, p, eps, axis_name, specs,
                    layer_axis=layer_axis).tree


def _check_use_norm(fn: str, use_norm: Any) -> Any:
  """A given norm: a number >= 0, NaN or Inf (they propagate, as norms).

  Traced, a negative one acts as 0 (nothing is clipped); NaN stays NaN.
  """
  number = _validation.scalar(fn, "use_norm", use_norm)
  if _validation.is_traced(number):
    return jnp.where(number < 0, jnp.zeros_like(number), number)
  if number < 0:
    raise ValueError(
        f"`{fn}(use_norm=...)` must be a norm: a number >= 0 (NaN and inf "
        f"are passed on as the norm of non-finite gradients), got {use_norm!r}")
  return use_norm


def _clip_by_given_norm(fn: str, tree: PyTree, max_norm, eps,
                        use_norm) -> tuple[PyTree, jax.Array]:
  """``tree`` scaled for the norm ``use_norm``; no reduction over the tree."""
  _validation.check_tree(fn, "the tree", tree)
  acc = _tree.accumulation_dtype(_tree.clippable_leaves(tree))
  norm = jnp.asarray(use_norm, acc)
  factor = _scaling.clip_factor(norm, max_norm, eps)
  return _scaling.scale_leaves(tree, factor), norm


def clip_by_global_norm_fn(tree: PyTree, max_norm: Scalar, *, ord: Ord = 2,
                           eps: Scalar = 0.0, axis_name: AxisName = None,
                           specs: PyTree = None, use_norm: Scalar | None = None
                           ) -> tuple[PyTree, jax.Array]:
  """Scales ``tree`` so that its global ``ord``-norm is at most ``max_norm``.

  All floating leaves are multiplied by one factor ``s`` computed from the
  norm of the whole tree (see ``global_norm``): ``eps=0`` gives Optax's and
  TensorFlow's ``clip_by_global_norm``, ``eps=1e-6`` PyTorch's
  ``clip_grad_norm_``.

  With ``use_norm``, the tree is clipped by that norm instead, measured
  beforehand (accumulated over micro-batches, all-reduced by hand, or one
  norm for a tree clipped in pieces): nothing is reduced over the tree, and
  ``ord``, ``axis_name`` and ``specs`` play no part. This is TensorFlow's
  ``tf.clip_by_global_norm(t_list, clip_norm, use_norm=...)`` (``eps=0``)
  and PyTorch's ``clip_grads_with_norm_(params, max_norm, total_norm)``
  (``eps=1e-6``). A NaN ``use_norm`` makes every leaf NaN, as in both. An
  infinite one gives the factor 0, as a measured infinite norm does and as
  in PyTorch: finite entries become 0 (TensorFlow makes every leaf NaN).

  Traced arguments (inside ``jit``) cannot be checked: a negative or NaN
  ``max_norm`` then acts as 0 (the result is zero), a negative or NaN
  ``eps`` as 0, an ``ord`` that is not > 0 as 2, and a negative
  ``use_norm`` as 0 (nothing is clipped; a NaN one stays NaN).

  Args:
    tree: a pytree of arrays.
    max_norm: the largest global norm (a number >= 0; ``inf`` never clips,
      the norm is still measured).
    ord: the norm order: any number ``p > 0`` or ``inf``.
    eps: added to the norm before dividing (0: exact threshold).
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the updates
      are split over: the norms are then those of the whole, unsplit updates,
      with one all-reduce (see ``functional.global_norm``).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix, as
      ``shard_map``'s ``in_specs``): a leaf replicated on an axis counts once.
    use_norm: the norm to clip by (a scalar >= 0; NaN and inf are passed
      on), or None to measure the tree's own.

  Returns:
    ``(clipped_tree, norm)``: the tree with each leaf's dtype, and the pre-clip
    norm (float32, or float64 for float64 trees under x64); with
    ``use_norm``, that norm in this dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> grads = [jnp.array([3.0, 4.0]), jnp.array([1.0, 2.0])]
    >>> clipped, norm = oc.functional.clip_by_global_norm(grads, 5.0)
    >>> norm
    Array(5.477226, dtype=float32)
    >>> clipped
    [Array([2.7386127, 3.6514835], dtype=float32), Array([0.9128709, 1.8257419], dtype=float32)]
    >>> clipped, norm = oc.functional.clip_by_global_norm(grads, 5.0, use_norm=10.0)
    >>> norm  # the norm given
    Array(10., dtype=float32)
    >>> clipped  # clipped by it: a factor of 5 / 10
    [Array([1.5, 2. ], dtype=float32), Array([0.5, 1. ], dtype=float32)]
  """
  max_norm, p, eps = _check_common("clip_by_global_norm", max_norm, ord, eps)
  _validation.check_specs("clip_by_global_norm", specs, axis_name)
  if use_norm is not None:
    use_norm = _check_use_norm("clip_by_global_norm", use_norm)
    return _clip_by_given_norm("clip_by_global_norm", tree, max_norm, eps,
                               use_norm)
  clipped = _clip_global("clip_by_global_norm", tree, max_norm, p, eps,
                         axis_name, specs)
  return clipped.tree, clipped.norm


def _norm_clipper(fn: str, max_norm, p, eps, axis_name, specs, nonfinite, *,
                  per_leaf: bool, leaf_norms: bool, layer_axis: PyTree
                  ) -> optax.GradientTransformation:
  _validation.check_choice(fn, "nonfinite", nonfinite, _nonfinite.MODES)
  _validation.check_specs(fn, specs, axis_name)
  _validation.check_bool(fn, "leaf_norms", leaf_norms)
  layer_axis = _validation.check_layer_axis(fn, layer_axis)
  clip = _clip_each if per_leaf else _clip_global

  def init_fn(params):
    return init_clip_state(
        params, keep=_leaf_norms.layer_keep(fn, params, layer_axis),
        leaf_norms=leaf_norms)

  def update_fn(updates, state, params=None):
    del params
    if state is None:  # stateless use, as optax's clippers allow: a fresh state
      state = init_fn(updates)
    _validation.check_state(fn, state, ClipState)
    clipped = clip(fn, updates, max_norm, p, eps, axis_name, specs,
                   leaf_norms=leaf_norms, layer_axis=layer_axis)
    out, norm, factor = clipped.tree, clipped.norm, clipped.factor
    finite = jnp.isfinite(norm)
    if nonfinite == "raise":
      # The leaves as given: in the clipped ones a NaN factor is everywhere.
      _nonfinite.raise_if_nonfinite(fn, updates, norm)
    elif nonfinite == "zero":
      out = _scaling.zero_unless(finite, out)
      factor = jnp.where(finite, factor, 0)
    dtype = state.norm.dtype
    new_state = ClipState(
        norm=norm.astype(dtype), scale=factor.astype(dtype),
        **_counters.step_counts(state, finite=finite, clipped=factor < 1),
        leaf_norms=jax.tree.map(lambda n: n.astype(dtype), clipped.leaf_norms))
    return out, new_state

  return optax.GradientTransformation(init_fn, update_fn)


def _group_clipper(fn: str, max_norm, p, eps, axis_name, specs, nonfinite,
                   groups: _groups.Labels, *, leaf_norms: bool,
                   layer_axis: PyTree) -> optax.GradientTransformation:
  """``clip_by_global_norm`` with ``groups``: each clipped by its own norm,
  all from one pass over the gradients and one all-reduce."""
  _validation.check_choice(fn, "nonfinite", nonfinite, _nonfinite.MODES)
  _validation.check_specs(fn, specs, axis_name)
  _validation.check_bool(fn, "leaf_norms", leaf_norms)
  layer_axis = _validation.check_layer_axis(fn, layer_axis)
  groups = _groups.check_labels(fn, groups)

  def init_fn(params):
    keep = _leaf_norms.layer_keep(fn, params, layer_axis)
    dtype = _running_stats.statistics_dtype(params)
    labels = dict.fromkeys(_groups.leaf_labels(fn, params, groups))
    for label in labels:
      _groups.limit_of(fn, max_norm, label)
    return GroupClipState(
        {label: ClipState.fresh(dtype) for label in labels},
        _leaf_norms.zeros(params, keep, dtype) if leaf_norms else None)

  def update_fn(updates, state, params=None):
    del params
    if state is None:
      state = init_fn(updates)
    _validation.check_state(fn, state, GroupClipState)
    labels = _groups.leaf_labels(fn, updates, groups)
    if set(labels) != set(state.groups):
      raise ValueError(
          f"`{fn}(groups=...)` labels the updates {sorted(set(labels))} but "
          f"the state has groups {sorted(state.groups)}; call init with "
          f"the parameters the updates are for")
    leaves = _tree.clippable_leaves(updates)
    keep = (_leaf_norms.layer_keep(fn, updates, layer_axis)
            or ((),) * len(leaves))
    reduction = _norms.make_reduction(fn, updates, axis_name, specs, keep)
    units = _norms.units(leaves, p, reduction, keep)
    per_leaf = units.here
    # From every device's layers: the same group norms on each device.
    norms = _groups.group_norms(labels, units.everywhere, p)
    factors = {label: _scaling.clip_factor(
        norm, _groups.limit_of(fn, max_norm, label), eps)
               for label, norm in norms.items()}
    finite = {label: jnp.isfinite(norm) for label, norm in norms.items()}
    if nonfinite == "raise" and norms:  # (no groups: an empty tree)
      _nonfinite.raise_if_nonfinite(
          fn, updates, jnp.max(jnp.stack(list(norms.values()))))
    elif nonfinite == "zero":
      factors = {label: jnp.where(finite[label], f, 0)
                 for label, f in factors.items()}
    clipped = _scaling.scale_leaves(
        updates, [factors[label] for label in labels])
    if nonfinite == "zero":
      clipped = _tree.map_clippable_indexed(
          lambda x, i: jnp.where(finite[labels[i]], x, jnp.zeros_like(x)),
          clipped)
    new_groups = {}
    for label, old in state.groups.items():
      dtype = old.norm.dtype
      new_groups[label] = ClipState(
          norm=norms[label].astype(dtype),
          scale=factors[label].astype(dtype),
          **_counters.step_counts(old, finite=finite[label],
                                  clipped=factors[label] < 1))
    kept_norms = None
    if leaf_norms:
      # The state's dtype (no group at all: an empty tree, nothing kept).
      dtype = next((group.norm.dtype for group in state.groups.values()),
                   jnp.float32)
      kept_norms = _leaf_norms.norm_tree(
          updates, [n.astype(dtype) for n in per_leaf])
    return clipped, GroupClipState(new_groups, kept_norms)

  return optax.GradientTransformation(init_fn, update_fn)


def clip_by_norm(max_norm: Scalar, *, ord: Ord = 2, eps: Scalar = 0.0,
                 axis_name: AxisName = None, specs: PyTree = None,
                 nonfinite: NonFinite = "propagate", layer_axis: PyTree = None,
                 leaf_norms: bool = False) -> optax.GradientTransformation:
  """Clips every leaf of the updates by its own norm.

  The transform form of ``optaxclip.functional.clip_by_norm``. Its state
  (``ClipState``) logs the largest leaf norm and the smallest factor.

  Hyperparameters injected with ``optax.inject_hyperparams`` are checked
  when ``init`` runs eagerly. Traced (a jitted update after a change of the
  state's hyperparameters) they cannot be: a negative or NaN ``max_norm``
  then acts as 0 (the update is zero), a negative or NaN ``eps`` as 0, and
  an order that is not > 0 as 2.

  Args:
    max_norm: the largest norm a leaf may keep (a number >= 0; ``inf``
      never clips).
    ord: the norm order: any number ``p > 0`` or ``inf``.
    eps: added to each norm before dividing (0: exact threshold).
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the updates
      are split over: the norms are then those of the whole, unsplit updates,
      with one all-reduce (see ``functional.global_norm``).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix, as
      ``shard_map``'s ``in_specs``): a leaf replicated on an axis counts once.
    nonfinite: ``"propagate"``, ``"zero"`` or ``"raise"``: what to do when a
      norm is NaN or Inf.
    layer_axis: an int, or a tree prefix of the updates with int or None
      leaves: the axis that stacks scanned layers. Each layer's slice is then
      clipped by its own norm (a vector of norms per such leaf).
    leaf_norms: keep the norm of every floating leaf in the state
      (``ClipState.leaf_norms``, reported by ``optaxclip.stats`` as
      ``clip/leaf_norm/<path>[/<layer>]``), from the same partial sums.

  Returns:
    An ``optax.GradientTransformation``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> tx = oc.clip_by_norm(1.0)
    >>> updates, state = tx.update([jnp.array([3.0, 4.0])], tx.init(None))
    >>> updates, state.norm
    ([Array([0.6, 0.8], dtype=float32)], Array(5., dtype=float32))
  """
  max_norm, p, eps = _check_common("clip_by_norm", max_norm, ord, eps)
  return _norm_clipper("clip_by_norm", max_norm, p, eps, axis_name, specs,
                       nonfinite, per_leaf=True, leaf_norms=leaf_norms,
                       layer_axis=layer_axis)


def clip_by_global_norm(max_norm: Scalar, *, ord: Ord = 2, eps: Scalar = 0.0,
                        axis_name: AxisName = None, specs: PyTree = None,
                        nonfinite: NonFinite = "propagate",
                        leaf_norms: bool = False, layer_axis: PyTree = None,
                        groups: _groups.Labels = None
                        ) -> optax.GradientTransformation:
  """Scales the updates so that their global norm is at most ``max_norm``.

  A drop-in for ``optax.clip_by_global_norm`` (the same numbers with the
  defaults, to within a few float32 ulps: leaves are multiplied by the
  factor ``max_norm / norm``, computed once, where Optax divides each leaf
  by the norm and multiplies by ``max_norm``) whose state keeps the
  pre-clip norm for logging (read it with ``optaxclip.stats``), and which
  stays finite for finite gradients of any magnitude and dtype. Like Optax's, its ``update`` accepts
  ``state=None`` (as a fresh state).

  Hyperparameters injected with ``optax.inject_hyperparams`` are checked
  when ``init`` runs eagerly. Traced (a jitted update after a change of the
  state's hyperparameters) they cannot be: a negative or NaN ``max_norm``
  then acts as 0 (the update is zero), a negative or NaN ``eps`` as 0, and
  an order that is not > 0 as 2.

  Args:
    max_norm: the largest global norm (a number >= 0; ``inf`` never clips,
      the norm is still measured).
    ord: the norm order: any number ``p > 0`` or ``inf``.
    eps: added to the norm before dividing: 0 (Optax, TensorFlow) clips
      exactly at ``max_norm``; 1e-6 is PyTorch's ``clip_grad_norm_``.
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the updates
      are split over: the norms are then those of the whole, unsplit updates,
      with one all-reduce (see ``functional.global_norm``).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix, as
      ``shard_map``'s ``in_specs``): a leaf replicated on an axis counts once.
    nonfinite: what to do when the norm is NaN or Inf: ``"propagate"`` (as
      Optax/PyTorch/TensorFlow: the update carries the NaN), ``"zero"`` (the
      update becomes zeros) or ``"raise"`` (an error naming the leaves that
      hold NaN/Inf, eagerly and under ``jit``). ``"propagate"`` and
      ``"zero"`` count such steps in the state's ``nonfinite_count``;
      ``"raise"`` returns no state.
    leaf_norms: keep the norm of every floating leaf in the state
      (``ClipState.leaf_norms``, reported by ``optaxclip.stats`` as
      ``clip/leaf_norm/<path>[/<layer>]``), from the same partial sums as the
      global norm (no second pass).
    layer_axis: an int, or a tree prefix of the updates with int or None
      leaves: the axis that stacks scanned layers. With ``leaf_norms``, those
      leaves keep one norm per layer; the global norm does not change.
    groups: labels for norm groups: a tree prefix of the updates with string
      leaves (as ``optax.partition``'s ``param_labels``) or a callable from
      the updates to one. Each group is clipped by its own global norm, all
      from one pass (and one all-reduce); ``max_norm`` may then be a dict
      from label to limit, and the state is a ``GroupClipState``
      (``stats``: ``clip/<label>/norm``, ...).

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``ClipState`` (with
    ``groups``, a ``GroupClipState``).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optaxclip as oc
    >>> tx = optax.chain(oc.clip_by_global_norm(1.0), optax.sgd(1.0))
    >>> params = {"w": jnp.array([3.0, 4.0])}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> updates["w"]
    Array([-0.6, -0.8], dtype=float32)
    >>> oc.stats(state)["clip/norm"]
    Array(5., dtype=float32)
    >>> grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[0.3], [0.4]])}
    >>> tx = oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis={"a": None, "b": 0})
    >>> _, state = tx.update(grads, tx.init(grads))
    >>> state.leaf_norms
    {'a': Array(5., dtype=float32), 'b': Array([0.3, 0.4], dtype=float32)}
    >>> tx = oc.clip_by_global_norm({"x": 1.0, "y": 1.0}, groups={"a": "x", "b": "y"})
    >>> updates, state = tx.update(grads, tx.init(grads))
    >>> updates["b"]  # its group's norm is 0.5: not clipped
    Array([[0.3],
           [0.4]], dtype=float32)
  """
  fn = "clip_by_global_norm"
  p = _validation.check_ord(fn, ord)
  eps = _validation.check_nonnegative(fn, "eps", eps)
  max_norm = _groups.check_max_norms(fn, max_norm, groups is not None)
  if groups is not None:
    return _group_clipper(fn, max_norm, p, eps, axis_name, specs, nonfinite,
                          groups, leaf_norms=leaf_norms, layer_axis=layer_axis)
  return _norm_clipper(fn, max_norm, p, eps, axis_name, specs, nonfinite,
                       per_leaf=False, leaf_norms=leaf_norms,
                       layer_axis=layer_axis)


def clip_grad_norm(max_norm: Scalar, norm_type: Ord = 2.0, *,
                   error_if_nonfinite: bool = False,
                   axis_name: AxisName = None, specs: PyTree = None,
                   leaf_norms: bool = False, layer_axis: PyTree = None
                   ) -> optax.GradientTransformation:
  """PyTorch's ``torch.nn.utils.clip_grad_norm_`` as an Optax transform.

  PyTorch's formula: every gradient is multiplied by
  ``min(1, max_norm / (total_norm + 1e-6))`` where ``total_norm`` is the
  ``norm_type``-norm of all gradients together. The value PyTorch returns,
  the total norm, is kept in the state (``optaxclip.stats(state)``). The
  numbers agree with PyTorch's to a few float32 ulps, not bit for bit:
  PyTorch takes the norm of per-tensor norms and multiplies by the
  reciprocal of ``total_norm + 1e-6``, two more roundings (see
  ``docs/migration/pytorch.md``).

  Hyperparameters injected with ``optax.inject_hyperparams`` are checked
  when ``init`` runs eagerly. Traced (a jitted update after a change of the
  state's hyperparameters) they cannot be: a negative or NaN ``max_norm``
  then acts as 0 (the update is zero), and a ``norm_type`` that is not > 0
  as 2.

  Args:
    max_norm: the largest total norm (a number >= 0; ``inf`` never clips,
      as in PyTorch: the norm is still kept).
    norm_type: the norm order: any number ``p > 0``, ``inf`` or ``"inf"``.
    error_if_nonfinite: raise when the total norm is NaN or Inf (PyTorch's
      flag), naming the leaves that hold them; otherwise they propagate.
    axis_name: under ``shard_map``/``pmap``, as in ``clip_by_global_norm``.
    specs: with ``axis_name``, as in ``clip_by_global_norm``.
    leaf_norms: as in ``clip_by_global_norm``.
    layer_axis: as in ``clip_by_global_norm`` (per-layer leaf norms).

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``ClipState``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> grads = [jnp.array([[-0.1, -0.25, -0.1], [0.1, 0.25, 0.1]]), jnp.array([-0.5, 0.5])]
    >>> tx = oc.clip_grad_norm(0.5)
    >>> clipped, state = tx.update(grads, tx.init(grads))
    >>> clipped[1]
    Array([-0.3065693,  0.3065693], dtype=float32)
  """
  fn = "clip_grad_norm"
  _validation.check_bool(fn, "error_if_nonfinite", error_if_nonfinite)
  max_norm, p, _ = _check_common(fn, max_norm, norm_type, PYTORCH_EPS,
                                 "norm_type")
  nonfinite = "raise" if error_if_nonfinite else "propagate"
  return _norm_clipper(fn, max_norm, p, PYTORCH_EPS, axis_name, specs,
                       nonfinite, per_leaf=False, leaf_norms=leaf_norms,
                       layer_axis=layer_axis)

