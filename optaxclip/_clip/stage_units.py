"""Where each norm of a pipeline stage's partial belongs in the whole model.

A stage's ``PartialNorm`` holds, per leaf, the norms of its units: the
leaf itself, or each slice of its layer axis (``layer_axis``) and expert
axis (``expert_axis``). A unit's key, its leaf's path and its index in
the whole model (along the layer axis the global layer index, which the
stage gives with ``layers``), does not depend on how the model was split
into stages: the combination sorts every unit by it, and checks that no
unit comes twice, no layer of a stack is missing below its last, and every
stage describes a leaf alike.
"""

import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from optaxclip import _tree
from optaxclip._types import PyTree

Key = tuple[str, tuple[int, ...]]


class Units(NamedTuple):
  """How one leaf's unit norms lie in a ``PartialNorm``'s ``norms``.

  Attributes:
    axes: the leaf's axes its units keep (none: the leaf is one unit).
    kinds: per kept axis, ``"layer"`` or ``"expert"``.
    shape: the stage's units along each kept axis (C order in ``norms``).
    layers: the global layer index of each unit along the layer axis.
  """
  axes: tuple[int, ...] = ()
  kinds: tuple[str, ...] = ()
  shape: tuple[int, ...] = ()
  layers: tuple[int, ...] = ()

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  def keys(self) -> list[tuple[int, ...]]:
    """Each unit's index in the whole model, in C order."""
    if "layer" not in self.kinds:
      return [tuple(map(int, i)) for i in np.ndindex(self.shape)]
    at = self.kinds.index("layer")
    return [tuple(map(int, i[:at])) + (self.layers[i[at]],)
            + tuple(map(int, i[at + 1:])) for i in np.ndindex(self.shape)]

  def describe(self) -> str:
    if not self.axes:
      return "a whole leaf"
    return " x ".join(f"{kind} axis {axis} ({n})" for kind, axis, n
                      in zip(self.kinds, self.axes, self.shape))


def _is_layers(x: Any) -> bool:
  return x is None or isinstance(x, range) or (
      isinstance(x, numbers.Integral) and not isinstance(x, bool))


def describe_units(fn: str, tree: PyTree, keep: Sequence[tuple[int, ...]],
                   layer_keep: Sequence[tuple[int, ...]] | None, layers: Any
                   ) -> tuple[Units, ...]:
  """Per clippable leaf of ``tree``, its ``Units``: ``keep`` its kept axes,
  ``layer_keep`` its layer axis (or ``()``; None: no ``layer_axis``), ``layers`` (a tree prefix of
  None, an int or a ``range``) the global index of its slice's layers."""
  given = _tree.broadcast_prefix(
      fn, "layers", layers, tree, is_value=_is_layers,
      holds="None, an int (the global index of the stage's first layer) or a "
            "range (the global index of each of its layers)",
      like="an int, a range or a tree prefix of the gradients with such leaves")
  leaves = [(path, x) for path, x in _with_paths(tree)]
  given = [g for (_, x), g in zip(leaves, given) if _tree.is_clippable(x)]
  leaves = [(path, x) for path, x in leaves if _tree.is_clippable(x)]
  if layers is not None and layer_keep is None:
    raise ValueError(
        f"`{fn}(layers={layers!r:.60})` needs `layer_axis=`: the axis of the "
        f"stage's stacked leaves whose slices `layers` numbers")
  layer_keep = layer_keep or ((),) * len(leaves)
  out = []
  for (path, x), axes, layer, start in zip(leaves, keep, layer_keep, given):
    shape = tuple(int(np.shape(x)[a]) for a in axes)
    kinds = tuple("layer" if a in layer else "expert" for a in axes)
    indices: tuple[int, ...] = ()
    if layer:
      count = int(np.shape(x)[layer[0]])
      indices = _layer_indices(fn, path, start, count, layer[0])
    out.append(Units(tuple(axes), kinds, shape, indices))
  return tuple(out)


def _with_paths(tree: PyTree) -> list[tuple[str, Any]]:
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path), x) for path, x in with_paths]


def _layer_indices(fn: str, path: str, given: Any, count: int, axis: int
                   ) -> tuple[int, ...]:
  """The global layer indices of a stacked leaf's ``count`` layers."""
  if given is None or isinstance(given, numbers.Integral):
    start = int(given or 0)
    if start < 0:
      raise ValueError(
          f"`{fn}(layers={given})` must be >= 0 (the global index of the "
          f"stage's first layer)")
    return tuple(range(start, start + count))
  if len(given) != count or (count and given[0] < 0):
    raise ValueError(
        f"`{fn}(layers={given!r})` numbers {len(given)} layers from "
        f"{given.start}, but leaf {path} stacks {count} along its layer_axis "
        f"{axis}: give the global index of each layer the stage holds")
  return tuple(given)


def unit_keys(fn: str, partials: Sequence[Any]
              ) -> tuple[list[Key], dict[str, tuple[tuple[int, ...], Units]]]:
  """Every unit's key, in the order of the partials' norms concatenated,
  and per leaf path its units' shape in the whole model; checks that the
  stages fit together (``partials``: each has ``paths`` and ``units``)."""
  keys: list[Key] = []
  seen: dict[str, Units] = {}
  for part in partials:
    for path, units in zip(part.paths, part.units):
      first = seen.setdefault(path, units)
      if (first.axes, first.kinds) != (units.axes, units.kinds) or any(
          a != b for a, b, kind in zip(first.shape, units.shape, units.kinds)
          if kind != "layer"):
        raise ValueError(
            f"`{fn}(partials=...)`: leaf {path} is measured as "
            f"{first.describe()} in one stage and as {units.describe()} in "
            f"another; give every stage's `partial_norm` the same layer_axis "
            f"and expert_axis, and the same shapes but along the layer axis")
      keys.extend((path, key) for key in units.keys())
  _check_once(fn, keys, seen)
  return keys, _whole_shapes(fn, keys, seen)


def _check_once(fn: str, keys: list[Key], seen: dict[str, Units]) -> None:
  """No unit twice: whole leaves in one stage, layers in one stage each."""
  if len(set(keys)) == len(keys):
    return
  counts: dict[Key, int] = {}
  for key in keys:
    counts[key] = counts.get(key, 0) + 1
  twice = sorted({key for key, n in counts.items() if n > 1})
  whole = sorted({path for path, _ in twice if "layer" not in seen[path].kinds})
  if whole:
    raise ValueError(
        f"`{fn}(partials=...)` holds leaves with the same path in several "
        f"stages: {whole[:5]}; pass each stage's part keyed as in the whole "
        f"tree, or `partial_norm(..., prefix=...)` naming the stage's part (a "
        f"stack split between stages: `layer_axis=` and `layers=`)")
  path = twice[0][0]
  at = seen[path].kinds.index("layer")
  overlap = sorted({key[at] for p, key in twice if p == path})
  raise ValueError(
      f"`{fn}(partials=...)`: layers {overlap[:8]} of leaf {path} are in "
      f"several stages (overlapping `partial_norm(layers=...)`); give each "
      f"stage the global indices of its own slice")


def _whole_shapes(fn: str, keys: list[Key], seen: dict[str, Units]
                  ) -> dict[str, tuple[tuple[int, ...], Units]]:
  """Per path, the shape of its units in the whole model; every layer of a
  stack up to its last must be in some stage."""
  held: dict[str, set[int]] = {}
  for path, key in keys:
    if "layer" in seen[path].kinds:
      held.setdefault(path, set()).add(key[seen[path].kinds.index("layer")])
  out = {}
  for path, units in seen.items():
    if "layer" not in units.kinds:
      out[path] = (units.shape, units)
      continue
    at = units.kinds.index("layer")
    layers = held.get(path, set())
    count = max(layers) + 1 if layers else 0
    missing = sorted(set(range(count)) - layers)
    if missing:
      raise ValueError(
          f"`{fn}(partials=...)`: leaf {path} misses layers {missing[:8]} "
          f"(of 0 to {count - 1}): a stage's partial is missing, or its "
          f"`partial_norm(layers=...)` is wrong")
    out[path] = (units.shape[:at] + (count,) + units.shape[at + 1:], units)
  return out
