"""Norms joined across leaves: an expert measured over all its tensors.

A mixture-of-experts layer keeps expert ``e``'s weights as slices of
several leaves (``w_in[e]``, ``w_out[e]``, the router's row ``e``), each
stacking the experts on its own ``expert_axis``. The expert's *joint*
norm is the p-norm of all those entries together, the norm of its slices'
norms, ``(sum_leaf ||leaf[e]||_p^p)^(1/p)`` (``max`` for ``inf``), one per
expert, or per layer x expert where leaves stack layers too.

The slices' norms are the units of ``experts(expert_axis, layer_axis)``:
the joint norms come from the same pass over the gradients and the same
all-reduce, joined afterwards from every device's units (the same on each
device). Leaves without an expert axis keep their own units (per leaf, per
layer). A joint group is laid out ``[layers, experts]`` (``[experts]``),
whatever each leaf's axis order.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip import _tree
from optaxclip._core._kept import experts, layer_keep
from optaxclip._core._measure import Measured, measure
from optaxclip._core._mesh import LOCAL, Where, whole_shapes
from optaxclip._core._norms import unit_norms
from optaxclip._types import PyTree


class _Member(NamedTuple):
  index: int  # the clippable leaf
  swapped: bool  # its units are [experts, layers]: transposed to the grid's


class _Plan(NamedTuple):
  grid: tuple[int, ...]  # [layers, experts] or [experts]; (0,): no experts
  members: tuple[_Member, ...]


def _plan(fn: str, tree: PyTree, shapes: list[tuple[int, ...]],
          expert_axis: PyTree, layer_axis: PyTree) -> _Plan:
  """Which leaves join, and the grid they share; a ValueError naming the
  leaves whose experts (or layers) do not line up."""
  by_expert = layer_keep(fn, tree, expert_axis, "expert_axis", "experts")
  by_layer = layer_keep(fn, tree, layer_axis) or ((),) * len(shapes)
  paths = [path for path, _ in _tree.clippable_leaves_with_paths(tree)]
  members: list[_Member] = []
  grid: tuple[int, ...] | None = None
  first = 0
  for i, (expert, layer) in enumerate(zip(by_expert or (), by_layer)):
    if not expert:
      continue
    shape = shapes[i]
    mine = tuple(shape[a] for a in layer + expert)
    if grid is None:
      grid, first = mine, i
    elif mine != grid:
      raise ValueError(_mismatch(fn, paths, shapes, first, i, grid, mine))
    members.append(_Member(i, bool(layer) and layer[0] > expert[0]))
  return _Plan(grid or (0,), tuple(members))


def _mismatch(fn: str, paths: list[str], shapes: list[tuple[int, ...]],
              first: int, i: int, grid: tuple[int, ...],
              mine: tuple[int, ...]) -> str:
  """The error for leaf ``i`` whose experts (``mine``) do not line up with
  those of leaf ``first`` (``grid``)."""
  def leaf(j):
    return f"leaf {paths[j]} of shape {shapes[j]}"
  if len(grid) != len(mine):
    stacked, flat = (first, i) if len(grid) == 2 else (i, first)
    says = f"{leaf(stacked)} stacks layers but {leaf(flat)} does not"
  elif grid[-1] != mine[-1]:
    says = (f"{leaf(first)} stacks {grid[-1]} experts but {leaf(i)} "
            f"stacks {mine[-1]}")
  else:
    says = f"{leaf(first)} stacks {grid[0]} layers but {leaf(i)} stacks {mine[0]}"
  return (f"`{fn}(expert_axis=...)`: {says}; an expert is joined across the "
          f"leaves with an expert axis, so each must stack as many experts "
          f"(and layers, with layer_axis); give None to leaves outside")


def _shapes_at_init(fn: str, tree: PyTree, where: Where) -> list[tuple[int, ...]]:
  """Whole shapes: inside ``shard_map`` from ``where``'s specs; outside (an
  ``init`` with the whole parameters) the leaves' own."""
  try:
    return whole_shapes(fn, tree, where)
  except NameError:  # the mesh axes are not bound: not inside shard_map
    return [tuple(np.shape(x)) for x in _tree.clippable_leaves(tree)]


def joint_shape(fn: str, tree: PyTree, where: Where, expert_axis: PyTree,
                layer_axis: PyTree = None) -> tuple[int, ...]:
  """The shape of the joint norms of ``tree``'s experts, without measuring:
  ``[layers, experts]``, ``[experts]``, or ``[0]`` where no leaf stacks
  experts (a state's shape at ``init``)."""
  shapes = _shapes_at_init(fn, tree, where)
  return _plan(fn, tree, shapes, expert_axis, layer_axis).grid


def _blocks(local: tuple[int, ...], whole: tuple[int, ...]) -> list[int]:
  """Per kept axis, into how many devices' blocks the mesh splits it."""
  return [w // n if n else 1 for n, w in zip(local, whole)]


def _whole(units: jax.Array, local: tuple[int, ...], whole: tuple[int, ...]
           ) -> jax.Array:
  """A leaf's units of every device (device-major: each device's block at
  its place, its mesh axes in kept-axis order, as ``Reduction.sum`` lays
  them) in the C order of its whole kept axes."""
  blocks = _blocks(local, whole)
  if all(b == 1 for b in blocks):
    return units
  k = len(local)
  interleaved = [a for d in range(k) for a in (d, k + d)]
  return units.reshape(blocks + list(local)).transpose(interleaved).reshape(-1)


def _everywhere(units: jax.Array, local: tuple[int, ...],
                whole: tuple[int, ...]) -> jax.Array:
  """``_whole`` undone: C order of the whole kept axes to device-major."""
  blocks = _blocks(local, whole)
  if all(b == 1 for b in blocks):
    return units
  k = len(local)
  split = [a for d in range(k) for a in (blocks[d], local[d])]
  order = [2 * d for d in range(k)] + [2 * d + 1 for d in range(k)]
  return units.reshape(split).transpose(order).reshape(-1)


class Joint:
  """One measure of a tree: every expert's joint norm, and every other
  leaf's own units (per leaf, per layer), from one pass.

  Attributes:
    norms: the joint norms, ``[layers, experts]`` (``[experts]``; ``[0]``
      where no leaf stacks experts), every device's: the same on each.
    units: the joint norms (in C order), then the other leaves' units in
      tree order: what ``to_leaves`` takes one value of each.
    measured: the per-slice measure (each leaf's own per-expert norms).
  """

  def __init__(self, measured: Measured, plan: _Plan, p):
    self.measured, self._plan = measured, plan
    parts = [_whole(part, local.shape, whole) for part, local, whole in
             zip(measured.per_leaf(), measured.here(), measured.unit_shapes())]
    self._parts = parts
    grids = [self._as_grid(parts[m.index], m) for m in plan.members]
    if not grids or not grids[0].size:
      self.norms = jnp.zeros(plan.grid, parts[0].dtype if parts else jnp.float32)
    elif len(grids) == 1:
      self.norms = grids[0]
    else:  # the norm over the leaves of each expert's slice norms
      stacked = jnp.stack([g.reshape(-1) for g in grids])
      self.norms = unit_norms([stacked], p, LOCAL, ((1,),)).reshape(plan.grid)
    joined = {m.index for m in plan.members}
    self._others = [i for i in range(len(parts)) if i not in joined]
    self.units = jnp.concatenate(
        [self.norms.reshape(-1)] + [parts[i] for i in self._others])

  def _as_grid(self, units: jax.Array, member: _Member) -> jax.Array:
    grid = self._plan.grid
    if member.swapped:
      return units.reshape(grid[::-1]).T
    return units.reshape(grid)

  def to_leaves(self, values: jax.Array) -> list[jax.Array]:
    """``values`` (one per entry of ``units``) laid onto the leaves: an
    expert's value on its slice of every leaf that joins it."""
    size = int(np.prod(self._plan.grid))
    grid = values[:size].reshape(self._plan.grid)
    per_leaf: dict[int, jax.Array] = {}
    for member in self._plan.members:
      per_leaf[member.index] = (grid.T if member.swapped else grid).reshape(-1)
    start = size
    for i in self._others:
      per_leaf[i] = values[start:start + self._parts[i].size]
      start += self._parts[i].size
    if not per_leaf:
      return []
    return self.measured.to_leaves(jnp.concatenate([
        _everywhere(per_leaf[i], local.shape, whole) for i, (local, whole) in
        enumerate(zip(self.measured.here(), self.measured.unit_shapes()))]))


def measure_joint(fn: str, tree: PyTree, p, where: Where, expert_axis: PyTree,
                  layer_axis: PyTree = None) -> Joint:
  """Every expert's joint ``p``-norm over its slices of the leaves
  ``expert_axis`` gives an axis (per layer with ``layer_axis``), and every
  other leaf's own norms, from one pass and one all-reduce."""
  measured = measure(fn, tree, p, where, experts(expert_axis, layer_axis))
  plan = _plan(fn, tree, measured.shapes, expert_axis, layer_axis)
  return Joint(measured, plan, p)
