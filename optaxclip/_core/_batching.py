"""Leaves grouped for compile time, and where each one's results go.

A norm reduces every leaf over some of its axes (all of them, or all but a
kept layer or unit axis) to one partial value per *unit*: one per leaf, per
layer or per AGC unit. XLA:CPU compiles each small reduction as a kernel of
its own, so a tree of thousands of small leaves would compile thousands of
them: small leaves of one shape, dtype, sharding and kept axes are stacked
and reduced together instead (one fusion per group), once, for the plain
pass and the rare rescue pass alike. Larger leaves reduce on their own, so
run time never pays for copying them. A total (no per-leaf partials) may
merge small leaves of any shape instead, as the platform's ``Layout``
says: concatenated, or (XLA:TPU, where a concatenation is a copy) those
of one shape added entry by entry.

Measured (benchmarks/, compile target): groups of 256 leaves compile 2000
leaves in half the time one group of all of them takes, since XLA's cost of
compiling one concatenation grows faster than its operand count beyond a
few hundred, and separate groups compile in parallel.
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optaxclip._core._mesh import Keep, Reduction, gathered, layout_spec, mesh_size


class Layout(NamedTuple):
  """How a total groups its leaves on a platform: leaves up to ``limit``
  entries merge, at most ``size`` of them to a group, concatenated or (with
  ``summed``) those of one shape added entry by entry; reductions that a
  backend adds one entry after the other go in blocks of ``block`` (0: one
  reduction; see ``_blocks``)."""
  limit: int
  size: int
  block: int = 0
  summed: bool = False


# XLA:CPU: one reduction per group of up to 256 leaves (docstring above),
# and variadic reductions in blocks of 16.
CPU = Layout(limit=1 << 15, size=256, block=16)
# XLA:GPU fuses a concatenation into the reduction that reads it up to
# about 64 operands, where the reduction's input is one value per entry
# (its bits: ``_exponent_sums``), and writes it out beyond (H100,
# deviceless: 2000 small leaves 34 fusions, 1.001 passes, 3.4 s to compile
# against optax's 2022, 1.001 and 8.2 s; LoRA adapters up to 2**18 entries,
# 672 of them: 13 fusions, 1.001 passes).
GPU = Layout(limit=1 << 18, size=64)
# XLA:TPU lays leaves out in tiles: a concatenation, a stack or the rows of
# a flattened leaf are copies (v5e, deviceless, 150 small leaves: merged 64
# to a group 16.1 passes, each alone in rows 12.6, optax's 5.0). Leaves of
# one shape add entry by entry instead, which it fuses into the reduction
# of their sum up to about 64 operands (LoRA adapters: 128 of them were 95
# fusions and 3.0 passes), without moving one: 2000 small leaves 35
# fusions, 672 LoRA adapters 12 (optax's: one per leaf).
TPU = Layout(limit=1 << 18, size=64, summed=True)
# Leaves up to this many elements are grouped with others (per-unit norms,
# and totals on the CPU).
GROUP_LIMIT = CPU.limit
# At most this many leaves per group.
GROUP_SIZE = CPU.size


def _take(vector: jax.Array, indices) -> jax.Array:
  """``vector[indices]`` for static in-bounds indices (a slice where they
  are a contiguous range, else a bare gather)."""
  indices = np.asarray(indices)
  flat = indices.ravel()
  if flat.size and np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)):
    taken = lax.slice_in_dim(vector, int(flat[0]), int(flat[0]) + flat.size)
  else:
    taken = vector.at[flat].get(mode="promise_in_bounds", unique_indices=True)
  return taken.reshape(indices.shape)


class Group(NamedTuple):
  """Values reduced together: a leaf, a stack of leaves, or (merged) a flat
  concatenation of leaves, or leaves of one shape added entry by entry
  (``summed``), that only a total is wanted of."""
  values: Any  # an array (or a tuple of arrays grouped alike: see `zip`);
  #              summed: a tuple of such, one per leaf
  reduced: tuple[int, ...]  # the axes of `values` reduced to its units
  units: Any  # the units' positions in the unit vector, shaped like
  #             `values` with `reduced` axes of size 1; None when merged
  summed: bool = False

  def pick(self, per_unit: jax.Array) -> jax.Array:
    """The entries of ``per_unit`` (a vector in unit order, or a scalar
    shared by all) that belong to these values, shaped to broadcast
    against them."""
    if per_unit.ndim == 0:
      return per_unit
    assert self.units is not None, "a merged group has no units"
    if self.units.size == 1:
      return per_unit[int(self.units.ravel()[0])]
    return _take(per_unit, self.units)

  def terms(self, elementwise: Callable[[Any, "Group"], Any],
            combine: Callable[[Any, Any], Any]) -> Any:
    """``elementwise`` of these values; of a summed group's leaves, their
    results combined entry by entry (``combine``: what the reduction does,
    by halves)."""
    if not self.summed:
      return elementwise(self.values, self)
    return pairwise(combine, [elementwise(v, self) for v in self.values])


def _stacking_layout(x: jax.Array) -> Any:
  """What two leaves must share to be stacked without moving data.

  Unsharded leaves share everything; on an Explicit mesh, leaves with the
  same PartitionSpec do. On an Auto mesh the sharding is unknown while
  tracing (the compiler picks it): such leaves reduce alone (None), since
  stacking differently sharded leaves would make XLA move them.
  """
  spec = layout_spec(x)
  if spec == "auto":
    return () if mesh_size(x) == 1 else None
  return () if spec is None else ("explicit", spec)


# How a group holds its leaves: stacked (or alone), concatenated flat, or
# added entry by entry.
STACKED, MERGED, SUMMED = "stacked", "merged", "summed"


def _plan(leaves: Sequence[jax.Array], keep: Sequence[Keep], *,
          merge: Layout | None) -> list[tuple[str, list[int]]]:
  """Which leaves go together, and how: ``(how, leaf indices)`` per group."""
  by_key: dict[tuple, list[int]] = {}  # keyed by how, then what they share
  for i, (x, kept) in enumerate(zip(leaves, keep)):
    layout = _stacking_layout(x)
    if merge is not None and layout == () and x.size <= merge.limit:
      key = (SUMMED, x.shape, x.dtype) if merge.summed else (MERGED, x.dtype)
    elif x.size > GROUP_LIMIT or layout is None:
      key = (STACKED, i)  # alone
    else:
      key = (STACKED, x.shape, x.dtype, layout, kept)
    by_key.setdefault(key, []).append(i)
  plan = []
  for (how, *_), all_rows in by_key.items():
    size = GROUP_SIZE if how == STACKED or merge is None else merge.size
    plan += [(how, all_rows[start:start + size])  # in order
             for start in range(0, len(all_rows), size)]
  return plan


def _flat(reduced: jax.Array) -> jax.Array:
  if reduced.ndim > 1:  # an Explicit mesh may not flatten split axes
    reduced = gathered(reduced)
  return reduced.reshape(-1)


# Unit vectors are put in order from at most this many runs of units by
# slices (more: one gather). A gather of AGC's units, as many as the
# leaves' entries over 2 for 3-D leaves, is a pass of its own on an
# accelerator; slices of the groups' results fold into what reads them.
_RUNS = 256


def _runs(orders: list[np.ndarray]) -> list[tuple[int, int, int]]:
  """``(group, first, stop)``: each group's results ``[first:stop]`` whose
  units are consecutive, in unit order."""
  runs = []
  for k, order in enumerate(orders):
    if not order.size:  # a group of empty leaves: no units
      continue
    cuts = np.flatnonzero(np.diff(order) != 1) + 1
    runs += [(int(order[a]), k, int(a), int(b))
             for a, b in zip([0, *cuts], [*cuts, order.size])]
  return [run[1:] for run in sorted(runs)]


def _in_order(pieces: list[jax.Array], orders: list[np.ndarray]) -> jax.Array:
  """The groups' unit vectors as one, in unit order (``orders``: each
  group's units' positions)."""
  if len({layout_spec(piece) for piece in pieces}) > 1:
    pieces = [gathered(piece) for piece in pieces]
  order = np.concatenate(orders)
  if np.array_equal(order, np.arange(order.size)):
    return jnp.concatenate(pieces)
  runs = _runs(orders)
  if len(runs) > _RUNS:
    return _take(jnp.concatenate(pieces), np.argsort(order))
  return jnp.concatenate([pieces[k] if (first, stop) == (0, pieces[k].size)
                          else lax.slice_in_dim(pieces[k], first, stop)
                          for k, first, stop in runs])


class Grouped:
  """``leaves`` in groups; each leaf's units are its ``keep`` axes' entries.

  ``layout``: the ``Layout`` of the platform the norm runs on (None: the
  kernel needs none). With ``merge`` (a total that needs no per-leaf
  partials), small unsharded leaves of one dtype are concatenated as it
  says, whatever their shapes: one reduction per group.
  """

  def __init__(self, leaves: Sequence[jax.Array],
               keep: Sequence[Keep] | None = None, *,
               layout: Layout | None = None, merge: bool = False,
               plan: list[tuple[str, list[int]]] | None = None):
    keep = [()] * len(leaves) if keep is None else list(keep)
    if plan is None:
      plan = _plan(leaves, keep, merge=layout if merge else None)
    self.plan = plan
    self.layout = layout
    self.keep = keep
    self.leaves = list(leaves)
    self.complex = any(jnp.iscomplexobj(x) for x in leaves)
    self.kept_shapes = [tuple(x.shape[a] for a in k)
                        for x, k in zip(leaves, keep)]
    self.sizes = tuple(math.prod(shape) for shape in self.kept_shapes)
    self.entries = sum(x.size for x in leaves)
    offsets = np.cumsum((0,) + self.sizes)
    self.groups = [self._group([leaves[i] for i in rows], rows, offsets,
                               how=how)
                   for how, rows in self.plan]

  def _group(self, members, rows, offsets, *, how: str) -> Group:
    first, kept = members[0], self.keep[rows[0]]
    if how == MERGED and len(members) > 1:
      # lax, not jnp, and no reshape of vectors: this runs once per leaf, and
      # tracing time is part of the compile time of trees with many leaves.
      return Group(lax.concatenate(
          [x if x.ndim == 1 else lax.reshape(x, (x.size,)) for x in members],
          0), (0,), None)
    if how == SUMMED and len(members) > 1:
      return Group(tuple(members), tuple(range(first.ndim)), None, summed=True)
    # Positions of each member's units, shaped to broadcast against it.
    shape = tuple(d if a in kept else 1 for a, d in enumerate(first.shape))
    units = np.stack([offsets[i] + np.arange(self.sizes[i]).reshape(shape)
                      for i in rows])
    reduced = tuple(a for a in range(first.ndim) if a not in kept)
    if len(members) == 1:
      return Group(first, reduced, units[0])
    return Group(jnp.stack(members), tuple(a + 1 for a in reduced), units)

  def zip(self, others: Sequence[jax.Array]) -> list[Group]:
    """The groups with ``(leaf values, other values)``, ``others`` (the
    tangents of the leaves) grouped exactly as the leaves were."""
    twins = Grouped(others, self.keep, plan=self.plan).groups
    return [group._replace(values=tuple(zip(group.values, twin.values))
                           if group.summed else (group.values, twin.values))
            for group, twin in zip(self.groups, twins)]

  def unsummed(self) -> "Grouped":
    """These leaves with each summed group's leaves alone: for reductions
    that do not add (the pairs of ``_one_pass``)."""
    plan = []
    for how, rows in self.plan:
      plan += [(STACKED, [i]) for i in rows] if how == SUMMED else [(how, rows)]
    return Grouped(self.leaves, self.keep, layout=self.layout, plan=plan)

  def per_unit(self, groups: Sequence[Group],
               elementwise: Callable[[Any, Group], Any],
               reduce: Callable[..., Any]) -> Any:
    """``reduce(elementwise(values, group))`` over each unit: a vector in
    unit order (leaf by leaf, each leaf's kept entries in C order), or a
    tuple of them where ``reduce`` returns a tuple."""
    pieces, order = [], []
    several = False
    for group in groups:
      assert group.units is not None, "per unit needs unmerged groups"
      reduced = reduce(elementwise(group.values, group), axis=group.reduced)
      several = isinstance(reduced, tuple)
      pieces.append([_flat(r) for r in (reduced if several else (reduced,))])
      order.append(group.units.reshape(-1))
    vectors = tuple(_in_order(list(column), order) for column in zip(*pieces))
    return vectors if several else vectors[0]

  def unit_shapes(self, leaves: Sequence[jax.Array], *, keepdims: bool
                  ) -> list[tuple[int, ...]]:
    """Per leaf, the shape of its units: of its kept axes, or with
    ``keepdims`` of the leaf's rank (reduced axes of size 1), to broadcast
    against it."""
    if not keepdims:
      return list(self.kept_shapes)
    return [tuple(d if a in kept else 1 for a, d in enumerate(x.shape))
            for x, kept in zip(leaves, self.keep)]


def pairwise(combine: Callable[[Any, Any], Any], items: Sequence[Any]) -> Any:
  """``combine`` over ``items`` by halves (a balanced tree): a sum of ``k``
  group partials takes ``ceil(log2(k))`` roundings, one after the other
  would take ``k - 1``."""
  items = list(items)
  while len(items) > 1:
    items = [combine(*items[i:i + 2]) if i + 1 < len(items) else items[i]
             for i in range(0, len(items), 2)]
  return items[0]


def reduce(grouped: Grouped, elementwise: Callable[[Any, Group], jax.Array],
           reduction: Reduction, *, maximum: bool, total: bool,
           initial: float = 0, groups: list[Group] | None = None) -> jax.Array:
  """Sums (or maxima, at least ``initial``) of ``elementwise(values, group)``
  per unit over all devices of ``reduction``, as a vector in unit order;
  with ``total``, of all units together, as a scalar. ``groups`` (default
  ``grouped.groups``) may pair the leaves with their tangents.
  """
  groups = grouped.groups if groups is None else groups
  reducer = functools.partial(jnp.max, initial=initial) if maximum else jnp.sum
  across = reduction.max if maximum else reduction.sum
  if total and reduction.replicated_axes is None:
    # Each group reduces to a scalar and these combine by scalar ops: no
    # small vector is reduced (XLA:CPU compiles each small reduction as a
    # costly kernel of its own), and the devices share one all-reduce.
    combine = jnp.maximum if maximum else jnp.add
    return across(pairwise(
        combine, [reducer(group.terms(elementwise, combine))
                  for group in groups]))
  partials = across(grouped.per_unit(groups, elementwise, reducer),
                    grouped.sizes)
  if not total:
    return partials
  return jnp.max(partials) if maximum else jnp.sum(partials)


def sibling_sums(values: tuple[jax.Array, ...], axis) -> tuple[jax.Array, ...]:
  return tuple(jnp.sum(v, axis=axis) for v in values)


def variadic_sums(values: tuple[jax.Array, ...], axis) -> tuple[jax.Array, ...]:
  """``sibling_sums`` as one variadic reduction: XLA:TPU reads a summed
  group's leaves once for all the sums so, once per sum as siblings."""
  zeros = tuple(jnp.zeros([], v.dtype) for v in values)
  return tuple(lax.reduce(tuple(values), zeros, _added, tuple(axis)))


class Partials(NamedTuple):
  """What an ``elementwise`` of ``reduce_many`` may give, for a total,
  instead of one array per sum: a group's partial results (vectors, reduced
  already by a reduction of its own: ``_exponent_sums``), which ``finish``
  turns into the sums, once for all such groups' partials side by side.
  One fusion per group and one for them all: XLA:GPU splits a long
  reduction in two kernels of its own."""
  values: tuple[jax.Array, ...]
  finish: Callable[[tuple[jax.Array, ...]], tuple[jax.Array, ...]]


def _added(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]):
  return tuple(x + y for x, y in zip(a, b))


def reduce_many(grouped: Grouped, elementwise: Callable[[Any, Group], tuple],
                reduction: Reduction, *, total: bool,
                reducer: Callable[..., Any] = sibling_sums,
                combine: Callable[[tuple, tuple], tuple] = _added,
                across: Callable[..., tuple] | None = None) -> tuple:
  """``reduce`` for an ``elementwise`` that gives several arrays (sums of
  each, or ``reducer``/``combine`` of them together, as a variadic
  reduction): each group is read once for all of them, and they cross the
  devices together (``across(partials, sizes)``; by default one
  all-reduce of the sums side by side). For a total, ``elementwise`` may
  give a group's partial results instead (``Partials``)."""
  groups = grouped.groups
  if across is None:
    across = functools.partial(_sums_across, reduction)
  if total and reduction.replicated_axes is None:
    results, partials = [], []
    for group in groups:
      # (a summed group's arrays add entry by entry, then sum: ``reducer``
      # must be sums where groups are summed)
      out = group.terms(elementwise, _added)
      if isinstance(out, Partials):
        partials.append(out)
        continue
      axes = tuple(range(out[0].ndim))
      results.append(variadic_sums(out, axes) if group.summed else reducer(out, axis=axes))
    if partials:
      results.append(partials[0].finish(tuple(
          jnp.concatenate(column) for column in zip(*(q.values for q in partials)))))
    return across(pairwise(combine, results), ())
  partials = across(grouped.per_unit(groups, elementwise, reducer),
                    grouped.sizes)
  return reducer(partials, axis=(0,)) if total else partials


def _sums_across(reduction: Reduction, partials: tuple[jax.Array, ...],
                 sizes: tuple[int, ...]) -> tuple[jax.Array, ...]:
  """Sums over devices of several partials, units of ``sizes`` per leaf,
  with one all-reduce."""
  if not reduction.axis_names:
    return tuple(partials)
  k = len(partials)
  if not sizes:
    return tuple(reduction.sum(jnp.stack(partials)))
  combined = reduction.repeated(k).sum(jnp.concatenate(partials),
                                       tuple(sizes) * k)
  return tuple(jnp.split(combined, k))


def example_rows(leaves: Sequence[jax.Array]) -> list[jax.Array]:
  """Leaves with a leading batch axis as ``[batch, entries]`` rows: each
  example's entries of all leaves side by side, per dtype and per
  ``GROUP_SIZE`` leaves.

  A few reductions for the whole tree, which compile in a fraction of the
  time of one per leaf (measured on 250 leaves, the norms alone: 0.25 s
  against 1.45 s). Only for leaves off any mesh: rows would move split
  leaves between devices.
  """
  by_dtype: dict[Any, list[jax.Array]] = {}
  for x in leaves:
    # Sizes, not -1: with zero examples the entries per row are not implied.
    by_dtype.setdefault(x.dtype, []).append(
        x.reshape(x.shape[0], math.prod(x.shape[1:])))
  return [jnp.concatenate(rows[start:start + GROUP_SIZE], axis=1)
          for rows in by_dtype.values()
          for start in range(0, len(rows), GROUP_SIZE)]
