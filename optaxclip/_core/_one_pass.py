"""Norms that read each entry once and hold no conditional: the GPU/TPU kernel.

XLA:GPU turns a two-branch conditional made of cheap instructions (and
reductions count as cheap) into a ``select`` that runs both branches on
every step, so ``_sums``' rescue would read the gradients twice there
(H100: 2.00 passes for the norm, docs/design.md). Here overflow and
underflow safety live inside the one pass instead:

- ``p = 2``: Blue's three accumulators, as LAPACK 3.10's ``nrm2`` (Anderson
  2017, "Algorithm 978: Safe Scaling in the Level 1 BLAS"): entries below
  ``2**-63`` are summed scaled up by ``2**86``, above ``2**32`` scaled down
  by ``2**-76``, the rest as they are. The three masked sums are sibling
  reductions of one input, which XLA:GPU fuses into one read (a prototype
  on an H100: 3269 us against optax's 3278 us on a 5.24 GB tree) and which
  sharded ``jit`` partitions like any sum (a variadic reduction would make
  it gather the leaves); across devices they travel in one all-reduce.
  Small leaves (up to the platform's ``Layout.limit``, off a mesh of
  several devices) are reduced as ``(exponent, sum)`` pairs of their bits
  instead, merged ones many to a reduction, and added into the band of
  their largest entry (``_exponent_sums``): XLA:GPU writes the input of
  sibling sums out for a concatenation, and for a leaf up to ~2**18
  entries. So are units that keep a leaf's trailing axes, of any size
  (AGC's: XLA:GPU writes sibling column sums out), each group's norms
  finished where it is reduced (XLA:TPU copies each vector it lays out
  in unit order).
- ``p = 1``: two accumulators (entries below ``2**-100`` scaled up by
  ``2**100``); a sum of ``|x|`` overflows only when the norm does; merged
  small leaves as pairs, as for ``p = 2``.
- other orders up to ``_PAIR_ORDER_LIMIT``, leaves off a mesh of several
  devices: variadic reductions of pairs ``(exponent, sum of (|x| /
  2**exponent)**p)``, the exponent the largest ``frexp`` exponent seen
  (across devices: a max, then a sum), read from the entries' bits
  (``_exponent_sums.tagged_reduce``); on the CPU in blocks (``_blocks``:
  XLA:CPU adds a variadic reduction one entry after the other, its error
  would grow with the entries).
- higher orders, traced ones, and leaves laid out on a mesh (sharded
  ``jit`` would gather them for a variadic reduction): the largest ``|x|``,
  then the powers divided by it (three reads, no conditional).

Subnormal entries are read from their bits (``_exact``) and subnormal norms
written from them, so the numbers are the same on hardware that flushes
subnormals (XLA:CPU, TPU) as on hardware that keeps them.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optaxclip._core import _exact
from optaxclip._core._batching import Group, Grouped, reduce, reduce_many
from optaxclip._core._exponent_sums import (
  Bits,
  blue_partials,
  blue_reducer,
  one_norm_partials,
  raw,
  tagged_reduce,
)
from optaxclip._core._mesh import Reduction, layout_spec, mesh_size
from optaxclip._core._sums import (
  elementwise_power,
  is_order,
  power,
  rescued_roots,
)


class _Blue(NamedTuple):
  """Blue's thresholds and scales (powers of two) for a float type.

  LAPACK's, but for the big threshold, lowered from ``2**52`` to
  ``2**(maxexp/4)`` so that ``2**31`` medium squares cannot overflow, and the
  small scale, raised from ``2**75`` to ``2**(nmant - minexp/2)`` so that the
  smallest subnormal's square is normal. float32: entries below ``2**-63``
  are scaled by ``2**86`` (squares under ``2**46``), above ``2**32`` by
  ``2**-76`` (squares in ``[2**-88, 2**104]``).
  """
  small: int
  small_scale: int
  big: int
  big_scale: int
  tiny: int  # p = 1: entries below 2**tiny are summed scaled by 2**-tiny

  @classmethod
  def of(cls, acc) -> "_Blue":
    info = jnp.finfo(acc)
    return cls(small=info.minexp // 2, small_scale=info.nmant - info.minexp // 2,
               big=info.maxexp // 4, big_scale=-(info.maxexp // 2 + 12),
               tiny=info.minexp + 2 * info.nmant)


# Up to this order, (|x| / 2**frexp_exponent)**p in (2**-p, 1] is normal.
_PAIR_ORDER_LIMIT = 120
# The exponent of a NaN/Inf entry (above every finite one) and of 0.
_NOT_FINITE, _ZERO = 1 << 20, -(1 << 20)


def _bands(x: jax.Array, acc, low: int, high: int | None):
  """``|x|`` in ``acc`` as ``(below 2**low, the rest, above 2**high)``
  masks, the rest including NaN; subnormal magnitudes are read exactly by
  ``_exact.Scale`` later, so the masks compare bits."""
  y = x.astype(acc)
  bits = _exact.magnitude_bits(y)
  small = bits < _exact.bits(jnp.asarray(2.0 ** low, acc))
  big = (bits > _exact.bits(jnp.asarray(2.0 ** high, acc))) & (y == y) if (
      high is not None) else jnp.zeros_like(small)
  return y, small, big


def _scaled(y: jax.Array, mask: jax.Array, exponent: int, acc) -> jax.Array:
  """``|y| * 2**exponent`` where ``mask``, else 0; exact for subnormals.

  Scaling down (the big band, which holds no subnormal), one multiply by
  a normal constant: a subnormal's path would multiply by 0.
  """
  if exponent < 0:
    return jnp.where(mask, jnp.abs(y) * 2.0 ** exponent, 0)
  scale = _exact.Scale.by(jnp.asarray(exponent), acc)
  return jnp.where(mask, scale.apply(y), 0)


def _parts(x: jax.Array, acc) -> list[jax.Array]:
  """Real parts to sum: ``x`` itself, or a complex ``x``'s real and
  imaginary parts (``|x|**2 = re**2 + im**2``)."""
  if jnp.iscomplexobj(x):
    return [jnp.real(x), jnp.imag(x)]
  return [x]


def _blue_sums(x: jax.Array, acc) -> tuple[jax.Array, ...]:
  """Per entry, its square in the small, medium and big accumulator."""
  blue = _Blue.of(acc)
  out = [jnp.zeros([], acc)] * 3
  for part in _parts(x, acc):
    y, small, big = _bands(part, acc, blue.small, blue.big)
    medium = ~(small | big)
    terms = (_scaled(y, small, blue.small_scale, acc),
             jnp.where(medium, y, 0), _scaled(y, big, blue.big_scale, acc))
    out = [a + t * t for a, t in zip(out, terms)]
  return tuple(out)


def _hypot(high: jax.Array, low: jax.Array) -> jax.Array:
  """``sqrt(high**2 + low**2)`` for ``high >= low >= 0``, neither squared."""
  ratio = low / jnp.where(high > 0, high, 1)
  return high * jnp.sqrt(1 + ratio * ratio)


def _blue_norms(sums: tuple[jax.Array, ...], divisor) -> jax.Array:
  """The 2-norms from the three accumulators, as LAPACK's ``nrm2`` combines
  them (roots taken before any rescaling, ``divisor`` applied first).

  Each root is brought to the big accumulator's units by one constant
  factor and combined as a hypot: no product of two constants, which XLA
  folds into one (``2**-76 * 2**-76`` is 0 in float32, and then every
  medium entry would be dropped once one entry is big).
  """
  small, medium, big = sums
  blue = _Blue.of(small.dtype)
  root_big = jnp.sqrt(big) / divisor  # in units of 2**-big_scale
  root_medium = jnp.sqrt(medium) / divisor
  root_small = _exact.unscaled(jnp.sqrt(small) / divisor, -blue.small_scale)
  # Big and medium (small entries are negligible next to a big one): the
  # medium root scaled down once, then back up once (normal factors).
  medium_down = root_medium * 2.0 ** blue.big_scale
  roots_big = _hypot(jnp.maximum(root_big, medium_down),
                     jnp.minimum(root_big, medium_down)) * 2.0 ** -blue.big_scale
  # Both medium and small: one of them may be negligible, neither overflows.
  both = _hypot(jnp.maximum(root_medium, root_small),
                jnp.minimum(root_medium, root_small))
  norms = jnp.where(big > 0, roots_big,
                    jnp.where(medium > 0,
                              jnp.where(small > 0, both, root_medium),
                              jnp.where(small > 0, root_small, root_medium)))
  return jnp.where(jnp.isnan(small + medium + big), jnp.nan, norms)


def _one_norm_sums(x: jax.Array, acc) -> tuple[jax.Array, ...]:
  """Per entry, ``|x|`` (real) in the tiny (scaled up) or the normal
  accumulator."""
  tiny_exponent = _Blue.of(acc).tiny
  y, tiny, _ = _bands(x, acc, tiny_exponent, None)
  return (_scaled(y, tiny, -tiny_exponent, acc),
          jnp.where(tiny, 0, jnp.abs(y)))


def _one_norms(sums: tuple[jax.Array, ...], divisor) -> jax.Array:
  tiny, normal = sums
  exponent = _Blue.of(tiny.dtype).tiny
  return jnp.where((normal > 0) | (normal != normal),
                   (normal + tiny * 2.0 ** exponent) / divisor,
                   _exact.unscaled(tiny / divisor, exponent))


def _pairs(bits: jax.Array, p, acc) -> tuple[jax.Array, jax.Array]:
  """Per entry (its bits: ``_exponent_sums.raw``) ``(e, (|x| / 2**e)**p)``,
  ``e`` its ``frexp`` exponent (exact for subnormals); ``(_ZERO, 0)`` for 0
  and ``(_NOT_FINITE, |x|)`` for NaN/Inf."""
  y = lax.bitcast_convert_type(bits, acc)  # compared, never computed with
  info = jnp.finfo(acc)
  exponent = _exact.exponent_of_bits(bits, acc)
  field = bits >> info.nmant
  top = (info.bits - 1) - lax.clz(bits)
  shift = jnp.where(field > 0, 0, info.nmant - top)
  one_half = jnp.asarray(info.maxexp - 2, bits.dtype) << info.nmant
  mantissa = lax.bitcast_convert_type(
      ((bits << shift) & ((1 << info.nmant) - 1)) | one_half, acc)
  finite = y < jnp.inf
  nonzero = _exact.nonzero_bits(y)  # `bits != 0` would read subnormals as 0
  e = jnp.where(finite, jnp.where(nonzero, exponent, _ZERO), _NOT_FINITE)
  t = jnp.where(finite, jnp.where(nonzero, power(mantissa, p), 0), y)
  return e, t


def _combine_pairs(p):
  def combine(a, b):
    (ea, ta), (eb, tb) = a, b
    e = jnp.maximum(ea, eb)
    weight = lambda d: jnp.exp2(p * (d - e).astype(ta.dtype))  # noqa: E731
    return e, ta * weight(ea) + tb * weight(eb)
  return combine


def _pair_norms(grouped: Grouped, p, acc, reduction: Reduction, *,
                total: bool, divisor, block: int) -> jax.Array:
  """Orders other than 1, 2, inf: one variadic reduction of pairs, whose
  input is the entries' bits (``_exponent_sums.tagged_reduce``: XLA:GPU writes out
  pairs computed per entry, and reads them again)."""
  combine = _combine_pairs(p)
  init = (jnp.asarray(_ZERO, _exact.integer_type(acc)), jnp.zeros([], acc))

  def reducer(values, axis):
    return tagged_reduce(values, init, lambda bits: _pairs(bits, p, acc),
                         combine, tuple(axis), block)

  def pairs(x, group):
    return raw(x, acc)

  e, t = reduce_many(grouped, pairs, reduction, total=total, reducer=reducer,
                     combine=combine, across=_pairs_across(p, reduction))
  roots = jnp.where(t > 0, t, 1) ** (1 / p) / divisor
  info = jnp.finfo(acc)
  norms = _exact.unscaled(roots, jnp.clip(e, info.minexp - info.nmant - 1, info.maxexp))
  return jnp.where(e == _NOT_FINITE, t, jnp.where(t > 0, norms, 0))


def _pairs_across(p, reduction: Reduction):
  """Combines pairs over devices: the largest exponent, then the sums
  rescaled to it (two all-reduces; one device: nothing)."""
  def across(pairs, sizes):
    e, t = pairs
    if not reduction.axis_names:
      return e, t
    top = reduction.max(e.astype(jnp.float32), sizes).astype(jnp.int32)
    from_here = reduction.local(top, sizes) if sizes else top
    t = t * jnp.exp2(p * (e - from_here).astype(t.dtype))
    return top, reduction.sum(t, sizes)
  return across


def _split(values: jax.Array) -> bool:
  """Whether ``values`` are laid out on a mesh of several devices, where
  sharded ``jit`` would gather them for a variadic reduction (a mesh of
  one device, as ``jax.set_mesh`` around a one-device trace, splits
  nothing)."""
  return layout_spec(values) is not None and (mesh_size(values) or 1) > 1


def _rows(group: Group) -> bool:
  """Whether ``group``'s units reduce its trailing axes (a row reduction,
  whose sibling sums XLA:GPU fuses into one read; it writes the terms of
  sibling column reductions out: AGC's units of a matrix, 6 passes)."""
  rank = jnp.ndim(group.values)
  return group.reduced == tuple(range(rank - len(group.reduced), rank))


def norms_one_pass(grouped: Grouped, p: Any, acc, reduction: Reduction, *,
                   total: bool, divisor=None) -> jax.Array:
  """The ``p``-norm of each unit of ``grouped`` (or, with ``total``, of all
  of them), reading each entry once (see the module docstring)."""
  divisor = jnp.ones([], acc) if divisor is None else divisor
  layout = grouped.layout
  assert layout is not None, "the one-pass kernel groups by a platform's layout"
  block = layout.block

  def small(x: jax.Array, group: Group) -> bool:
    # A merged group, or a small leaf off any mesh: one reduction of its
    # bits (sharded ``jit`` would gather a leaf for it; XLA:GPU writes the
    # terms of sibling sums of a leaf up to ~2**18 entries out). Never
    # where leaves of one shape are summed (XLA:TPU): sums add entry by
    # entry, and XLA:TPU compiles reductions of bits slower.
    if layout.summed:
      return False
    return group.units is None or (x.size <= layout.limit and not _split(x))

  if is_order(p, 2):
    blue = _Blue.of(acc)

    def two(x, group):
      if small(x, group) and total:
        return blue_partials(x, acc, blue, block=block)
      if ((small(x, group) or not (total or _rows(group) or _split(x)))
          and not jnp.iscomplexobj(x)):
        return Bits(raw(x, acc))
      return _blue_sums(x, acc)
    reducer = blue_reducer(blue, block=block)
    if not (total or reduction.axis_names or jnp.ndim(divisor)):
      # Each group's norms finished where it is reduced: one vector to put
      # in unit order, not three (XLA:TPU copies each, AGC's units of 3-D
      # leaves as many as half their entries).
      return reduce_many(grouped, two, reduction, total=False, reducer=lambda out, axis: (
          _blue_norms(reducer(out, axis), divisor),))[0]
    return _blue_norms(reduce_many(grouped, two, reduction, total=total,
                                   reducer=reducer), divisor)
  on_a_mesh = any(_split(x) for x in grouped.leaves)
  if is_order(p, 1) and not grouped.complex:
    def one(x, group):
      if total and small(x, group):
        return one_norm_partials(x, acc, _Blue.of(acc).tiny, block=block)
      return _one_norm_sums(x, acc)
    return _one_norms(reduce_many(grouped, one, reduction, total=total),
                      divisor)
  if (not isinstance(p, jax.Array) and p <= _PAIR_ORDER_LIMIT
      and not grouped.complex and not on_a_mesh):
    return _pair_norms(grouped.unsummed(), p, acc, reduction, total=total,
                       divisor=divisor, block=block)
  # Orders this high, traced (a reduction may not close over one), complex
  # leaves (|x| of subnormal parts), leaves on a mesh: the largest |x|
  # first, then the powers divided by it; the plain sums carry NaN/Inf.
  sums = reduce(grouped, lambda x, _: elementwise_power(x, p, acc), reduction,
                maximum=False, total=total)
  return rescued_roots(grouped, p, acc, reduction, sums, None, divisor,
                       total=total)
