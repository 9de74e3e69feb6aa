"""Norm groups: each labelled set of leaves clipped by its own global norm.

``groups`` labels the leaves as ``optax.partition``'s ``param_labels`` do:
a tree prefix of the gradients with string leaves, or a callable from the
gradients (or params) to such a tree. A group's norm is the norm of its
leaves' norms, so every group comes from one pass over the gradients and
one all-reduce of the per-leaf partials.

Clipping inside each branch of ``optax.partition`` also clips per group,
but a plain ``clip_by_global_norm`` there (in every branch) is the usual
slip when one global norm was meant: see ``docs/which.md``.
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from optaxclip import _norms, _tree, _validation

PyTree = Any
# A tree prefix of labels, or a callable from the gradients to one.
Labels = Callable[[PyTree], PyTree] | PyTree


def _check_label(fn: str, label: Any) -> None:
  if not isinstance(label, str):
    raise TypeError(
        f"`{fn}(groups=...)` must hold strings (group labels), got "
        f"{label!r:.80} of type {type(label).__name__}")


def check_labels(fn: str, groups: Any) -> Any:
  """``groups``: a callable, or a tree of strings (else a TypeError when the
  transform is built; whether it fits the gradients is known at ``init``)."""
  _validation.check_not_scheduled(fn, "groups")
  if not callable(groups):
    for label in jax.tree.leaves(groups, is_leaf=lambda x: isinstance(x, str)):
      _check_label(fn, label)
  return groups


def leaf_labels(fn: str, tree: PyTree, groups: Any) -> list[str]:
  """The label of every clippable leaf of ``tree``, in tree order."""
  labels = groups(tree) if callable(groups) else groups

  with_labels = _tree.broadcast_prefix(
      fn, "groups", labels, tree, is_value=lambda x: isinstance(x, str),
      holds="strings (group labels)",
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


def group_norms(labels: list[str], leaf_norms: list[jax.Array], p: Any
                ) -> dict[str, jax.Array]:
  """Each group's norm: the norm of its leaves' norms (no pass over the
  gradients), in the order the labels first appear."""
  members: dict[str, list[jax.Array]] = {}
  for label, norms in zip(labels, leaf_norms):
    members.setdefault(label, []).append(jnp.reshape(norms, -1))
  return {label: _norms.norm_of_leaves([jnp.concatenate(norms)], p)
          for label, norms in members.items()}

