"""How partial norms combine across devices: specs and the one all-reduce.

Under ``shard_map``/``pmap`` each device holds a shard of every split leaf,
so each device's partial sums (or maxima) are combined over the named mesh
axes. ``specs`` (the PartitionSpecs given to ``shard_map``) say which leaves
are split on which axes: a leaf replicated on an axis holds the same values
on each device of that axis and must be counted once, and a unit whose kept
axis (a layer, an AGC output unit) is split over an axis is a different unit
on each device of it and must not be summed over that axis.
"""

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optaxclip import _tree, _validation

PyTree = Any


class Reduction(NamedTuple):
  """Combines per-unit partials across the devices of ``axis_names``.

  Every leaf's partials are summed over all of ``axis_names`` with one
  ``psum``; only the device at index 0 of each axis a leaf is replicated on
  contributes, so the leaf is counted once. Hashable, so compiled norms are
  cached per reduction.

  Attributes:
    axis_names: the mesh axes to combine over (empty: one device).
    replicated_axes: per leaf, the axes it is replicated on; None: every
      leaf is split on every axis.
    split_kept_axes: per leaf, the axes that split its kept axes (a sharded
      layer or AGC unit axis: a different unit on each device of them), or
      None where no leaf has such axes. See ``partitions``.
    batch_axis: the ``vmap`` axis of per-example norms, if any.
    agree_axes: the axes all devices of which must take the rescue branch
      together, where they hold different units (see ``partitions``).
  """
  axis_names: tuple[Any, ...]
  replicated_axes: tuple[tuple[Any, ...], ...] | None = None
  split_kept_axes: tuple[tuple[Any, ...], ...] | None = None
  batch_axis: Any = None
  agree_axes: tuple[Any, ...] = ()

  def decide(self, needed: jax.Array) -> jax.Array:
    """Whether any norm needs the rescue: one answer for all devices and
    the whole batch, so that every device and example takes one branch.

    Under ``vmap`` a per-example answer would make ``lax.cond`` a select
    that runs the rescue for every example. Units summed over all devices
    agree already; units that differ per device ask ``agree_axes``.
    """
    needed = jnp.any(needed)
    if self.agree_axes:
      needed = lax.pmax(needed.astype(jnp.int32), self.agree_axes) > 0
    if self.batch_axis is None:
      return needed
    return lax.pmax(needed.astype(jnp.int32), self.batch_axis) > 0

  def sum(self, partials: jax.Array, sizes: tuple[int, ...] = ()
          ) -> jax.Array:
    """The sums over devices of ``partials``: a scalar, or a vector of
    ``sizes[i]`` units for leaf ``i``."""
    if not self.axis_names:
      return partials
    if self.replicated_axes is not None:
      first = self._first_copy()
      if sizes and any(size != 1 for size in sizes):
        first = first[np.repeat(np.arange(len(sizes)), sizes)]
      partials = partials * first.astype(partials.dtype)
    return lax.psum(partials, self.axis_names)

  def max(self, partials: jax.Array, sizes: tuple[int, ...] = ()
          ) -> jax.Array:
    # Replicated leaves need no mask: max ignores repeated values.
    del sizes
    return lax.pmax(partials, self.axis_names) if self.axis_names else partials

  def whole_count(self, leaf: int, local: int, *, kept: bool = False) -> int:
    """``local``, a count of leaf ``leaf``'s entries on this device, over
    all devices: of its reduced axes (default), or with ``kept`` of its
    kept axes (layers, units). Under ``shard_map`` a device holds a shard."""
    replicated = () if self.replicated_axes is None else (
        self.replicated_axes[leaf])
    split_kept = () if self.split_kept_axes is None else (
        self.split_kept_axes[leaf])
    splitting = (split_kept if kept else
                 [a for a in self.axis_names
                  if a not in replicated and a not in split_kept])
    return local * math.prod(lax.axis_size(axis) for axis in splitting)

  def device_count(self) -> int:
    return lax.psum(1, self.axis_names) if self.axis_names else 1

  def partitions(self, count: int) -> list[tuple[list[int], "Reduction"]]:
    """The ``count`` leaves as sets summed over the same axes, each with
    the reduction for it.

    A leaf whose kept axes are split over some mesh axes holds different
    units on the devices of those axes: it is summed over the others only.
    Each set keeps its own result (a vector mixing sets would vary over
    every axis, and ``shard_map``'s replication check would reject it);
    the rescue is decided over all axes together.
    """
    if self.split_kept_axes is None:
      return [(list(range(count)), self)]
    by_axes: dict[tuple[Any, ...], list[int]] = {}
    for i, split in enumerate(self.split_kept_axes):
      summed = tuple(a for a in self.axis_names if a not in split)
      by_axes.setdefault(summed, []).append(i)
    replicated = self.replicated_axes or ((),) * count
    return [(rows, Reduction(
        summed, tuple(tuple(a for a in replicated[i] if a in summed)
                      for i in rows),
        batch_axis=self.batch_axis, agree_axes=self.axis_names))
            for summed, rows in by_axes.items()]

  def repeated(self, times: int) -> "Reduction":
    """The reduction for these leaves listed ``times`` over (AGC reduces
    gradients and parameters together)."""
    def repeat(per_leaf):
      return None if per_leaf is None else per_leaf * times
    return self._replace(replicated_axes=repeat(self.replicated_axes),
                         split_kept_axes=repeat(self.split_kept_axes))

  def counting(self) -> "Reduction":
    """The reduction that counts each unit once: summed over the axes
    that split it into different units, once over all the others."""
    if self.replicated_axes is None:
      return self
    kept = self.split_kept_axes or ((),) * len(self.replicated_axes)
    return Reduction(self.axis_names, tuple(
        tuple(a for a in self.axis_names if a not in split) for split in kept))

  def _first_copy(self) -> jax.Array:
    """Per leaf, whether this device holds the copy that counts."""
    assert self.replicated_axes is not None
    masks = []
    for axes in self.replicated_axes:
      is_first = jnp.bool_(True)
      for axis in axes:
        is_first = is_first & (lax.axis_index(axis) == 0)
      masks.append(is_first)
    return jnp.stack(masks)


LOCAL = Reduction(())


def _spec_axes(entry: Any) -> set[Any]:
  """The mesh axes one PartitionSpec entry (or a whole spec) names."""
  if entry is None:
    return set()
  if isinstance(entry, jax.sharding.PartitionSpec):
    return set().union(*map(_spec_axes, entry)) if len(entry) else set()
  return set(entry if isinstance(entry, tuple) else (entry,))


def _is_spec(x: Any) -> bool:
  return x is None or isinstance(x, jax.sharding.PartitionSpec)


def _leaf_specs(fn: str, tree: PyTree, specs: PyTree) -> list[Any]:
  """One PartitionSpec per leaf of ``tree`` (``specs`` is a tree prefix)."""
  specs = _tree.broadcast_prefix(
      fn, "specs", specs, tree, is_value=_is_spec,
      holds="PartitionSpecs (or None)",
      like="a PartitionSpec or a tree prefix of the gradients with "
           "PartitionSpec leaves (as shard_map's in_specs)")
  return [jax.sharding.PartitionSpec() if spec is None else spec
          for spec in specs]


def whole_shapes(fn: str, tree: PyTree, specs: PyTree) -> list[tuple[int, ...]]:
  """Each clippable leaf's shape before ``shard_map`` split it by ``specs``
  (under ``shard_map``; the local shapes when ``specs`` is None)."""
  leaves = _tree.clippable_leaves(tree)
  if specs is None:
    return [tuple(x.shape) for x in leaves]
  leaf_specs = [spec for x, spec in zip(jax.tree.leaves(tree),
                                        _leaf_specs(fn, tree, specs))
                if _tree.is_clippable(x)]
  return [tuple(d * math.prod(lax.axis_size(a) for a in _spec_axes(
      spec[i] if i < len(spec) else None)) for i, d in enumerate(x.shape))
          for x, spec in zip(leaves, leaf_specs)]


def make_reduction(fn: str, tree: PyTree, axis_name: Any, specs: PyTree,
                   keep: Sequence[tuple[int, ...]] | None = None
                   ) -> Reduction:
  """The reduction for ``tree``'s clippable leaves given the user's options
  (``keep``: per clippable leaf, the axes its units keep)."""
  axis_names = _validation.check_axis_name(fn, axis_name)
  if specs is None:
    return Reduction(axis_names)
  if not axis_names:
    raise ValueError(
        f"`{fn}(specs=...)` needs `axis_name`: specs say how leaves are split "
        f"over the named axes of shard_map/pmap")
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  replicated, split_kept = [], []
  clippable = ((path, spec) for (path, leaf), spec
               in zip(with_paths, _leaf_specs(fn, tree, specs))
               if _tree.is_clippable(leaf))
  for i, (path, spec) in enumerate(clippable):
    split = _spec_axes(spec)
    if split - set(axis_names):
      raise ValueError(
          f"`{fn}(specs=...)` splits leaf {jax.tree_util.keystr(path)} over "
          f"mesh axes {sorted(map(str, split - set(axis_names)))} that are not "
          f"in axis_name={axis_name!r}: its norm would differ per device. Add "
          f"them to axis_name")
    kept = set() if keep is None else set().union(
        *(_spec_axes(spec[d]) for d in keep[i] if d < len(spec)))
    replicated.append(tuple(a for a in axis_names if a not in split))
    split_kept.append(tuple(a for a in axis_names if a in kept))
  return Reduction(axis_names, tuple(replicated),
                   tuple(split_kept) if any(split_kept) else None)
