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
  grid: tuple[int, ...]  # [layers, experts] or [experts]
  members: tuple[_Member, ...]


Labels = list[str] | None  # per clippable leaf, the group its experts join


def _plans(fn: str, tree: PyTree, shapes: list[tuple[int, ...]],
           expert_axis: PyTree, layer_axis: PyTree, labels: Labels = None,
           arg: str = "expert_axis") -> dict[str, _Plan]:
  """Per label (``labels``: each clippable leaf's, default ``""`` for all),
  the leaves with an expert axis that join it and the grid they share; a
  ValueError naming two leaves whose experts (or layers) do not line up."""
  by_expert = layer_keep(fn, tree, expert_axis, "expert_axis", "experts")
  by_layer = layer_keep(fn, tree, layer_axis) or ((),) * len(shapes)
  paths = [path for path, _ in _tree.clippable_leaves_with_paths(tree)]
  members: dict[str, list[_Member]] = {}
  grids: dict[str, tuple[tuple[int, ...], int]] = {}
  for i, (expert, layer) in enumerate(zip(by_expert or (), by_layer)):
    if not expert:
      continue
    label = "" if labels is None else labels[i]
    mine = tuple(shapes[i][a] for a in layer + expert)
    grid, first = grids.setdefault(label, (mine, i))
    if mine != grid:
      raise ValueError(_mismatch(fn, arg, paths, shapes, first, i, grid, mine))
    members.setdefault(label, []).append(
        _Member(i, bool(layer) and layer[0] > expert[0]))
  return {label: _Plan(grids[label][0], tuple(group))
          for label, group in members.items()}


def _mismatch(fn: str, arg: str, paths: list[str], shapes: list[tuple[int, ...]],
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
  return (f"`{fn}({arg}=...)`: {says}; an expert is joined across the "
          f"leaves with an expert axis, so each must stack as many experts "
          f"(and layers, with layer_axis); give None to leaves outside")


def _shapes_at_init(fn: str, tree: PyTree, where: Where) -> list[tuple[int, ...]]:
  """Whole shapes: inside ``shard_map`` from ``where``'s specs; outside (an
  ``init`` with the whole parameters) the leaves' own."""
  try:
    return whole_shapes(fn, tree, where)
  except NameError:  # the mesh axes are not bound: not inside shard_map
    return [tuple(np.shape(x)) for x in _tree.clippable_leaves(tree)]


def joint_shapes(fn: str, tree: PyTree, where: Where, expert_axis: PyTree,
                 layer_axis: PyTree = None, labels: Labels = None,
                 arg: str = "expert_axis") -> dict[str, tuple[int, ...]]:
  """Per label, the shape of its experts' joint norms, without measuring:
  ``[layers, experts]`` or ``[experts]`` (a state's shapes at ``init``).
  Without ``labels``, one group labelled ``""`` (none if no leaf stacks
  experts)."""
  shapes = _shapes_at_init(fn, tree, where)
  plans = _plans(fn, tree, shapes, expert_axis, layer_axis, labels, arg)
  return {label: plan.grid for label, plan in plans.items()}


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
    grids: per label, its experts' joint norms, ``[layers, experts]``
      (``[experts]``), every device's: the same on each.
    norms: the grid of the one label ``""`` (``[0]`` if no leaf stacks
      experts).
    others: the clippable leaves outside every group, by index.
    units: the grids' norms (label by label, each in C order), then the
      units of the ``others`` (per leaf, per layer), leaf by leaf: what
      ``to_leaves`` takes one value of each.
    measured: the per-slice measure (each leaf's own per-expert norms).
  """

  def __init__(self, measured: Measured, plans: dict[str, _Plan], p):
    self.measured, self._plans = measured, plans
    self._parts = [_whole(part, local.shape, whole) for part, local, whole in
                   zip(measured.per_leaf(), measured.here(),
                       measured.unit_shapes())]
    self.grids = {label: self._joined(plan, p) for label, plan in plans.items()}
    dtype = self._parts[0].dtype if self._parts else jnp.float32
    self.norms = self.grids.get("", jnp.zeros([0], dtype))
    joined = {m.index for plan in plans.values() for m in plan.members}
    self.others = [i for i in range(len(self._parts)) if i not in joined]
    self.units = jnp.concatenate(
        [grid.reshape(-1) for grid in self.grids.values()]
        + [self._parts[i] for i in self.others] + [jnp.zeros([0], dtype)])

  def _joined(self, plan: _Plan, p) -> jax.Array:
    """The norm over the members of each expert's slice norms."""
    grids = [self._parts[m.index].reshape(plan.grid[::-1]).T if m.swapped
             else self._parts[m.index].reshape(plan.grid) for m in plan.members]
    if len(grids) == 1 or not grids[0].size:
      return grids[0]
    stacked = jnp.stack([g.reshape(-1) for g in grids])
    return unit_norms([stacked], p, LOCAL, ((1,),)).reshape(plan.grid)

  def unit_counts(self) -> list[int]:
    """Per leaf of ``others``, how many units it has (over all devices)."""
    return [self._parts[i].size for i in self.others]

  def to_leaves(self, values: jax.Array) -> list[jax.Array]:
    """``values`` (one per entry of ``units``) laid onto the leaves: an
    expert's value on its slice of every leaf that joins it."""
    per_leaf: dict[int, jax.Array] = {}
    start = 0
    for plan in self._plans.values():
      size = int(np.prod(plan.grid))
      grid = values[start:start + size].reshape(plan.grid)
      start += size
      for m in plan.members:
        per_leaf[m.index] = (grid.T if m.swapped else grid).reshape(-1)
    for i in self.others:
      per_leaf[i] = values[start:start + self._parts[i].size]
      start += self._parts[i].size
    if not per_leaf:
      return []
    return self.measured.to_leaves(jnp.concatenate([
        _everywhere(per_leaf[i], local.shape, whole) for i, (local, whole) in
        enumerate(zip(self.measured.here(), self.measured.unit_shapes()))]))


def measure_joint(fn: str, tree: PyTree, p, where: Where, expert_axis: PyTree,
                  layer_axis: PyTree = None, labels: Labels = None,
                  arg: str = "expert_axis") -> Joint:
  """Every expert's joint ``p``-norm over its slices of the leaves
  ``expert_axis`` gives an axis (per layer with ``layer_axis``; per label
  with ``labels``, each clippable leaf's), and every other leaf's own
  norms, from one pass and one all-reduce (``arg``: the argument that gave
  the expert axes, for errors)."""
  measured = measure(fn, tree, p, where, experts(expert_axis, layer_axis))
  plans = _plans(fn, tree, measured.shapes, expert_axis, layer_axis, labels,
                 arg)
  return Joint(measured, plans, p)
