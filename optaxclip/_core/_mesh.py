"""Where the leaves live: the mesh axes their partial norms combine over.

Under ``shard_map``/``pmap`` each device holds a shard of every split leaf,
so each device's partial sums (or maxima) are combined over the named mesh
axes. ``specs`` (the PartitionSpecs given to ``shard_map``) say which leaves
are split on which axes: a leaf replicated on an axis holds the same values
on each device of that axis and must be counted once, and a unit whose kept
axis (a layer, an AGC output unit) is split over an axis is a different unit
on each device of it and must not be summed over that axis: each device
writes its units at its own place in a vector of every device's units
(zeros elsewhere), so one ``psum`` over all axes still combines everything,
and every device ends with every unit's norm (``Reduction.local`` reads its
own back).

Under sharded ``jit`` the compiler combines partial sums itself; the layout
helpers at the end keep each leaf's layout its own where a small vector of
per-unit values mixes leaves of different layouts.
"""

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optaxclip import _tree, _validation
from optaxclip._types import PyTree

Keep = tuple[int, ...]  # the axes of a leaf that its units keep (sorted)


def _is_spec(x: Any) -> bool:
  return x is None or isinstance(x, jax.sharding.PartitionSpec)


class Where(NamedTuple):
  """The ``shard_map``/``pmap`` axes the leaves are split over, and how.

  Attributes:
    axis_names: the mesh axes to combine partial norms over (empty: none).
    specs: each leaf's PartitionSpec (a tree prefix, as ``shard_map``'s
      ``in_specs``), or None: every leaf split on every axis.
  """
  axis_names: tuple[Any, ...] = ()
  specs: PyTree = None

  @classmethod
  def of(cls, fn: str, axis_name: Any = None, specs: PyTree = None) -> "Where":
    """``axis_name`` and ``specs`` checked, once, where a transform is built."""
    axis_names = _validation.check_axis_name(fn, axis_name)
    _validation.check_static(fn, "specs", specs, "PartitionSpecs or None")
    if specs is not None and not axis_names:
      raise ValueError(
          f"`{fn}(specs=...)` needs `axis_name`: specs say how leaves are split "
          f"over the named axes of shard_map/pmap; pass axis_name= too, or "
          f"leave specs out")
    for spec in jax.tree.leaves(specs, is_leaf=_is_spec):
      if not _is_spec(spec):
        raise TypeError(
            f"`{fn}(specs=...)` must hold PartitionSpecs (or None), got "
            f"{spec!r:.80} of type {type(spec).__name__}")
    return cls(axis_names, specs)

  def twice(self) -> "Where":
    """For a tree's leaves followed by as many more laid out alike."""
    return self if self.specs is None else self._replace(
        specs=(self.specs, self.specs))


HERE = Where()


class Reduction(NamedTuple):
  """Combines per-unit partials across the devices of ``axis_names``.

  Every leaf's partials are summed over all of ``axis_names`` with one
  ``psum``; only the device at index 0 of each axis a leaf is replicated on
  contributes, so the leaf is counted once. Units a device holds alone (a
  kept axis split over the mesh) travel at their own place in a vector of
  all devices' units: the combined vector is the same on every device, each
  unit in it once. Hashable, so compiled norms are cached per reduction.

  Attributes:
    axis_names: the mesh axes to combine over (empty: one device).
    replicated_axes: per leaf, the axes it is replicated on; None: every
      leaf is split on every axis.
    split_kept_axes: per leaf, the axes that split its kept axes, in the
      order they split them, or None where no leaf has such axes.
  """
  axis_names: tuple[Any, ...]
  replicated_axes: tuple[tuple[Any, ...], ...] | None = None
  split_kept_axes: tuple[tuple[Any, ...], ...] | None = None

  def sum(self, partials: jax.Array, sizes: tuple[int, ...] = ()
          ) -> jax.Array:
    """The sums over devices of ``partials``: a scalar, or a vector of
    ``sizes[i]`` units for leaf ``i`` (of every device's units, for a leaf
    whose kept axes are split: see ``local``)."""
    if not self.axis_names:
      return partials
    if self.replicated_axes is not None:
      first = self._first_copy()
      if sizes and any(size != 1 for size in sizes):
        first = first[np.repeat(np.arange(len(sizes)), sizes)]
      partials = partials * first.astype(partials.dtype)
    return lax.psum(self._spread(partials, sizes, 0), self.axis_names)

  def max(self, partials: jax.Array, sizes: tuple[int, ...] = ()
          ) -> jax.Array:
    # Replicated leaves need no mask: max ignores repeated values.
    if not self.axis_names:
      return partials
    return lax.pmax(self._spread(partials, sizes, -jnp.inf), self.axis_names)

  def unit_counts(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Per leaf, its units over all devices (``sizes``: on this one)."""
    if self.split_kept_axes is None:
      return tuple(sizes)
    return tuple(size * _devices(axes)
                 for size, axes in zip(sizes, self.split_kept_axes))

  def local(self, combined: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """This device's units (``sizes[i]`` of leaf ``i``) out of a vector of
    every device's (as ``sum`` returns); a scalar stays as it is."""
    if self.split_kept_axes is None or combined.ndim == 0:
      return combined
    return jnp.concatenate(self.local_parts(combined, sizes))

  def local_parts(self, combined: jax.Array, sizes: tuple[int, ...]
                  ) -> list[jax.Array]:
    """``local``, per leaf: a leaf whose units all devices share stays the
    same on every device (``shard_map`` checks that)."""
    split = self.split_kept_axes or ((),) * len(sizes)
    parts, start = [], 0
    for size, axes in zip(sizes, split):
      if axes:
        parts.append(lax.dynamic_slice_in_dim(
            combined, start + _position(axes) * size, size))
      else:
        parts.append(lax.slice_in_dim(combined, start, start + size))
      start += size * _devices(axes)
    return parts

  def _spread(self, partials: jax.Array, sizes: tuple[int, ...],
              fill: float) -> jax.Array:
    """``partials`` with each split leaf's units at this device's place
    among every device's units of it, ``fill`` elsewhere."""
    if self.split_kept_axes is None:
      return partials
    assert sizes, "split kept axes give units"
    pieces, start = [], 0
    for size, axes in zip(sizes, self.split_kept_axes):
      block = lax.slice_in_dim(partials, start, start + size)
      start += size
      if axes:
        mine = jnp.arange(_devices(axes)) == _position(axes)
        block = jnp.where(mine[:, None], block[None, :],
                          jnp.asarray(fill, block.dtype)).reshape(-1)
      pieces.append(block)
    return jnp.concatenate(pieces)

  def whole_count(self, leaf: int, local: int) -> int:
    """``local``, a count of leaf ``leaf``'s entries on this device along
    its reduced axes, over all devices (a kept axis split over the mesh
    holds other units, not more entries of these)."""
    replicated = () if self.replicated_axes is None else (
        self.replicated_axes[leaf])
    split_kept = () if self.split_kept_axes is None else (
        self.split_kept_axes[leaf])
    splitting = [a for a in self.axis_names
                 if a not in replicated and a not in split_kept]
    return local * math.prod(lax.axis_size(axis) for axis in splitting)

  def device_count(self) -> int:
    return lax.psum(1, self.axis_names) if self.axis_names else 1

  def repeated(self, times: int) -> "Reduction":
    """The reduction for these leaves listed ``times`` over."""
    def repeat(per_leaf):
      return None if per_leaf is None else per_leaf * times
    return self._replace(replicated_axes=repeat(self.replicated_axes),
                         split_kept_axes=repeat(self.split_kept_axes))

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


def _devices(axes: tuple[Any, ...]) -> int:
  return math.prod(lax.axis_size(axis) for axis in axes)


def _position(axes: tuple[Any, ...]) -> jax.Array:
  """This device's index along ``axes`` taken together, the first major
  (the order in which a PartitionSpec entry splits an axis)."""
  position = jnp.int32(0)
  for axis in axes:
    position = position * lax.axis_size(axis) + lax.axis_index(axis)
  return position


LOCAL = Reduction(())


def _entry_axes(entry: Any) -> tuple[Any, ...]:
  """The mesh axes one PartitionSpec entry names, in its order."""
  if entry is None:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def _spec_axes(spec: jax.sharding.PartitionSpec) -> set[Any]:
  """The mesh axes a whole PartitionSpec names."""
  return {axis for entry in spec for axis in _entry_axes(entry)}


def _leaf_specs(fn: str, tree: PyTree, specs: PyTree) -> list[Any]:
  """One PartitionSpec per leaf of ``tree`` (``specs`` is a tree prefix)."""
  specs = _tree.broadcast_prefix(
      fn, "specs", specs, tree, is_value=_is_spec,
      holds="PartitionSpecs (or None)",
      like="a PartitionSpec or a tree prefix of the gradients with "
           "PartitionSpec leaves (as shard_map's in_specs)")
  return [jax.sharding.PartitionSpec() if spec is None else spec
          for spec in specs]


def whole_shapes(fn: str, tree: PyTree, where: Where) -> list[tuple[int, ...]]:
  """Each clippable leaf's shape before ``shard_map`` split it by
  ``where.specs`` (the local shapes when there are no specs)."""
  leaves = _tree.clippable_leaves(tree)
  if where.specs is None:
    return [tuple(x.shape) for x in leaves]
  leaf_specs = [spec for x, spec in zip(jax.tree.leaves(tree),
                                        _leaf_specs(fn, tree, where.specs))
                if _tree.is_clippable(x)]
  return [tuple(d * _devices(_entry_axes(spec[i] if i < len(spec) else None))
                for i, d in enumerate(x.shape))
          for x, spec in zip(leaves, leaf_specs)]


def reduction(fn: str, tree: PyTree, where: Where,
              keep: Sequence[Keep] | None = None) -> Reduction:
  """The reduction for ``tree``'s clippable leaves (``keep``: per
  clippable leaf, the axes its units keep)."""
  if where.specs is None:
    return Reduction(where.axis_names)
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  replicated, split_kept = [], []
  clippable = ((path, spec) for (path, leaf), spec
               in zip(with_paths, _leaf_specs(fn, tree, where.specs))
               if _tree.is_clippable(leaf))
  for i, (path, spec) in enumerate(clippable):
    split = _spec_axes(spec)
    if split - set(where.axis_names):
      raise ValueError(
          f"`{fn}(specs=...)` splits leaf {jax.tree_util.keystr(path)} over "
          f"mesh axes {sorted(map(str, split - set(where.axis_names)))} that "
          f"are not in axis_name={where.axis_names!r}: its norm would differ "
          f"per device. Add them to axis_name")
    kept = [] if keep is None else [
        a for d in keep[i] if d < len(spec) for a in _entry_axes(spec[d])]
    replicated.append(tuple(a for a in where.axis_names if a not in split))
    split_kept.append(tuple(kept))
  return Reduction(where.axis_names, tuple(replicated),
                   tuple(split_kept) if any(split_kept) else None)


# Layouts on a mesh while tracing (sharded jit). On an Explicit mesh a
# value's PartitionSpec is part of its type; on an Auto mesh the compiler
# picks it, and propagates it through whatever values share an operation.

def _mesh(x: jax.Array) -> Any:
  """The (abstract) mesh ``x`` is laid out on while tracing, or None."""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  return None if mesh is None or mesh.empty else mesh


def mesh_size(x: jax.Array) -> int | None:
  """How many devices the mesh ``x`` is laid out on while tracing has, or
  None off any mesh."""
  mesh = _mesh(x)
  return None if mesh is None else mesh.size


def mesh_platform(x: jax.Array) -> str | None:
  """The platform (``"cpu"``, ``"cuda"``, ``"tpu"``...) of the devices of
  the mesh ``x`` is laid out on while tracing, where its abstract mesh
  records them (inputs with a ``NamedSharding``, ``shard_map``); else None."""
  device = getattr(_mesh(x), "abstract_device", None)
  return None if device is None else device.platform


def layout_spec(x: jax.Array) -> Any:
  """``x``'s PartitionSpec (a tuple) while tracing; "auto" on a mesh with
  axes whose layouts the compiler picks (Auto); None off any mesh."""
  mesh = _mesh(x)
  if mesh is None:
    return None
  if any(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return "auto"
  return tuple(jax.typeof(x).sharding.spec)


def _whole(x: jax.Array) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(_mesh(x), jax.sharding.PartitionSpec())


def gathered(units: jax.Array) -> jax.Array:
  """``units`` (a few per-unit values) whole on every device where an
  Explicit mesh splits them (a layer axis sharded over a mesh axis), so
  that they flatten and concatenate with vectors of other layouts."""
  spec = layout_spec(units)
  if spec is None or spec == "auto" or all(s is None for s in spec):
    return units
  return jax.sharding.reshard(units, _whole(units))


def whole_on_auto_mesh(factors: jax.Array) -> jax.Array:
  """``factors`` (one per layer or unit of a leaf) constrained whole on
  every device of an Auto mesh: else XLA may give them the layout of a
  vector they share with another leaf's (the statistics concatenate all
  leaves' factors) and pass it on to the update of this leaf."""
  if factors.ndim == 0 or layout_spec(factors) != "auto":
    return factors
  return lax.with_sharding_constraint(factors, _whole(factors))


def without_leading_axis(x: jax.Array) -> Any:
  """On an Explicit mesh, the layout of ``x`` summed over its first axis
  (a batch): its own over the others. None elsewhere (the compiler picks)."""
  spec = layout_spec(x)
  if spec is None or spec == "auto":
    return None
  rest = (tuple(spec) + (None,) * x.ndim)[1:x.ndim]
  return jax.sharding.NamedSharding(_mesh(x), jax.sharding.PartitionSpec(*rest))
