"""Norm groups: each labelled set of leaves clipped by its own global norm.

``groups`` labels the leaves as ``optax.partition``'s ``param_labels`` do:
a tree prefix of the gradients with string leaves, or a callable from the
gradients (or params) to such a tree. A group's norm is the norm of its
leaves' norms, so every group comes from one pass over the gradients and
one all-reduce of the per-leaf partials. A label ``along(label, axis)``
(``_clip/along.py``) splits its group along an axis: one norm per expert
over all its tensors, joined by the core (``_core.measure_joint``).

Clipping inside each branch of ``optax.partition`` also clips per group,
but a plain ``clip_by_global_norm`` there (in every branch) is the usual
slip when one global norm was meant: see ``docs/which.md``.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxclip import _core, _tree, _validation
from optaxclip._clip import along, on_nonfinite, scaling
from optaxclip._clip.state import ClipState
from optaxclip._stats import leaf_stats, registry, running
from optaxclip._types import NonFinite, PyTree

# A tree prefix of labels, or a callable from the gradients to one.
Labels = Callable[[PyTree], PyTree] | PyTree


def _check_label(fn: str, label: Any) -> None:
  if not along.is_label(label):
    raise TypeError(
        f"`{fn}(groups=...)` must hold strings (group labels), got "
        f"{label!r:.80} of type {type(label).__name__}, or optaxclip.along() "
        f"labels")


def check_labels(fn: str, groups: Any) -> Any:
  """``groups``: a callable, or a tree of strings (else a TypeError when the
  transform is built; whether it fits the gradients is known at ``init``)."""
  _validation.check_static(fn, "groups", groups, "string labels, or a callable "
                           "of the gradients returning them")
  if not callable(groups):
    for label in jax.tree.leaves(groups, is_leaf=along.is_label):
      _check_label(fn, label)
  return groups


def leaf_labels(fn: str, tree: PyTree, groups: Any) -> list[Any]:
  """The label of every clippable leaf of ``tree`` (a string or an
  ``along`` label), in tree order."""
  labels = groups(tree) if callable(groups) else groups

  with_labels = _tree.broadcast_prefix(
      fn, "groups", labels, tree, is_value=along.is_label,
      holds="strings (group labels) or along() labels",
      like="a tree prefix of the gradients with string leaves (as "
           "optax.partition's param_labels), or a callable returning one")
  return [label for label, x in zip(with_labels, jax.tree.leaves(tree))
          if _tree.is_clippable(x)]


def check_max_norms(fn: str, max_norm: Any, grouped: bool) -> Any:
  """``max_norm``: a number >= 0 (or inf), or with groups a dict from
  labels to such numbers."""
  if isinstance(max_norm, Mapping):
    if not grouped:
      raise TypeError(
          f"`{fn}(max_norm=...)` is a dict of per-group limits: pass "
          f"`groups=` to label the leaves, or a number")
    return {label: _validation.check_nonnegative(
        fn, f"max_norm[{label!r}]", value, allow_inf=True)
            for label, value in max_norm.items()}
  return _validation.check_nonnegative(fn, "max_norm", max_norm,
                                       allow_inf=True)


def limit_of(fn: str, max_norm: Any, label: str) -> Any:
  if not isinstance(max_norm, Mapping):
    return max_norm
  if label not in max_norm:
    raise ValueError(
        f"`{fn}(max_norm=...)` has no limit for group {label!r} (it has "
        f"{sorted(max_norm)}); give every group of `groups=` one")
  return max_norm[label]


def group_norms(labels: list[str], leaf_norms: list[jax.Array], p
                ) -> dict[str, jax.Array]:
  """Each group's norm: the norm of its leaves' norms (no pass over the
  gradients), in the order the labels first appear."""
  members: dict[str, list[jax.Array]] = {}
  for label, norms in zip(labels, leaf_norms):
    members.setdefault(label, []).append(jnp.reshape(norms, -1))
  return {label: _core.norm_of([jnp.concatenate(norms)], p)
          for label, norms in members.items()}


class GroupClipState(NamedTuple):
  """State of ``clip_by_global_norm(groups=...)``.

  ``optaxclip.stats`` reports each group's entries as ``clip/<label>/...``.

  Attributes:
    groups: a dict from each group's label to its ``ClipState`` (its norm,
      factor and step counts; a group split by ``along`` keeps its parts'
      norms in ``expert_norms``, its largest as ``norm`` and its smallest
      factor as ``scale``).
    leaf_norms: as in ``ClipState``.
    stack_norms: as in ``ClipState``.
  """
  groups: dict[str, ClipState]
  leaf_norms: PyTree = None
  stack_norms: PyTree = None


def _group_stats(state: GroupClipState) -> dict[str, jax.Array]:
  entries = {f"{label}/{key}": value
             for label, group in state.groups.items()
             for key, value in registry.summary(group).items()}
  return {**entries, **leaf_stats.entries(state.leaf_norms, state.stack_norms)}


registry.register(GroupClipState, "clip", _group_stats)


def _checked_labels(fn: str, updates: PyTree, groups: Labels,
                    state: GroupClipState) -> list[Any]:
  labels = leaf_labels(fn, updates, groups)
  names = set(along.names(labels))
  if names != set(state.groups):
    raise ValueError(
        f"`{fn}(groups=...)` labels the updates {sorted(names)} but "
        f"the state has groups {sorted(state.groups)}; call init with "
        f"the parameters the updates are for")
  return labels


class _Measured(NamedTuple):
  norms: dict[str, jax.Array]  # per group: a norm, or its parts' (along)
  factors_to_leaves: Callable[[dict[str, jax.Array]], list[jax.Array]]
  measured: _core.Measured  # the leaf norms, for the state


def _measure_groups(fn: str, updates: PyTree, labels: list[Any], p,
                    where: _core.Where, view: _core.Kept, layer_axis: PyTree
                    ) -> _Measured:
  """Every group's norm (an ``along`` group's per part), one pass."""
  names = along.names(labels)
  if not along.check_kinds(fn, labels):
    measured = _core.measure(fn, updates, p, where, view)
    # From every device's layers: the same group norms on each device.
    return _Measured(group_norms(names, measured.per_leaf(), p),
                     lambda factors: [factors[n] for n in names], measured)
  joint = _core.measure_joint(fn, updates, p, where,
                              along.axis_tree(fn, updates, labels), layer_axis, names,
                              "groups")
  parts = joint.measured.per_leaf()
  plain = group_norms([names[i] for i in joint.others],
                      [parts[i] for i in joint.others], p)
  norms = {n: joint.grids[n] if n in joint.grids else plain[n]
           for n in dict.fromkeys(names)}

  def to_leaves(factors):
    values = [factors[n].reshape(-1) for n in joint.grids] + [
        jnp.broadcast_to(factors[names[i]], (count,))
        for i, count in zip(joint.others, joint.unit_counts())]
    return joint.to_leaves(jnp.concatenate(values + [jnp.zeros([0])]))
  return _Measured(norms, to_leaves, joint.measured)


def _fresh(fn: str, params: PyTree, labels: list[Any], where: _core.Where,
           layer_axis: PyTree, dtype, floor) -> dict[str, ClipState]:
  """Each group's state before the first step (an ``along`` group's with
  zero norms for its parts)."""
  names = along.names(labels)
  parts = {}
  if along.check_kinds(fn, labels):
    parts = _core.joint_shapes(fn, params, where,
                               along.axis_tree(fn, params, labels), layer_axis,
                               names, "groups")
  return {n: ClipState.fresh(dtype, floor=floor)._replace(
      expert_norms=jnp.zeros(parts[n], dtype) if n in parts else None)
          for n in dict.fromkeys(names)}


def _view(fn: str, tree: PyTree, labels: list[Any], expert_axis: PyTree,
          layer_axis: PyTree) -> _core.Kept:
  """The leaf norms' view: ``along`` axes are the expert axes."""
  if not along.check_kinds(fn, labels):
    return _core.experts(expert_axis, layer_axis)
  if expert_axis is not None:
    raise ValueError(
        f"`{fn}`: with along() labels in `groups=`, leave `expert_axis` out: "
        f"along(label, axis) says which axis stacks the parts")
  return _core.experts(along.axis_tree(fn, tree, labels), layer_axis)


def group_clipper(fn: str, max_norm, p, eps, where: _core.Where,
                  nonfinite: NonFinite, groups: Labels, *, leaf_norms: bool,
                  layer_axis: PyTree, floor: Any = None,
                  expert_axis: PyTree = None
                  ) -> optax.GradientTransformation:
  """``clip_by_global_norm`` with ``groups``: each clipped by its own norm
  (an ``along`` group's parts each by theirs), all from one pass over the
  gradients and one all-reduce (``floor``: the stall guard's, checked,
  counted per group)."""
  _validation.check_choice(fn, "nonfinite", nonfinite, on_nonfinite.MODES)
  _validation.check_bool(fn, "leaf_norms", leaf_norms)
  expert_axis, layer_axis = _validation.check_stack_axes(fn, expert_axis, layer_axis)
  groups = check_labels(fn, groups)

  def init_fn(params):
    dtype = running.statistics_dtype(params)
    labels = leaf_labels(fn, params, groups)
    for label in dict.fromkeys(along.names(labels)):
      limit_of(fn, max_norm, label)
    view = _view(fn, params, labels, expert_axis, layer_axis)
    _core.unit_shapes(fn, params, view)  # a layer axis that fits, or an error
    kept = leaf_stats.zeros(fn, params, view, dtype) if leaf_norms else ()
    return GroupClipState(_fresh(fn, params, labels, where, layer_axis, dtype, floor),
                          *kept)

  def update_fn(updates, state, params=None):
    del params
    if state is None:
      state = init_fn(updates)
    _validation.check_state(fn, state, GroupClipState)
    labels = _checked_labels(fn, updates, groups, state)
    view = _view(fn, updates, labels, expert_axis, layer_axis)
    got = _measure_groups(fn, updates, labels, p, where, view, layer_axis)
    norms = got.norms
    finite = {label: jnp.all(jnp.isfinite(norm)) for label, norm in norms.items()}
    largest = (jnp.max(jnp.concatenate([n.reshape(-1) for n in norms.values()]))
               if norms else jnp.zeros([]))
    factors = dict(zip(norms, on_nonfinite.guard(
        nonfinite, fn, updates, largest,
        [scaling.clip_factor(norm, limit_of(fn, max_norm, label), eps)
         for label, norm in norms.items()], list(finite.values()))))
    names = along.names(labels)
    clipped = on_nonfinite.zeroed(
        nonfinite, scaling.scale_leaves(updates, got.factors_to_leaves(factors)),
        [finite[n] for n in names])
    new_groups = {label: _after(old, norms[label], factors[label],
                                finite[label], floor)
                  for label, old in state.groups.items()}
    kept = ()
    if leaf_norms:  # the state's dtype (no group at all: an empty tree)
      dtype = next((g.norm.dtype for g in state.groups.values()), jnp.float32)
      kept = leaf_stats.measured(got.measured, dtype)
    return clipped, GroupClipState(new_groups, *kept)

  return optax.GradientTransformation(init_fn, update_fn)


def _after(old: ClipState, norm: jax.Array, factor: jax.Array,
           finite: jax.Array, floor: Any) -> ClipState:
  """A group's state after a step: an ``along`` group keeps its parts'
  norms, its largest norm and smallest factor."""
  if norm.ndim == 0:
    return old.after(norm, factor, finite=finite, floor=floor)
  return old.after(jnp.max(norm, initial=0), jnp.min(factor, initial=1),
                   finite=finite, floor=floor, expert_norms=norm)
