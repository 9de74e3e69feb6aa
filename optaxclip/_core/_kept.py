"""Which axes a norm keeps: the views of the one computation.

Every norm reduces each leaf over some of its axes to one value per
*unit*; the axes a leaf keeps say what a unit is:

| kept                     | a unit is                 | used by |
|--------------------------|---------------------------|---------|
| ``TOTAL`` (nothing kept) | everything                | global norms |
| ``PER_LEAF``             | a leaf                    | ``clip_by_norm``, ``adagc``, leaf norms |
| ``layers(layer_axis)``   | a layer of a stacked leaf | scanned models |
| ``experts(expert_axis, layer_axis)`` | an expert (of a layer) | mixtures of experts |
| ``agc_units(axis, ...)`` | an output unit            | ``adaptive_grad_clip`` |
| ``examples(layer_axis)`` | an example (and layer)    | per-example clipping |

``layer_axis`` (and ``expert_axis``) is a tree prefix of the gradients
(like ``specs``) of ints or None, or a callable from the gradients to one
(as ``groups``: handy where the gradients are an ``nnx.State``).
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from optaxclip import _tree, _validation
from optaxclip._core._mesh import Keep
from optaxclip._types import PyTree

Shapes = list[tuple[int, ...]]


def layer_keep(fn: str, tree: PyTree, layer_axis: PyTree,
               arg: str = "layer_axis", stacks: str = "layers"
               ) -> tuple[Keep, ...] | None:
  """Per clippable leaf of ``tree``, ``(axis,)`` where ``layer_axis`` gives
  one, ``()`` elsewhere; None for no layer axes (``arg``: the argument's
  name in errors, ``stacks``: what its axis stacks)."""
  if layer_axis is None:
    return None
  if callable(layer_axis) and not isinstance(layer_axis, jax.Array):
    layer_axis = layer_axis(tree)
  leaf_axes = _tree.broadcast_prefix(
      fn, arg, layer_axis, tree, is_value=_validation.is_layer_axis,
      holds=f"ints (the axis that stacks {stacks}) or None",
      like="an int or a tree prefix of the gradients with int or None "
           "leaves (as optax.partition's labels)")
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  keep = []
  for (path, x), axis in zip(with_paths, leaf_axes):
    if not _tree.is_clippable(x):
      continue
    ndim = len(np.shape(x))
    if axis is None:
      keep.append(())
    elif -ndim <= axis < ndim:
      keep.append((axis % ndim,))
    else:
      raise ValueError(
          f"`{fn}({arg}={axis})` is out of range for leaf "
          f"{jax.tree_util.keystr(path)} of shape {tuple(np.shape(x))}; give "
          f"None for leaves that stack no {stacks}")
  return tuple(keep)


class Kept(NamedTuple):
  """A view: per clippable leaf, the axes its units keep (None: a total).

  ``axes(fn, tree, shapes)`` gives them for ``tree`` (``shapes``: its
  clippable leaves' whole shapes, before ``shard_map`` split them).
  """
  rule: Callable[[str, PyTree, Shapes], tuple[Keep, ...] | None]
  name: str
  across_leaves: bool = False  # units span all leaves (examples)

  def axes(self, fn: str, tree: PyTree, shapes: Shapes
           ) -> tuple[Keep, ...] | None:
    return self.rule(fn, tree, shapes)


TOTAL = Kept(lambda fn, tree, shapes: None, "total")
PER_LEAF = Kept(lambda fn, tree, shapes: ((),) * len(shapes), "per leaf")


def layers(layer_axis: PyTree) -> Kept:
  """Per leaf, its layer axis (``layer_axis`` None: ``PER_LEAF``)."""
  if layer_axis is None:
    return PER_LEAF
  return Kept(lambda fn, tree, shapes: layer_keep(fn, tree, layer_axis),
              "per layer")


def experts(expert_axis: PyTree, layer_axis: PyTree = None) -> Kept:
  """Per leaf, its expert axis and its layer axis, either or both (units
  in the leaf's axis order: per layer x expert for a stacked MoE weight
  ``[layers, experts, ...]``); ``expert_axis`` None: ``layers``."""
  if expert_axis is None:
    return layers(layer_axis)

  def rule(fn, tree, shapes):
    by_expert = layer_keep(fn, tree, expert_axis, "expert_axis", "experts")
    by_layer = layer_keep(fn, tree, layer_axis) or ((),) * len(shapes)
    assert by_expert is not None
    paths = [path for path, _ in _tree.clippable_leaves_with_paths(tree)]
    for path, expert, layer in zip(paths, by_expert, by_layer):
      if expert and expert == layer:
        raise ValueError(
            f"`{fn}`: leaf {path} has expert_axis and layer_axis both "
            f"{expert[0]}; the axis that stacks experts is another than the "
            f"one that stacks layers")
    return tuple(tuple(sorted(expert + layer))
                 for expert, layer in zip(by_expert, by_layer))
  name = "per expert" if layer_axis is None else "per layer x expert"
  return Kept(rule, name)


def _unit_axes(fn: str, where: str, shape: tuple[int, ...],
               axis: tuple[int, ...] | None) -> tuple[int, ...]:
  """The axes one AGC unit of an array of ``shape`` spans (reduced), as
  optax chooses them."""
  ndim = len(shape)
  if ndim == 0:
    return ()
  if axis is not None:
    if any(not -ndim <= a < ndim for a in axis):
      raise ValueError(
          f"`{fn}(axis={axis})` is out of range for {where} of shape "
          f"{tuple(shape)}")
    return tuple(sorted({a % ndim for a in axis}))
  if sum(d != 1 for d in shape) <= 1:  # scalars and vectors: one unit
    return tuple(range(ndim))
  if ndim in (2, 3):  # linear IO, multi-head linear
    return (0,)
  if ndim == 4:  # conv HWIO
    return (0, 1, 2)
  if ndim == 5:  # conv 3-D DHWIO
    return (0, 1, 2, 3)
  raise ValueError(
      f"`{fn}`: {where} has shape {tuple(shape)}; units are known for up to "
      f"5 dimensions, pass `axis=` (the axes one unit spans) for others")


def unit_keep(fn: str, where: str, shape: tuple[int, ...],
              axis: tuple[int, ...] | None, layer: Keep = ()) -> Keep:
  """The axes the AGC units of an array of ``shape`` keep: all but the
  unit axes; with a layer axis (``layer = (l,)``), that axis too, the unit
  axes chosen (and ``axis`` read) on one layer's slice, as optax would for
  that layer alone. Units then never mix layers."""
  if not layer:
    reduced = _unit_axes(fn, where, shape, axis)
    return tuple(a for a in range(len(shape)) if a not in reduced)
  (stacked,) = layer
  one_layer = tuple(shape[:stacked]) + tuple(shape[stacked + 1:])
  reduced = _unit_axes(
      fn, f"{where} (one layer's slice, layer_axis={stacked})", one_layer, axis)
  kept = [a + (a >= stacked) for a in range(len(one_layer)) if a not in reduced]
  return tuple(sorted([stacked, *kept]))


def agc_units(axis: tuple[int, ...] | None, layer_axis: PyTree = None, *,
              name: str | None = None) -> Kept:
  """AGC's units (optax's choice by rank, or ``axis``: the axes a unit
  spans), chosen from each leaf's whole shape, per layer slice with
  ``layer_axis``; errors call a leaf ``name`` (default: by its path)."""
  def rule(fn, tree, shapes):
    paths = [path for path, _ in _tree.clippable_leaves_with_paths(tree)]
    stacked = layer_keep(fn, tree, layer_axis) or ((),) * len(shapes)
    return tuple(unit_keep(fn, name or f"leaf {path}", shape, axis, layer)
                 for path, shape, layer in zip(paths, shapes, stacked))
  return Kept(rule, "per unit")


def examples(layer_axis: PyTree = None, *, across_leaves: bool = False) -> Kept:
  """A leading batch axis: one unit per example (and per layer of one
  example's gradient, ``layer_axis`` counting its axes); with
  ``across_leaves``, one per example of all leaves together."""
  def rule(fn, tree, shapes):
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype)
                       if _tree.is_clippable(x) else x, tree)
    stacked = layer_keep(fn, one, layer_axis) or ((),) * len(shapes)
    return tuple((0,) + tuple(a + 1 for a in kept) for kept in stacked)
  return Kept(rule, "per example", across_leaves)


def units_per_leaf(shapes: Shapes, keep: tuple[Keep, ...]) -> list[int]:
  """Per leaf, how many units it has (the product of its kept axes)."""
  return [math.prod(shape[a] for a in kept) for shape, kept in zip(shapes, keep)]

