"""``measure``: what every transform asks of the core.

A transform says what it measures (a total, per leaf, per layer, per AGC
unit, per example: ``_kept``) and where the leaves live (``Where``), and
gets back a ``Measured``: the total, the vector of every unit's norm (of
all devices' units: statistics over it need no second all-reduce), and
any per-unit values (factors) laid back onto the leaves.
"""

import contextlib
import contextvars
import math
import string
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optaxclip import _tree, _validation
from optaxclip._core._batching import Grouped, example_rows, reduce
from optaxclip._core._kept import TOTAL, Kept
from optaxclip._core._mesh import (
  HERE,
  LOCAL,
  Keep,
  Reduction,
  Where,
  layout_spec,
  reduction,
  whole_on_auto_mesh,
  whole_shapes,
  without_leading_axis,
)
from optaxclip._core._norms import layout_for, norm_of_leaves, unit_norms, unit_rms
from optaxclip._core._sums import is_order, power, safe_root
from optaxclip._types import AxisName, Ord, PyTree, Scalar


class KnownNorm(NamedTuple):
  """A global norm measured upstream (by ``skip_step``,
  ``dynamic_loss_scale``), with the order, the mesh and the very leaves
  (the same tracers) it was taken of."""
  total: jax.Array
  p: float | jax.Array
  where: Where
  leaves: tuple[jax.Array, ...]

  def of(self, leaves: list[jax.Array], p, where: Where) -> bool:
    """Whether this is the ``p``-norm of exactly ``leaves``, on ``where``."""
    if isinstance(p, jax.Array) or isinstance(self.p, jax.Array):
      return False  # a traced order is never known to be the same
    return bool(p == self.p and where == self.where
                and len(leaves) == len(self.leaves)
                and all(a is b for a, b in zip(leaves, self.leaves)))


class Measured:
  """The ``p``-norms of a tree's clippable leaves, from one computation.

  Attributes:
    total: the norm of all leaves together (for a view with units, the norm
      of every unit's norm: the same partial sums, no second pass).
    units: every unit's norm, on all devices, in unit order (leaf by leaf,
      each leaf's kept entries in C order; where the mesh splits a leaf's
      kept axes, device by device, each device's block in C order:
      ``_joint`` lines them up): the same on every device.
    shapes: each clippable leaf's whole shape (before ``shard_map`` split
      it).
    split: whether some leaf's units are split over the mesh (each device
      then holds only its own units of that leaf).
  """

  def __init__(self, tree: PyTree, leaves: list[jax.Array], p, *,
               shapes: list[tuple[int, ...]], keep: tuple[Keep, ...] | None,
               reduction: Reduction, total: jax.Array | None = None,
               everywhere: Sequence[jax.Array] = (),
               here: Sequence[jax.Array] = (), where: Where = HERE):
    self._tree, self._leaves, self._p, self._where = tree, leaves, p, where
    self.shapes, self._keep, self._reduction = shapes, keep, reduction
    self._total, self._everywhere, self._here = total, list(everywhere), list(here)
    self.split = reduction.split_kept_axes is not None

  @property
  def total(self) -> jax.Array:
    if self._total is None:
      self._total = norm_of_leaves([self.units] if self._leaves else [], self._p)
    return self._total

  def known(self, tree: PyTree = None) -> "KnownNorm":
    """The total, with what it is the norm of, to pass on as
    ``update(..., grad_norm=...)``: a transform that would take the same
    norm of the same leaves uses it instead of reading them again.
    ``tree``: the leaves passed on instead, equal to the measured ones
    wherever the result counts (zeroed where a step is dropped)."""
    leaves = self._leaves if tree is None else _tree.clippable_leaves(tree)
    return KnownNorm(self.total, self._p, self._where, tuple(leaves))

  @property
  def units(self) -> jax.Array:
    return jnp.concatenate(self._everywhere or [jnp.zeros([0])])

  def per_leaf(self, values: jax.Array | None = None) -> list[jax.Array]:
    """``values`` (default: the norms), one per unit of every device, split
    per leaf."""
    if values is None:
      return self._everywhere
    starts = np.cumsum([0] + [part.size for part in self._everywhere])
    return [lax.slice_in_dim(values, int(a), int(b))
            for a, b in zip(starts[:-1], starts[1:])]

  def here(self) -> list[jax.Array]:
    """Per leaf, this device's units' norms, shaped as its kept axes."""
    return self._here

  def to_leaves(self, values: jax.Array) -> list[jax.Array]:
    """``values`` (one per unit of every device, as ``units``) laid onto
    the leaves: per leaf, this device's units, shaped to broadcast against
    it (a scalar for a leaf that is one unit)."""
    keep = self._keep or ((),) * len(self._leaves)
    if not any(keep):  # one unit per leaf: index the vector
      return [values[i] for i in range(len(self._leaves))]
    sizes = tuple(part.size for part in self._here)
    parts = self._reduction.local_parts(values, sizes)
    # Each leaf's factors whole on an Auto mesh: only the leaf's own layout
    # decides its update's.
    return [whole_on_auto_mesh(part.reshape(
        [d if a in kept else 1 for a, d in enumerate(x.shape)]))
            for part, x, kept in zip(parts, self._leaves, keep)]

  def tree(self, per_leaf: Sequence[jax.Array | None] | None = None) -> PyTree:
    """``per_leaf`` (default: ``here()``, one array per clippable leaf) in
    the tree's structure, None where a leaf is not clippable."""
    values = iter(self._here if per_leaf is None else per_leaf)
    leaves, treedef = jax.tree.flatten(self._tree)
    return treedef.unflatten([next(values) if _tree.is_clippable(x) else None
                              for x in leaves])

  def stack_norms(self) -> list[jax.Array | None]:
    """Per leaf with units (a stacked leaf), its whole norm: the norm of
    its units' norms (every device's); None for a leaf that is one unit.

    For statistics: from the largest unit norm and the others' ratios to
    it (a few ulps, no overflow), stacks of one length reduced together,
    without the rescue and derivative machinery of a norm of the leaves.
    """
    out: list[jax.Array | None] = [None] * len(self._everywhere)
    by_length: dict[int, list[int]] = {}
    for i, kept in enumerate(self._keep or ()):
      if kept:
        by_length.setdefault(self._everywhere[i].size, []).append(i)
    for members in by_length.values():
      totals = norms_of_rows(jnp.stack([self._everywhere[i] for i in members]),
                             self._p)
      for j, i in enumerate(members):
        out[i] = totals[j]
    return out

  def unit_shapes(self) -> list[tuple[int, ...]]:
    """Per leaf, the shape of its units on all devices together (its kept
    axes in its whole shape)."""
    keep = self._keep or ((),) * len(self._leaves)
    return [tuple(shape[a] for a in kept)
            for shape, kept in zip(self.shapes, keep)]

  def sum_over_examples(self, factors: jax.Array | list[jax.Array]
                        ) -> list[jax.Array]:
    """Per leaf of a per-example view, ``sum_i factors[i] * leaf[i]`` over
    its batch axis (per layer: ``factors[i, l]`` for layer ``l``), with
    ``factors`` one vector for all leaves or one array per leaf (as
    ``here()``)."""
    keep = self._keep or ((0,),) * len(self._leaves)
    return [sum_over_examples(
        factors if isinstance(factors, jax.Array) else factors[i], x,
        kept[1] - 1 if len(kept) > 1 else None)
            for i, (x, kept) in enumerate(zip(self._leaves, keep))]

  def entries_per_unit(self) -> list[float]:
    """Per leaf, how many entries one of its units has, over all devices
    that split them (not those that split its units: each holds others)."""
    keep = self._keep or ((),) * len(self._leaves)
    return [float(self._reduction.whole_count(
        i, int(np.prod([d for a, d in enumerate(x.shape) if a not in kept]))))
            for i, (x, kept) in enumerate(zip(self._leaves, keep))]


def norms_of_rows(rows: jax.Array, p) -> jax.Array:
  """The ``p``-norm of each row of a matrix of norms (finite, NaN or Inf),
  as ``largest * norm(row / largest)``: the scaled powers cannot overflow.
  A row of no norms (a stack of zero layers) has norm 0, for every order."""
  if rows.shape[1] == 0:  # max has no identity: the norm of nothing is 0
    return jnp.zeros(rows.shape[:1], rows.dtype)
  peak = jnp.max(rows, axis=1)
  if is_order(p, math.inf):
    return peak
  usable = (peak > 0) & (peak < jnp.inf)
  scaled = rows / jnp.where(usable, peak, 1)[:, None]
  roots = safe_root(jnp.sum(power(scaled, p), axis=1), p)
  return jnp.where(usable, roots * peak, peak)  # 0, Inf or NaN as they are


def _units(leaves, p, red: Reduction, keep, *, rms: bool = False
           ) -> tuple[list, list]:
  """Every device's and this device's unit norms (or RMSs), per leaf."""
  combined = (unit_rms if rms else unit_norms)(leaves, p, red, keep)
  sizes = tuple(int(np.prod([x.shape[a] for a in kept]))
                for x, kept in zip(leaves, keep))
  counts = red.unit_counts(sizes)
  starts = np.cumsum((0,) + counts)
  everywhere = [lax.slice_in_dim(combined, int(start), int(start) + count)
                for start, count in zip(starts, counts)]
  here = [part.reshape([x.shape[a] for a in kept]) for part, x, kept in
          zip(red.local_parts(combined, sizes), leaves, keep)]
  return everywhere, here


def measure(fn: str, tree: PyTree, p, where: Where = HERE,
            kept: Kept = TOTAL, *, given: "KnownNorm | Scalar | None" = None,
            rms: bool = False) -> Measured:
  """The ``p``-norms of ``tree``'s clippable leaves that ``kept`` asks for
  (``fn`` names the caller in errors).

  ``given`` (a total only): a norm measured upstream (``KnownNorm``, used
  when it is of these very leaves, else they are measured), or a number a
  user measured (``update(..., grad_norm=...)``: trusted as this norm).
  ``rms`` (units, ``p = 2``): each unit's root mean square instead of its
  norm, over its entries on all devices, finite where the norm overflows.
  """
  leaves = _tree.clippable_leaves(tree)
  shapes = whole_shapes(fn, tree, where)
  keep = None if kept is TOTAL else kept.axes(fn, tree, shapes)
  if kept.across_leaves:
    return _across_leaves(fn, tree, leaves, p, where, shapes)
  red = reduction(fn, tree, where, keep)
  common = {"shapes": shapes, "reduction": red, "where": where}
  if keep is None:
    total = _given_total(fn, given, leaves, p, where)
    if total is None:
      total = norm_of_leaves(leaves, p, red)
    return Measured(tree, leaves, p, keep=None, total=total, **common)
  everywhere, here = _units(leaves, p, red, keep, rms=rms)
  return Measured(tree, leaves, p, keep=keep, everywhere=everywhere,
                  here=here, **common)


_SHARED: contextvars.ContextVar[tuple[KnownNorm, ...]] = contextvars.ContextVar(
    "optaxclip_shared_norms", default=())


@contextlib.contextmanager
def sharing(known: KnownNorm) -> Iterator[None]:
  """While inside, a ``measure`` of the very leaves ``known`` was taken of
  (the same tracers, order and mesh) takes its total instead of reading
  them again: how ``skip_step`` and ``dynamic_loss_scale`` hand their norm
  to the clipper inside them, whatever that inner transform's signature.
  Any other leaves are measured as usual."""
  token = _SHARED.set(_SHARED.get() + (known,))
  try:
    yield
  finally:
    _SHARED.reset(token)


def _given_total(fn: str, given, leaves: list[jax.Array], p,
                 where: Where) -> jax.Array | None:
  """The total from ``given`` or from a norm shared upstream, or None:
  measure."""
  if given is None:
    return next((known.total for known in _SHARED.get()
                 if known.of(leaves, p, where)), None)
  if isinstance(given, KnownNorm):
    return given.total if given.of(leaves, p, where) else None
  norm = _validation.scalar(fn, "grad_norm", given)
  return jnp.asarray(norm, _tree.accumulation_dtype(leaves))


def measure_pair(fn: str, tree: PyTree, alongside: list[jax.Array], p,
                 where: Where, kept: Kept) -> tuple[Measured, Measured]:
  """``measure`` of ``tree`` and of ``alongside`` (AGC's parameters: one
  array per clippable leaf, of its shape and layout) in the same pass: one
  all-reduce, one rescue decision."""
  leaves = _tree.clippable_leaves(tree)
  shapes = whole_shapes(fn, tree, where)
  keep = kept.axes(fn, tree, shapes) or ((),) * len(leaves)
  red = reduction(fn, tree, where, keep)
  everywhere, here = _units(leaves + alongside, p, red.repeated(2), keep * 2)
  n = len(leaves)
  first, second = (Measured(tree, leaves, p, shapes=shapes, keep=keep,
                            reduction=red, everywhere=everywhere[part],
                            here=here[part], where=where)
                   for part in (slice(0, n), slice(n, 2 * n)))
  return first, second


def _across_leaves(fn, tree, leaves, p, where: Where, shapes) -> Measured:
  """One norm per example (a leading batch axis) of all leaves together."""
  rows, rows_tree = leaves, tree
  if not where.axis_names and all(layout_spec(x) is None for x in leaves):
    rows = rows_tree = example_rows(leaves)  # a few rows for all leaves
  keep = ((0,),) * len(rows)
  red = reduction(fn, rows_tree, where, keep)
  everywhere, here = _units(rows, p, red, keep)
  if len(here) > 1:  # the norm over leaves of each example's leaf norms
    here = [unit_norms([jnp.stack(here)], p, LOCAL, ((1,),))]
  return Measured(tree, leaves, p, shapes=shapes,
                  keep=((0,),) * len(leaves), reduction=red,
                  everywhere=everywhere, here=here, where=where)


def norm_of(vectors: list[jax.Array], p) -> jax.Array:
  """The ``p``-norm of some vectors of norms together (a norm of norms:
  groups, totals from per-unit norms), overflow-safe as any norm."""
  return norm_of_leaves(vectors, p, LOCAL)


def unit_shapes(fn: str, tree: PyTree, kept: Kept) -> list[tuple[int, ...]]:
  """Per clippable leaf of ``tree``, the shape of its units' norms (its
  kept axes), without measuring: a state's shapes at ``init``."""
  leaves = _tree.clippable_leaves(tree)
  keep = kept.axes(fn, tree, [tuple(np.shape(x)) for x in leaves])
  keep = keep or ((),) * len(leaves)
  return [tuple(np.shape(x)[a] for a in k) for x, k in zip(leaves, keep)]


def global_norm(tree: PyTree, ord: Ord = 2, *, axis_name: AxisName = None,
                specs: PyTree = None) -> jax.Array:
  """The ``ord``-norm of all floating leaves of ``tree`` taken together.

  Integer, boolean, ``None`` and ``optax.MaskedNode`` leaves are left out.
  The result is float32 (float64 when x64 is on and a leaf is float64),
  computed from float32 partial sums whatever the leaf dtype, and correct for
  finite leaves of any magnitude: no overflow to ``inf``, no underflow to 0,
  subnormal entries included (a norm below the normal range, ~1.2e-38 in
  float32, is returned as that subnormal number; hardware that flushes
  subnormals, as XLA:CPU does, reads it as 0 in later arithmetic, and there
  the ``inf``-norm of entries all below that range is 0). A NaN or Inf entry
  gives a NaN or Inf norm for every ``ord``. Gradients are finite and right
  wherever the norm is finite, and 0 at zero.

  Args:
    tree: a pytree of arrays (for instance gradients).
    ord: the norm order: any number ``p > 0`` or ``inf`` (``"inf"`` too);
      traced (inside ``jit``), one that is not > 0 acts as 2.
    axis_name: under ``shard_map``/``pmap``, the mesh axis name (or tuple of
      names) the leaves are split over; the norm is then that of the whole,
      unsplit tree, computed with one all-reduce
      ([docs/distributed.md](../distributed.md)).
    specs: with ``axis_name``, the ``PartitionSpec`` of each leaf (a tree
      prefix, as given to ``shard_map``'s ``in_specs``). Leaves replicated on
      an axis are counted once. ``None`` treats every leaf as split.

  Returns:
    A scalar array: the norm.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> grads = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([1.0, 2.0])}
    >>> oc.functional.global_norm(grads)
    Array(5.477226, dtype=float32)
    >>> oc.functional.global_norm(grads, ord="inf")
    Array(4., dtype=float32)
    >>> oc.functional.global_norm([jnp.full(10, 1e20)])  # no overflow
    Array(3.1622778e+20, dtype=float32)
    >>> oc.functional.global_norm([jnp.full(100, 1e-39)])  # subnormal entries
    Array(1.e-38, dtype=float32)
    >>> oc.functional.global_norm({"w": jnp.array([1.0, jnp.nan])}, ord=0.5)
    Array(nan, dtype=float32)
  """
  fn = "global_norm"
  p = _validation.check_ord(fn, ord)
  where = Where.of(fn, axis_name, specs)
  _validation.check_tree(fn, "tree", tree)
  return measure(fn, tree, p, where).total


def all_finite(tree: PyTree, *, axis_name: AxisName = None) -> jax.Array:
  """Whether every floating leaf of ``tree`` is free of NaN and Inf.

  Args:
    tree: a pytree of arrays.
    axis_name: under ``shard_map``/``pmap``, the axis name(s) to agree over:
      the answer is then the same on every device.

  Returns:
    A boolean scalar array (True for an empty tree).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> oc.functional.all_finite({"a": jnp.ones(3), "b": jnp.array([jnp.nan])})
    Array(False, dtype=bool)
  """
  where = Where.of("all_finite", axis_name)
  _validation.check_tree("all_finite", "tree", tree)
  leaves = _tree.clippable_leaves(tree)
  if not leaves:
    return jnp.bool_(True)
  # Whether any entry is NaN or infinite: a total, its leaves grouped as the
  # platform groups a norm's (a stack would be a copy on a TPU).
  grouped = Grouped(leaves, layout=layout_for(leaves), merge=True)
  local = ~reduce(grouped, lambda x, _: ~jnp.isfinite(x), LOCAL, maximum=True,
                  total=True, initial=False)
  if not where.axis_names:
    return local
  return lax.pmin(local.astype(jnp.int32), where.axis_names).astype(jnp.bool_)


def sum_over_examples(factors: jax.Array, x: jax.Array,
                      axis: int | None = None) -> jax.Array:
  """``sum_i factors[i] * x[i]`` over a leading batch axis, or with a layer
  ``axis`` (of one example's gradient) ``sum_i factors[i, l] * x[i, ..., l,
  ...]``, accumulated in float32 at least, in ``x``'s dtype. The sum keeps
  ``x``'s layout over its other axes: each device sums its own part."""
  acc = jnp.promote_types(x.dtype, factors.dtype)
  entries = string.ascii_letters[1:x.ndim]  # one example's axes
  weights = "a" if axis is None else "a" + entries[axis]
  total = jnp.einsum(f"{weights},a{entries}->{entries}",
                     whole_on_auto_mesh(factors.astype(acc)), x,
                     precision=lax.Precision.HIGHEST,
                     preferred_element_type=acc,
                     out_sharding=without_leading_axis(x))
  return total.astype(x.dtype)
