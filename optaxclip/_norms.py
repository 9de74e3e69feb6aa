"""The one norm implementation every clipper uses.

``p``-norms are ``(sum |x|**p) ** (1/p)`` of absolute values, and ``inf`` is
``max |x|``; complex leaves use ``|x|``. Each leaf is reduced to one partial
value (its power sum, or its max) in float32 at least, whatever its dtype:
squares of fp16 overflow above 256 and bf16 squares would keep 8 bits. The
partials of all leaves travel together, so a distributed norm costs one
all-reduce of a small vector per step.

The plain power sum overflows float32 for |x| above ~1.8e19 (squares) and
loses everything below ~1e-19 (squares flush to zero); hardware that flushes
subnormal numbers (XLA:CPU does) reads an entry below ~1.2e-38 as 0 in any
arithmetic. Only then, decided at run time by ``lax.cond``, a second pass
sums rescaled values, reading subnormal entries from their bits and writing
a subnormal norm from its bits. For ``p = 1`` and ``p = 2`` the scale is a
fixed power of two, chosen by which end failed, so the rescue is one more
pass and nothing else; other orders first find the largest |x| and rescale
by the power of two just above it. Sums of ``|x|`` overflow only when the
norm itself does, and maxima (``inf``) need no rescue: their only limit is
that the largest of entries all below the normal range reads as 0 where
subnormals are flushed, as it would in any later arithmetic. Finite input
therefore gives the right finite norm, and ordinary input pays nothing for
the safety net; a NaN or Inf anywhere gives a NaN or Inf norm, for every
order.

Gradients follow the formula ``d norm = sum sign(x) (|x| / norm)**(p - 1)
dx`` (for ``inf``: at the largest |x|, ties sharing), computed with the same
exact scaling: finite and right wherever the norm is finite, 0 at 0.
Differentiating the computation itself would meet the infinite derivative
of an overflowed plain sum in the branch not taken.
"""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from optaxclip import _tree, _validation

PyTree = Any


class Reduction(NamedTuple):
  """Combines per-leaf partials across the devices of ``axis_names``.

  Under ``shard_map``/``pmap`` each device holds a shard of every split leaf,
  so partial sums are added over the named axes. A leaf that ``specs`` marks
  as replicated on some axis holds the same values on each device of that
  axis: only the device at index 0 of such an axis contributes, so the leaf
  is counted once. All leaves then share one ``psum``: one all-reduce.
  Hashable, so compiled norms are cached per reduction.
  """
  axis_names: tuple[Any, ...]
  replicated_axes: tuple[tuple[Any, ...], ...] | None = None  # per leaf;
  #                                               None: every leaf is split
  batch_axis: Any = None  # the vmap axis of per-example norms, if any

  def decide(self, needed: jax.Array) -> jax.Array:
    """Whether any norm needs the rescue: one answer for the whole batch.

    Under ``vmap`` a per-example answer would make ``lax.cond`` a select
    that runs the rescue for every example; one answer over ``batch_axis``
    keeps it a branch, taken only when some example needs it.
    """
    needed = jnp.any(needed)
    if self.batch_axis is None:
      return needed
    return lax.pmax(needed.astype(jnp.int32), self.batch_axis) > 0

  def sum(self, partials: jax.Array) -> jax.Array:
    if not self.axis_names:
      return partials
    if self.replicated_axes is not None:
      partials = partials * self._first_copy_mask(partials.dtype)
    return lax.psum(partials, self.axis_names)

  def max(self, partials: jax.Array) -> jax.Array:
    # Replicated leaves need no mask: max ignores repeated values.
    return lax.pmax(partials, self.axis_names) if self.axis_names else partials

  def device_count(self) -> int:
    return lax.psum(1, self.axis_names) if self.axis_names else 1

  def _first_copy_mask(self, dtype) -> jax.Array:
    assert self.replicated_axes is not None
    masks = []
    for axes in self.replicated_axes:
      is_first = jnp.bool_(True)
      for axis in axes:
        is_first = is_first & (lax.axis_index(axis) == 0)
      masks.append(is_first)
    return jnp.stack(masks).astype(dtype)


LOCAL = Reduction(())
# The vmap axis name per-example norms run under (``Reduction.batch_axis``).
EXAMPLES = "optaxclip_examples"


# XLA's cost analysis counts both sides of the rescue's ``lax.cond``, though
# the rescue runs only when the plain sums fail: benchmarks/ (and
# tests/test_traffic.py) measure its share with a build that leaves it out
# (False). Never False in a program that trains.
BUILD_RESCUE = True


def _spec_axes(spec: jax.sharding.PartitionSpec) -> set[Any]:
  """The mesh axes a PartitionSpec splits an array over."""
  axes = set()
  for entry in spec:
    if entry is None:
      continue
    axes.update(entry if isinstance(entry, tuple) else (entry,))
  return axes


def _is_spec(x: Any) -> bool:
  return x is None or isinstance(x, jax.sharding.PartitionSpec)


def _leaf_specs(fn: str, tree: PyTree, specs: PyTree) -> list[Any]:
  """One PartitionSpec per leaf of ``tree`` (``specs`` is a tree prefix)."""
  def broadcast(spec, subtree):
    if not _is_spec(spec):
      raise TypeError(
          f"`{fn}(specs=...)` must hold PartitionSpecs (or None), got "
          f"{spec!r} of type {type(spec).__name__}")
    spec = jax.sharding.PartitionSpec() if spec is None else spec
    return jax.tree.map(lambda _: spec, subtree)

  try:
    leaf_specs = jax.tree.map(broadcast, specs, tree, is_leaf=_is_spec)
  except ValueError as error:
    raise ValueError(
        f"`{fn}(specs=...)` must be a PartitionSpec or a tree prefix of the "
        f"gradients with PartitionSpec leaves (as shard_map's in_specs); "
        f"it does not match the gradient tree: {error}") from None
  return jax.tree.leaves(
      leaf_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def clippable_leaf_specs(fn: str, tree: PyTree, specs: PyTree) -> list[Any]:
  """The PartitionSpec of every clippable leaf (None each when no specs)."""
  if specs is None:
    return [None] * len(_tree.clippable_leaves(tree))
  return [spec for spec, leaf in zip(_leaf_specs(fn, tree, specs),
                                     jax.tree.leaves(tree))
          if _tree.is_clippable(leaf)]


def make_reduction(fn: str, tree: PyTree, axis_name: Any,
                   specs: PyTree) -> Reduction:
  """The reduction for ``tree``'s clippable leaves given the user's options."""
  axis_names = _validation.check_axis_name(fn, axis_name)
  if specs is None:
    return Reduction(axis_names)
  if not axis_names:
    raise ValueError(
        f"`{fn}(specs=...)` needs `axis_name`: specs say how leaves are split "
        f"over the named axes of shard_map/pmap")
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  replicated = []
  for (path, leaf), spec in zip(with_paths, _leaf_specs(fn, tree, specs)):
    if not _tree.is_clippable(leaf):
      continue
    split = _spec_axes(spec)
    if split - set(axis_names):
      raise ValueError(
          f"`{fn}(specs=...)` splits leaf {jax.tree_util.keystr(path)} over "
          f"mesh axes {sorted(map(str, split - set(axis_names)))} that are not "
          f"in axis_name={axis_name!r}: its norm would differ per device. Add "
          f"them to axis_name")
    replicated.append(tuple(a for a in axis_names if a not in split))
  return Reduction(axis_names, tuple(replicated))


def _is_order(p: Any, value: float) -> bool:
  """Whether the norm order is statically ``value`` (a traced order never is)."""
  return not isinstance(p, jax.Array) and p == value


def _integer_power(p: Any) -> int | None:
  if isinstance(p, jax.Array) or not float(p).is_integer() or p > 64:
    return None
  return int(p)


def magnitude(x: jax.Array, acc: jnp.dtype) -> jax.Array:
  """``|x|`` in ``acc``; a complex leaf's in its own precision (no upcast)."""
  return jnp.abs(x).astype(acc) if jnp.iscomplexobj(x) else jnp.abs(x.astype(acc))


def _pow(a: jax.Array, p: Any, *, nonzero: jax.Array | None = None
         ) -> jax.Array:
  """``a ** p`` for ``a >= 0``; NaN stays NaN.

  The generic path (``p < 1`` or a traced ``p``) masks ``a > 0`` so that the
  power of 0 needs no ``log(0)``. Given ``nonzero`` (whether ``a`` is not 0,
  read from its bits), an ``a`` that is not 0 but reads as 0 (a subnormal,
  on hardware that flushes them, as XLA:CPU does) gives ``inf``: for ``p < 1`` its power is a
  normal number that would be lost, and an infinite sum sends the norm to
  the rescue, which reads it exactly. (For ``p >= 1`` such a power is below
  the precision floor, which sends small sums to the rescue anyway.)
  """
  k = _integer_power(p)
  if k is not None:
    return lax.integer_pow(a, k)  # exact-ish multiplies, no exp/log
  if not isinstance(p, jax.Array) and p > 1:
    return a ** p
  positive = a > 0
  other = a  # 0, NaN, or a subnormal that reads as 0
  if nonzero is not None:
    other = jnp.where(nonzero & (a == a), jnp.inf, a)
  return jnp.where(positive, jnp.where(positive, a, 1) ** p, other)


def safe_root(s: jax.Array, p: float | jax.Array) -> jax.Array:
  """``s ** (1/p)`` for ``s >= 0`` (NaN stays NaN), finite gradient at 0;
  ``s`` itself for ``p = inf`` (``s`` is then a maximum)."""
  if _is_order(p, 1) or _is_order(p, math.inf):
    return s
  positive = s > 0
  safe = jnp.where(positive, s, 1)
  root = jnp.sqrt(safe) if _is_order(p, 2) else safe ** (1 / p)
  return jnp.where(positive, root, s)  # s itself for 0 and NaN


# Leaves up to this many elements are stacked with the others of their shape
# and dtype and reduced together: one fusion per group instead of one per
# leaf keeps compile time flat in the number of leaves. Larger leaves reduce
# on their own, so run time never pays for copying them.
GROUP_LIMIT = 1 << 15
# At most this many leaves per group. XLA's cost of compiling one
# concatenation grows faster than its operand count beyond a few hundred,
# and separate groups compile in parallel: with 2000 leaves, groups of 256
# compile in half the time one group of all of them takes (benchmarks/,
# compile target).
GROUP_SIZE = 256


def _layout(x: jax.Array) -> Any:
  """What two leaves must share to be stacked without moving data.

  Unsharded leaves share everything; on an Explicit mesh, leaves with the
  same PartitionSpec do. On an Auto mesh the sharding is unknown while
  tracing (the compiler picks it): such leaves reduce alone (None), since
  stacking differently sharded leaves would make XLA move them.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if sharding is None or mesh is None or mesh.empty:
    return ()
  if any(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return None
  return mesh, sharding.spec


def _plan(leaves: list[jax.Array], *,
          merge: bool = False) -> list[tuple[bool, list[int]]]:
  """Which leaves ``_groups`` puts together: ``(flat, rows)`` per group."""
  by_key: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    layout = _layout(x)
    if x.size > GROUP_LIMIT or layout is None:
      key = i
    elif merge and layout == ():
      key = ("flat", x.dtype)
    else:
      key = (x.shape, x.dtype, layout)
    by_key.setdefault(key, []).append(i)
  return [(isinstance(key, tuple) and key[0] == "flat",
           all_rows[start:start + GROUP_SIZE])
          for key, all_rows in by_key.items()
          for start in range(0, len(all_rows), GROUP_SIZE)]


def _groups(leaves: list[jax.Array], *, merge: bool = False,
            plan: list[tuple[bool, list[int]]] | None = None
            ) -> list[tuple[Any, jax.Array]]:
  """The leaves as ``(index, leaf)`` or ``(indices, stack of leaves)``.

  Small leaves of the same shape, dtype and sharding are stacked, once: the
  plain pass and the rare rescue pass both read these groups, so the rescue
  adds no copy of the stacking to the program. With ``merge`` (a global norm
  that needs no per-leaf partials), small unsharded leaves of one dtype are
  concatenated whatever their shapes, as ``(None, flat vector)``: one
  reduction per ``GROUP_SIZE`` leaves. ``plan`` groups other arrays (the
  tangents of the leaves) exactly as the leaves were.
  """
  plan = _plan(leaves, merge=merge) if plan is None else plan
  return [_group([leaves[i] for i in rows], rows, flat=flat)
          for flat, rows in plan]


def _group(members: list[jax.Array], rows: list[int], *,
           flat: bool) -> tuple[Any, jax.Array]:
  if len(members) == 1:
    return rows[0], members[0]
  if flat:
    # lax, not jnp, and no reshape of vectors: this runs once per leaf, and
    # tracing time is part of the compile time of trees with many leaves.
    return None, lax.concatenate(
        [x if x.ndim == 1 else lax.reshape(x, (x.size,)) for x in members], 0)
  return np.asarray(rows), jnp.stack(members)


def _take(vector: jax.Array, indices) -> jax.Array:
  """``vector[indices]`` for static in-bounds indices: a bare gather."""
  return vector.at[np.asarray(indices)].get(mode="promise_in_bounds",
                                            unique_indices=True)


def _per_leaf(groups, elementwise, reduce) -> jax.Array:
  """``reduce(elementwise(x, rows))`` of every leaf, as a vector in leaf order.

  ``elementwise`` gets a leaf (or a stack of leaves) and its index (or the
  array of their indices), to pick per-leaf factors. A merged group (rows
  None) gives one value for all its leaves: the vector is then per group,
  fit for a total only.
  """
  pieces, order = [], []
  for rows, values in groups:
    values = elementwise(values, rows)
    if rows is None or np.ndim(rows) == 0:
      pieces.append(reduce(values)[None])
      order.append(-1 if rows is None else rows)
    else:
      # Reduced over the leaf axes as they are: a reshape of a sharded
      # stack would be a resharding.
      pieces.append(reduce(values, axis=tuple(range(1, values.ndim))))
      order.extend(rows)
  vector = jnp.concatenate(pieces)
  if -1 not in order and order != sorted(order):
    vector = _take(vector, np.argsort(order))
  return vector


def _factor_for(factors: jax.Array, rows, ndim: int) -> jax.Array:
  """The factor of a leaf or stack: shared (a scalar) or ``factors[rows]``."""
  if factors.ndim == 0:
    return factors
  if np.ndim(rows) == 0:
    return factors[rows]
  return _take(factors, rows).reshape((-1,) + (1,) * (ndim - 1))


def _elementwise_power(x: jax.Array, p: Any, acc: jnp.dtype) -> jax.Array:
  """``|x| ** p`` in ``acc`` (``|x|`` for ``inf``), without a sqrt for p=2."""
  if _is_order(p, math.inf):
    return magnitude(x, acc)
  if _is_order(p, 2) and not jnp.iscomplexobj(x):
    y = x.astype(acc)
    return y * y
  if _is_order(p, 2):
    re, im = jnp.real(x).astype(acc), jnp.imag(x).astype(acc)
    return re * re + im * im
  if jnp.iscomplexobj(x):
    nonzero = _nonzero_bits(x.real.astype(acc)) | _nonzero_bits(
        x.imag.astype(acc))
  else:
    nonzero = _nonzero_bits(x.astype(acc))
  return _pow(magnitude(x, acc), p, nonzero=nonzero)


def _reduce_leaves(groups, elementwise, reduction: Reduction, *,
                   maximum: bool, total: bool, initial: float = 0) -> jax.Array:
  """Sums (or maxima, at least ``initial``) of ``elementwise(x, rows)`` per
  leaf over all devices of ``reduction``, as a vector in leaf order; with
  ``total``, of all leaves together, as a scalar.
  """
  reduce = functools.partial(jnp.max, initial=initial) if maximum else jnp.sum
  across = reduction.max if maximum else reduction.sum
  if total and reduction.replicated_axes is None:
    # Each group reduces to a scalar and these combine by scalar ops: no
    # small vector is reduced (XLA:CPU compiles each small reduction as a
    # costly kernel of its own), and the devices share one all-reduce.
    combine = jnp.maximum if maximum else jnp.add
    return across(functools.reduce(
        combine, [reduce(elementwise(values, rows)) for rows, values in groups]))
  partials = across(_per_leaf(groups, elementwise, reduce))
  if not total:
    return partials
  return jnp.max(partials) if maximum else jnp.sum(partials)


def _power_sums(groups, p, acc, reduction: Reduction, *,
                total: bool = False) -> jax.Array:
  return _reduce_leaves(groups, lambda x, rows: _elementwise_power(x, p, acc),
                        reduction, maximum=_is_order(p, math.inf), total=total)


# Exact scaling by powers of two. Hardware that flushes subnormal floats to
# zero (XLA:CPU does) reads one as 0 in any arithmetic: multiplying it by
# 2**100 gives 0. The rescue passes therefore read a subnormal from its bits
# (its mantissa, an integer, times the weight of its last bit) and write a
# subnormal result from its bits; everything else is plain multiplication.


def _integer_type(dtype) -> Any:
  return jnp.int64 if jnp.finfo(dtype).bits == 64 else jnp.int32


def _bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x, _integer_type(x.dtype))


def _magnitude_bits(y: jax.Array) -> jax.Array:
  """The bits of ``|y|`` for real ``y``, by clearing the sign bit."""
  return _bits(y) & ((1 << (jnp.finfo(y.dtype).bits - 1)) - 1)


def _nonzero_bits(y: jax.Array) -> jax.Array:
  """Whether real ``y`` is not ``±0``, read from its bits.

  The mantissa is tested on its own: LLVM folds an integer test of all of
  ``|y|``'s bits into a float comparison, which reads a subnormal as 0.
  """
  info = jnp.finfo(y.dtype)
  bits = _magnitude_bits(y)
  return (bits >= (1 << info.nmant)) | ((bits & ((1 << info.nmant) - 1)) != 0)


def _power_of_two(exponent: jax.Array, dtype) -> jax.Array:
  """``2 ** exponent`` from its bits, for ``minexp <= exponent < maxexp``."""
  info = jnp.finfo(dtype)
  biased = exponent.astype(_integer_type(dtype)) + (info.maxexp - 1)
  return lax.bitcast_convert_type(biased << info.nmant, dtype)


def _power_of_two_halves(exponent: jax.Array,
                         dtype) -> tuple[jax.Array, jax.Array]:
  """Two normal floats whose product is ``2 ** exponent``, built from bits.

  XLA multiplies by the reciprocal when dividing by a scalar, and the
  reciprocal of a huge maximum (above 2**126) is subnormal, flushed to zero.
  Two power-of-two factors stay normal over the whole float range and
  multiply exactly; setting their exponent bits costs two ops where
  ``jnp.ldexp`` costs twenty.
  """
  exponent = exponent.astype(_integer_type(dtype))
  half = exponent >> 1  # floor(exponent / 2): a shift, where // costs ten ops
  return _power_of_two(half, dtype), _power_of_two(exponent - half, dtype)


def times_power_of_two(x: jax.Array, exponent: jax.Array) -> jax.Array:
  """``x * 2**exponent``, exactly, over the whole range of the float."""
  low, high = _power_of_two_halves(exponent, x.dtype)
  return x * low * high


def _exponent(bits: jax.Array, dtype) -> jax.Array:
  """``frexp``'s exponent of the float ``>= 0`` with these bits.

  Exact for subnormals too, where ``jnp.frexp`` (arithmetic on them) fails
  on hardware that flushes them.
  """
  info = jnp.finfo(dtype)
  field = bits >> info.nmant
  top_bit = (info.bits - 1) - lax.clz(bits)  # of a subnormal's mantissa
  return jnp.where(field > 0, field + info.minexp,
                   top_bit + info.minexp - info.nmant + 1)


class _Scale(NamedTuple):
  """Multiplies magnitudes by ``2 ** exponent`` (one per leaf, or shared).

  Exact wherever the result is a normal float, subnormal magnitudes
  included: those are rebuilt from their bits, their mantissa (an integer)
  times ``last_bit``, the scaled weight of their last bit, a normal float
  (0 where the result would be below the normal range, negligible there).
  No constant here is subnormal: hardware that flushes subnormals reads one
  as 0, and XLA folds constants together.
  """
  factors: tuple[jax.Array, ...]  # normal floats; their product is 2**exponent
  last_bit: jax.Array

  @classmethod
  def by(cls, exponent: jax.Array, dtype) -> "_Scale":
    """The scale for any exponent in the float's range."""
    info = jnp.finfo(dtype)
    last = exponent + info.minexp - info.nmant
    last_bit = jnp.where(
        last >= info.minexp,
        _power_of_two(jnp.clip(last, info.minexp, info.maxexp - 1), dtype), 0)
    return cls(_power_of_two_halves(exponent, dtype), last_bit)

  def rows(self, rows, ndim: int) -> "_Scale":
    """The factors of a leaf or a stack of leaves, shaped to broadcast."""
    return _Scale(tuple(_factor_for(f, rows, ndim) for f in self.factors),
                  _factor_for(self.last_bit, rows, ndim))

  def apply(self, y: jax.Array) -> jax.Array:
    """``|y| * 2**exponent`` for real ``y``."""
    bits = _magnitude_bits(y)
    return jnp.where(bits < (1 << jnp.finfo(y.dtype).nmant),
                     bits.astype(y.dtype) * self.last_bit,
                     functools.reduce(jnp.multiply, self.factors, jnp.abs(y)))

  def parts(self, x: jax.Array, acc) -> list[jax.Array]:
    """The scaled ``|x|``, or for a complex ``x`` its scaled ``|re|, |im|``."""
    if jnp.iscomplexobj(x):
      return [self.apply(part.astype(acc)) for part in (jnp.real(x), jnp.imag(x))]
    return [self.apply(x.astype(acc))]

  def magnitude(self, x: jax.Array, acc) -> jax.Array:
    parts = self.parts(x, acc)
    return parts[0] if len(parts) == 1 else jnp.abs(lax.complex(*parts))

  def square(self, x: jax.Array, acc) -> jax.Array:
    parts = self.parts(x, acc)
    return functools.reduce(jnp.add, [y * y for y in parts])


def _unscaled(r: jax.Array, exponent: Any) -> jax.Array:
  """``r * 2**exponent`` for ``r >= 0``, exact, subnormal results included.

  A result below the normal range is written from its bits: its mantissa
  is ``r * 2**(exponent - minexp + nmant)`` rounded to an integer (as the
  multiplication itself rounds where subnormals are kept). A static
  ``exponent`` (an int) makes both factors constants.
  """
  info = jnp.finfo(r.dtype)
  shift = exponent - info.minexp + info.nmant
  if isinstance(exponent, int):
    normal, mantissa = r * 2.0 ** exponent, r * 2.0 ** shift
  else:
    normal = times_power_of_two(r, exponent)
    mantissa = times_power_of_two(r, jnp.minimum(shift, 2 * info.maxexp - 2))
  mantissa = jnp.round(mantissa)
  fits = mantissa <= 2.0 ** info.nmant
  subnormal = lax.bitcast_convert_type(
      jnp.where(fits, mantissa, 0).astype(_integer_type(r.dtype)), r.dtype)
  return jnp.where(fits, subnormal, normal)


def _max_code(x: jax.Array, acc) -> jax.Array:
  """A float whose maximum over a leaf tells its largest ``|x|`` exactly.

  ``|x|`` where normal; a subnormal's bits minus ``2**nmant`` (a value in
  ``[-2**nmant, 0)``, exact) where not. Max reductions of floats stay fast
  where integer ones are slow (XLA:CPU). For complex ``x``, the larger of
  ``|re|, |im|``: within a factor ``sqrt(2)`` of ``|x|``.
  """
  if jnp.iscomplexobj(x):
    return jnp.maximum(*(_max_code(part, acc)
                         for part in (jnp.real(x), jnp.imag(x))))
  y = x.astype(acc)
  bits = _magnitude_bits(y)
  subnormal = 2 ** jnp.finfo(acc).nmant
  return jnp.where(bits < subnormal, bits.astype(acc) - subnormal, jnp.abs(y))


def _exact_maxima(groups, acc, reduction: Reduction, *, total: bool
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(usable, exponent, peak)`` of each leaf's (or all leaves') largest
  ``|x|`` (of a complex leaf: its largest real or imaginary part).

  ``peak`` is exact, subnormal or not; ``exponent`` is its ``frexp``
  exponent where ``usable`` (finite and not 0), else 0.
  """
  offset = 2 ** jnp.finfo(acc).nmant
  codes = _reduce_leaves(groups, lambda x, rows: _max_code(x, acc), reduction,
                         maximum=True, total=total, initial=-offset)
  subnormal = codes <= 0
  bits = jnp.where(subnormal,
                   (jnp.where(subnormal, codes, 0) + offset).astype(
                       _integer_type(acc)), _bits(codes))
  usable = (bits > 0) & (bits < _bits(jnp.asarray(jnp.inf, acc)))
  exponent = jnp.where(usable, _exponent(bits, acc), 0)
  return usable, exponent, lax.bitcast_convert_type(bits, acc)


def _precision_floor(leaves, acc, reduction: Reduction) -> jax.Array:
  """Power sums below this may have lost terms to underflow.

  Each flushed term loses at most ``tiny``; with ``n`` terms a sum above
  ``n * tiny / eps`` is still accurate to float precision.
  """
  info = jnp.finfo(acc)
  count = sum(x.size for x in leaves) * reduction.device_count()
  return jnp.asarray(float(info.tiny) / float(info.eps), acc) * count


def _needs_rescue(sums, floor) -> jax.Array:
  # Inf and NaN fail both comparisons; the rescue then propagates them.
  return ~((sums >= floor) & (sums < jnp.inf))


def _rescued_by_fixed_scale(groups, p, acc, reduction, sums, floor, *,
                            total: bool) -> jax.Array:
  """``p`` in ``{1, 2}``: the plain pass redone scaled by a fixed power of
  two, where it underflowed (or, for ``p = 2``, overflowed).

  Underflowed sums (below ``floor``) are redone with ``2**(nmant -
  minexp/2)`` (2**86 in float32), which lifts the square of the smallest
  subnormal into the normal range and keeps these sums (under
  ``n * 2**-103``) far from overflow. Overflowed (or NaN) sums of squares
  are redone with ``2**-(maxexp/2 + 1)`` (2**-65), which keeps the square
  of the largest float finite. Others keep ``2**0``, which redoes them
  exactly. One pass, no maximum: the usual orders' rescue is a single
  reduction.
  """
  info = jnp.finfo(acc)
  down, up = -(info.maxexp // 2 + 1), info.nmant - info.minexp // 2
  squares = _is_order(p, 2)
  overflow = ~(sums < jnp.inf) if squares else jnp.zeros_like(sums, bool)
  underflow = (sums < floor) & ~overflow
  scale = _Scale(
      (jnp.where(overflow, 2.0 ** down,
                 jnp.where(underflow, 2.0 ** up, 1)).astype(acc),),
      jnp.where(underflow, 2.0 ** (up + info.minexp - info.nmant),
                0).astype(acc))

  def redo(x, rows):
    scaled = scale.rows(rows, x.ndim)
    return scaled.square(x, acc) if squares else scaled.magnitude(x, acc)

  redone = _reduce_leaves(groups, redo, reduction, maximum=False, total=total)
  roots = safe_root(redone, 2) if squares else redone
  if squares:
    roots = roots * jnp.where(overflow, 2.0 ** -down, 1).astype(acc)
  return jnp.where(underflow, _unscaled(roots, -up), roots)


# Up to this order, powers of the rescaled values (largest in [0.5, 1.5))
# keep every term that matters in the normal range; above it the rescue
# divides them by the largest first, at the cost of one more pass.
_SCALED_ORDER_LIMIT = 64


def _rescued_roots(groups, p, acc, reduction, sums, floor, *,
                   total: bool) -> jax.Array:
  """Norms from power sums of ``|x| / 2**k``, ``2**k`` just above the
  largest ``|x|`` (per leaf, or for all leaves with ``total``).

  Where the largest ``|x|`` is 0 or not finite, the plain sums' root
  stands (their NaN or Inf, or 0).
  """
  usable, exponents, _ = _exact_maxima(groups, acc, reduction, total=total)
  scale = _Scale.by(-exponents, acc)

  def scaled(x, rows):
    return scale.rows(rows, x.ndim).magnitude(x, acc)

  divisor = None
  if isinstance(p, jax.Array) or p > _SCALED_ORDER_LIMIT:
    peaks = _reduce_leaves(groups, scaled, reduction, maximum=True, total=total)
    divisor = jnp.where(usable & (p > _SCALED_ORDER_LIMIT), peaks, 1)

  def power(x, rows):
    y = scaled(x, rows)
    if divisor is not None:
      y = y / _factor_for(divisor, rows, y.ndim)
    return _pow(y, p)

  roots = safe_root(_reduce_leaves(groups, power, reduction, maximum=False,
                                   total=total), p)
  if divisor is not None:
    roots = roots * divisor
  if reduction.batch_axis is not None:
    # Decided for a whole batch: an example that did not need the rescue
    # keeps its plain norm, as when each example decided for itself.
    usable = usable & _needs_rescue(sums, floor)
  return jnp.where(usable, _unscaled(roots, exponents), safe_root(sums, p))


def _switch_on_order(norm_fn, p: jax.Array) -> jax.Array:
  """Runs ``norm_fn`` with a traced order (``optax.inject_hyperparams``).

  The usual orders keep their fast, exact formulations; any other runs the
  generic ``|x| ** p`` path. Only the selected branch runs.
  """
  branches = [lambda: norm_fn(2.0), lambda: norm_fn(1.0),
              lambda: norm_fn(math.inf), lambda: norm_fn(p)]
  index = jnp.select([p == 2, p == 1, p == jnp.inf], [0, 1, 2], 3)
  return lax.switch(index, branches)


def _by_order(norm_fn):
  """``norm_fn(leaves, p, reduction)``, compiled once per tree structure,
  order and reduction.

  Called eagerly, a norm would otherwise re-trace its ``lax.cond`` at every
  call; inside a user's ``jit`` the inner jit is simply inlined. A traced
  order (``optax.inject_hyperparams``) dispatches with ``lax.switch``.
  """
  compiled = jax.jit(norm_fn, static_argnums=(1, 2))

  @functools.wraps(norm_fn)
  def call(leaves: list[jax.Array], p: Any,
           reduction: Reduction = LOCAL) -> jax.Array:
    if not isinstance(p, jax.Array):
      return compiled(leaves, p, reduction)
    return _switch_on_order(
        lambda q: (norm_fn if isinstance(q, jax.Array) else compiled)(
            leaves, q, reduction), p)

  return call


def _norms_of(leaves, p, acc, reduction: Reduction, *,
              total: bool) -> jax.Array:
  """The norms: plain power sums, and the rescue only where they fail."""
  plan = _plan(leaves, merge=total and reduction.replicated_axes is None)
  groups = _groups(leaves, plan=plan)
  sums = _power_sums(groups, p, acc, reduction, total=total)
  if _is_order(p, math.inf):
    # A maximum neither overflows nor underflows. (A largest |x| below the
    # normal range, read as 0 where subnormals are flushed, would be one in
    # any later arithmetic too.)
    return sums
  floor = _precision_floor(leaves, acc, reduction)
  if _is_order(p, 1):
    # Sums of |x| overflow only when the norm does: only an underflow (of
    # subnormal entries read as 0) needs the rescue.
    needed = sums < floor
  else:
    needed = _needs_rescue(sums, floor)
  if _is_order(p, 2) or _is_order(p, 1):
    rescued = functools.partial(_rescued_by_fixed_scale, groups, p, acc,
                                reduction, sums, floor, total=total)
  else:
    rescued = functools.partial(_rescued_roots, groups, p, acc, reduction,
                                sums, floor, total=total)
  if not BUILD_RESCUE:
    return safe_root(sums, p)
  return lax.cond(reduction.decide(needed), rescued,
                  lambda: safe_root(sums, p))


def _weights_of_ratios(r: jax.Array, p: Any) -> jax.Array:
  """``r ** (p - 1)``: the derivative of a ``p``-norm by ``|x|``, with
  ``r = |x| / norm`` in ``[0, 1]``; 0 where ``r`` is 0, NaN where NaN."""
  if _is_order(p, 2):
    return r
  k = _integer_power(p)
  if k is not None:
    return lax.integer_pow(r, k - 1)
  if not isinstance(p, jax.Array) and p > 1:
    return r ** (p - 1)
  positive = r > 0  # p < 1 (or traced): no 0 ** negative
  return jnp.where(positive, jnp.where(positive, r, 1) ** (p - 1), r * 0)


def _along(values: jax.Array, dots: jax.Array, acc) -> jax.Array:
  """``d|x|`` along ``dx``: ``sign(x) * dx``, or for complex ``x`` the part
  of ``dx`` along ``x / |x|`` (0 at ``x = 0``)."""
  if jnp.iscomplexobj(values):
    modulus = jnp.abs(values)
    nonzero = modulus > 0
    unit = jnp.where(nonzero, values / jnp.where(nonzero, modulus, 1), 0)
    return jnp.real(jnp.conj(unit) * dots).astype(acc)
  # The sign from the sign bit: a subnormal's is read right.
  return jnp.where(jnp.signbit(values), -dots, dots).astype(acc)


def _norm_tangents(leaves, dots, norms, p, acc, reduction: Reduction, *,
                   total: bool, dp: Any = None) -> jax.Array:
  """The derivative of the norms along ``dots`` (and ``dp``), by formula.

  ``d norm = sum (|x| / norm) ** (p - 1) * d|x|`` (for ``inf``: ``d|x|`` at
  the largest ``|x|``, shared by ties), plus, for a traced order,
  ``norm / p * sum r**p log r * dp`` with ``r = |x| / norm``. ``r`` is
  formed from exact powers of two and a division by ``norm``'s mantissa,
  so no step overflows or loses a subnormal, whatever the magnitude.
  Differentiating the computation instead would multiply a zero cotangent
  by the infinite derivative of an overflowed plain sum (the branch not
  taken) and give NaN. The ``dots`` are grouped as the leaves were.
  """
  plan = _plan(leaves, merge=total and reduction.replicated_axes is None)
  groups = _groups(leaves, plan=plan)
  pairs = [(rows, (values, dvalues)) for (rows, values), (_, dvalues)
           in zip(groups, _groups(dots, plan=plan))]
  bits = _bits(norms)
  usable = (bits > 0) & (bits < _bits(jnp.asarray(jnp.inf, acc)))

  if _is_order(p, math.inf):
    def peak(x, rows):  # (a zero norm has no usable peak: see `share`)
      a = (_bits(magnitude(x, acc)) if jnp.iscomplexobj(x)
           else _magnitude_bits(x.astype(acc)))
      return a == _factor_for(bits, rows, x.ndim)
    counts = _reduce_leaves(groups, lambda x, rows: peak(x, rows).astype(acc),
                            reduction, maximum=False, total=total)
    share = jnp.where(usable & (counts > 0), 1 / jnp.maximum(counts, 1), 0)

    def weights(x, rows):
      return jnp.where(peak(x, rows), _factor_for(share, rows, x.ndim), 0)
  else:
    scale = _Scale.by(-jnp.where(usable, _exponent(bits, acc), 0), acc)
    mantissa = jnp.where(usable, scale.apply(jnp.where(usable, norms, 0)), 1)
    # |x| / norm: 0 for an infinite norm (an overflow of finite |x|), NaN
    # for a NaN one.
    otherwise = jnp.where(jnp.isnan(norms), norms, 0)

    def ratios(x, rows):
      ratio = (scale.rows(rows, x.ndim).magnitude(x, acc)
               / _factor_for(mantissa, rows, x.ndim))
      return jnp.where(_factor_for(usable, rows, x.ndim), ratio,
                       _factor_for(otherwise, rows, x.ndim))

    def weights(x, rows):
      if _is_order(p, 1):
        nonzero = (magnitude(x, acc) > 0 if jnp.iscomplexobj(x)
                   else _nonzero_bits(x.astype(acc)))
        return nonzero.astype(acc)
      return _weights_of_ratios(ratios(x, rows), p)

  def terms(pair, rows):
    x, dx = pair
    return weights(x, rows) * _along(x, dx, acc)

  tangents = _reduce_leaves(pairs, terms, reduction, maximum=False,
                            total=total)
  if dp is None:
    return tangents

  def entropy(x, rows):
    r = ratios(x, rows)
    positive = r > 0
    safe = jnp.where(positive, r, 1)
    return jnp.where(positive, safe ** p * jnp.log(safe), r * 0)

  by_order = norms / p * _reduce_leaves(groups, entropy, reduction,
                                        maximum=False, total=total)
  return tangents + by_order * dp.astype(acc)


def _p_norms(leaves, p, reduction: Reduction, *, total: bool) -> jax.Array:
  """The ``p``-norm of each leaf (a vector in the accumulation dtype) or,
  with ``total``, of all leaves together (a scalar).

  Differentiable by the formula (``_norm_tangents``): finite gradients for
  every order and magnitude whose norm is finite, zero at zero. A traced
  order is an argument of its own (a custom derivative may not close over
  a traced value), with its derivative too.
  """
  leaves = [jnp.asarray(x) for x in leaves]
  acc = _tree.accumulation_dtype(leaves)
  if not leaves:
    return jnp.zeros([] if total else [0], acc)

  @functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
  def static(leaves, p):
    return _norms_of(leaves, p, acc, reduction, total=total)

  @static.defjvp
  def static_jvp(p, primals, tangents):
    (leaves,), (dots,) = primals, tangents
    out = static(leaves, p)
    return out, _norm_tangents(leaves, dots, out, p, acc, reduction,
                               total=total)

  @jax.custom_jvp
  def traced(leaves, p):
    return _norms_of(leaves, p, acc, reduction, total=total)

  def traced_jvp(primals, tangents):
    (leaves, p), (dots, dp) = primals, tangents
    out = traced(leaves, p)
    dots = [jnp.zeros(x.shape, x.dtype) if isinstance(d, SymbolicZero) else d
            for x, d in zip(leaves, dots)]
    dp = None if isinstance(dp, SymbolicZero) else dp
    return out, _norm_tangents(leaves, dots, out, p, acc, reduction,
                               total=total, dp=dp)

  # Symbolic zeros: no pass over the leaves for the order's derivative
  # unless the order is differentiated.
  traced.defjvp(traced_jvp, symbolic_zeros=True)
  if isinstance(p, jax.Array):
    return traced(leaves, p)
  return static(leaves, p)


@_by_order
def leaf_norms(leaves, p, reduction):
  """The ``p``-norm of each leaf, as a vector in the accumulation dtype."""
  return _p_norms(leaves, p, reduction, total=False)


@_by_order
def norm_of_leaves(leaves, p, reduction):
  """The ``p``-norm of all ``leaves`` taken together, as a scalar."""
  return _p_norms(leaves, p, reduction, total=True)


def global_norm(tree: PyTree, ord: float | str = 2, *, axis_name: Any = None,
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
      unsplit tree, computed with one all-reduce.
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
  p = _validation.check_ord("global_norm", ord)
  _validation.check_tree("global_norm", "tree", tree)
  reduction = make_reduction("global_norm", tree, axis_name, specs)
  return norm_of_leaves(_tree.clippable_leaves(tree), p, reduction)


def all_finite(tree: PyTree, *, axis_name: Any = None) -> jax.Array:
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
  axis_names = _validation.check_axis_name("all_finite", axis_name)
  _validation.check_tree("all_finite", "tree", tree)
  leaves = _tree.clippable_leaves(tree)
  if not leaves:
    return jnp.bool_(True)
  local = jnp.all(_per_leaf(_groups(leaves), lambda x, rows: jnp.isfinite(x),
                            jnp.all))
  if not axis_names:
    return local
  return lax.pmin(local.astype(jnp.int32), axis_names).astype(jnp.bool_)
