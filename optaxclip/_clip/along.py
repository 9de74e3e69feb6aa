"""Group labels split along an axis: ``groups={..., "w_in": along("experts", 1)}``.

A plain label puts whole leaves in a group. ``along(label, axis)`` puts the
leaf's slices along ``axis`` in one group each: index ``e`` of every leaf
labelled ``along("experts", ...)`` (each with its own axis) is group
``experts[e]``, clipped by the joint norm of those slices (per layer with
``layer_axis``: one group per layer x expert). The core measures them as
experts (``_core.measure_joint``), in the pass of every other group.
"""

import dataclasses
import numbers
from typing import Any

import jax
import numpy as np

from optaxclip import _tree
from optaxclip._types import PyTree


@dataclasses.dataclass(frozen=True)
class Along:
  """A ``groups`` label whose group is split along an axis of each leaf
  (``optaxclip.along``).

  Attributes:
    label: the group's name.
    axis: the axis of the leaf that indexes the group's parts.
  """
  label: str
  axis: int


def along(label: str, axis: int) -> Along:
  """A ``groups=`` label that splits its group along an axis: one per index.

  Every leaf labelled ``along(label, axis)`` (each with its own ``axis``)
  gives its slice ``[e]`` along that axis to group ``label``'s part ``e``,
  and each part is clipped by the joint norm of its slices: a mixture of
  experts' expert ``e``, its ``w_in[e]``, ``w_out[e]`` and router row
  together. With ``layer_axis``, one part per layer x expert. The leaves
  must stack as many along their axes ([docs/experts.md](../experts.md)).

  Args:
    label: the group's name: its key in a ``max_norm`` dict and in the
      state, ``clip/<label>/...`` in ``optaxclip.stats``.
    axis: the axis of these leaves that indexes the parts (negative: from
      the end).

  Returns:
    A label for ``clip_by_global_norm(groups=...)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> grads = {"w_in": jnp.array([[3.0, 0.0], [0.3, 0.0]]),
    ...          "w_out": jnp.array([[0.0, 4.0], [0.0, 0.4]])}
    >>> experts = oc.along("experts", 0)  # row e: expert e
    >>> tx = oc.clip_by_global_norm(1.0, groups={"w_in": experts, "w_out": experts})
    >>> out, state = tx.update(grads, tx.init(grads))
    >>> state.groups["experts"].expert_norms  # expert 0: sqrt(3^2 + 4^2)
    Array([5. , 0.5], dtype=float32)
    >>> out["w_in"]
    Array([[0.6, 0. ],
           [0.3, 0. ]], dtype=float32)
  """
  if not isinstance(label, str) or not label:
    raise TypeError(f"`along(label=...)` must be a non-empty string (the "
                    f"group's name), got {label!r:.80}")
  if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
    raise TypeError(f"`along(axis=...)` must be an int (the axis that indexes "
                    f"the group's parts), got {axis!r:.80} of type "
                    f"{type(axis).__name__}")
  return Along(label, int(axis))


def is_label(x: Any) -> bool:
  return isinstance(x, (str, Along))


def names(labels: list[Any]) -> list[str]:
  """Each leaf's group name (an ``Along``'s label)."""
  return [x.label if isinstance(x, Along) else x for x in labels]


def check_kinds(fn: str, labels: list[Any]) -> bool:
  """Whether some label is an ``Along``; a ValueError where one name is
  both a plain label and an ``along`` one."""
  split = {x.label for x in labels if isinstance(x, Along)}
  plain = {x for x in labels if isinstance(x, str)}
  if split & plain:
    raise ValueError(
        f"`{fn}(groups=...)` uses {sorted(split & plain)} both as a plain "
        f"label and in along(): a group is either whole leaves or split "
        f"along an axis; give one of them another name")
  return bool(split)


def axis_tree(fn: str, tree: PyTree, labels: list[Any]) -> PyTree:
  """``tree``'s structure with each clippable leaf's ``along`` axis (None
  for a plain label and for leaves that are not clippable): the core's
  ``expert_axis``; a ValueError for an axis out of a leaf's range."""
  with_labels = iter(labels)
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  axes = []
  for path, x in with_paths:
    label = next(with_labels) if _tree.is_clippable(x) else None
    if not isinstance(label, Along):
      axes.append(None)
      continue
    ndim = len(np.shape(x))
    if not -ndim <= label.axis < ndim:
      raise ValueError(
          f"`{fn}(groups=...)`: along({label.label!r}, axis={label.axis}) is "
          f"out of range for leaf {jax.tree_util.keystr(path)} of shape "
          f"{tuple(np.shape(x))}")
    axes.append(label.axis % ndim)
  return treedef.unflatten(axes)
