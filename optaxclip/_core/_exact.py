"""Exact scaling of floats by powers of two, over their whole range.

Hardware that flushes subnormal floats to zero (XLA:CPU does) reads one as 0
in any arithmetic: multiplying it by 2**100 gives 0. The norms' rescue
passes therefore read a subnormal from its bits (its mantissa, an integer,
times the weight of its last bit) and write a subnormal result from its
bits; everything else is plain multiplication by powers of two, which is
exact. No constant here is subnormal: XLA folds constants together.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


def integer_type(dtype) -> Any:
  """The signed integer type as wide as the float ``dtype``."""
  return jnp.int64 if jnp.finfo(dtype).bits == 64 else jnp.int32


def bits(x: jax.Array) -> jax.Array:
  """The bits of a float, as an integer of its width."""
  return lax.bitcast_convert_type(x, integer_type(x.dtype))


def magnitude_bits(y: jax.Array) -> jax.Array:
  """The bits of ``|y|`` for real ``y``, by clearing the sign bit."""
  return bits(y) & ((1 << (jnp.finfo(y.dtype).bits - 1)) - 1)


def nonzero_bits(y: jax.Array) -> jax.Array:
  """Whether real ``y`` is not ``±0``, read from its bits.

  The mantissa is tested on its own: LLVM folds an integer test of all of
  ``|y|``'s bits into a float comparison, which reads a subnormal as 0.
  """
  info = jnp.finfo(y.dtype)
  bits = magnitude_bits(y)
  return (bits >= (1 << info.nmant)) | ((bits & ((1 << info.nmant) - 1)) != 0)


def _common(a: Any, b: Any) -> tuple[jax.Array, jax.Array]:
  """``a`` and ``b`` in their common float type (bits of two widths do not
  compare)."""
  dtype = jnp.result_type(a, b)
  return jnp.asarray(a, dtype), jnp.asarray(b, dtype)


def at_most(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a <= b`` for ``a, b >= 0`` (False where either is NaN), compared as
  bits: a float comparison reads a subnormal as 0 where hardware flushes
  them (a norm of 3e-45 is then "at most" 0). Against 0 through
  ``nonzero_bits``: LLVM folds a comparison of all the bits with a
  constant 0 back into a float one."""
  a, b = _common(a, b)
  ordered = jnp.where(nonzero_bits(b), magnitude_bits(a) <= magnitude_bits(b),
                      ~nonzero_bits(a))
  return ordered & (a == a) & (b == b)


def below(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a < b`` for ``a, b >= 0`` (False where either is NaN), as bits."""
  a, b = _common(a, b)
  return ~at_most(b, a) & (a == a) & (b == b)


def quotient(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a / b`` for ``a, b >= 0``, right where ``b`` is subnormal (read as 0
  where hardware flushes subnormals: the quotient would be NaN or Inf).
  Both are scaled up by ``2**64`` there first (exactly, from their bits;
  the gradient is the plain quotient's)."""
  info = jnp.finfo(b.dtype)
  up = Scale.by(jnp.asarray(64), b.dtype)

  def scaled(x):
    plain = x * 2.0 ** 64
    return plain + lax.stop_gradient(up.apply(x) - plain)
  tiny = magnitude_bits(b) < (1 << info.nmant)  # subnormal (or 0)
  return jnp.where(tiny, scaled(a) / scaled(jnp.where(tiny, b, 1)), a / b)


def _power_of_two(exponent: jax.Array, dtype) -> jax.Array:
  """``2 ** exponent`` from its bits, for ``minexp <= exponent < maxexp``."""
  info = jnp.finfo(dtype)
  biased = exponent.astype(integer_type(dtype)) + (info.maxexp - 1)
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
  exponent = exponent.astype(integer_type(dtype))
  half = exponent >> 1  # floor(exponent / 2): a shift, where // costs ten ops
  return _power_of_two(half, dtype), _power_of_two(exponent - half, dtype)


def times_power_of_two(x: jax.Array, exponent: jax.Array) -> jax.Array:
  """``x * 2**exponent``, exactly, over the whole range of the float."""
  low, high = _power_of_two_halves(exponent, x.dtype)
  return x * low * high


def exponent_of_bits(bits: jax.Array, dtype) -> jax.Array:
  """``frexp``'s exponent of the float ``>= 0`` with these bits.

  Exact for subnormals too, where ``jnp.frexp`` (arithmetic on them) fails
  on hardware that flushes them.
  """
  info = jnp.finfo(dtype)
  field = bits >> info.nmant
  top_bit = (info.bits - 1) - lax.clz(bits)  # of a subnormal's mantissa
  return jnp.where(field > 0, field + info.minexp,
                   top_bit + info.minexp - info.nmant + 1)


class Scale(NamedTuple):
  """Multiplies magnitudes by ``2 ** exponent`` (one per unit, or shared).

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
  def by(cls, exponent: jax.Array, dtype) -> "Scale":
    """The scale for any exponent in the float's range."""
    info = jnp.finfo(dtype)
    last = exponent + info.minexp - info.nmant
    last_bit = jnp.where(
        last >= info.minexp,
        _power_of_two(jnp.clip(last, info.minexp, info.maxexp - 1), dtype), 0)
    return cls(_power_of_two_halves(exponent, dtype), last_bit)

  def pick(self, pick: Callable[[jax.Array], jax.Array]) -> "Scale":
    """The factors of the values at hand, ``pick`` selecting each one's
    (see ``_grouping.Group.pick``)."""
    return Scale(tuple(map(pick, self.factors)), pick(self.last_bit))

  def apply(self, y: jax.Array) -> jax.Array:
    """``|y| * 2**exponent`` for real ``y``."""
    bits = magnitude_bits(y)
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


def unscaled(r: jax.Array, exponent: Any) -> jax.Array:
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
      jnp.where(fits, mantissa, 0).astype(integer_type(r.dtype)), r.dtype)
  return jnp.where(fits, subnormal, normal)


def root(s: jax.Array, p: Any) -> jax.Array:
  """``s ** (1/p)`` for finite ``s > 0``, to a few ulps at any magnitude.

  ``s ** (1/p)`` as one power loses ``|log2 s| * ulp(1/p)`` of its
  exponent (float64: a sum near ``2**641`` and ``p = 2.5`` came out 45 ulps
  off). Here ``s = m * 2**k`` (``m`` in ``[0.5, 1)``, both exact), ``k =
  t p + r`` with ``r = fmod(k, p)`` (exact in IEEE arithmetic) and ``t`` an
  integer, so ``s ** (1/p) = 2**t * 2**((r + log2 m) / p)``: the power's
  exponent is below ``1 + 1/p`` in magnitude, and ``2**t`` is exact.
  """
  dtype, info = s.dtype, jnp.finfo(s.dtype)
  k = exponent_of_bits(bits(s), dtype)
  m = Scale.by(-k, dtype).apply(s)
  p = jnp.asarray(p, dtype)
  kf = k.astype(dtype)
  r = lax.rem(kf, p)
  t = jnp.round((kf - r) / p)
  # Beyond these the root is 0 or inf whatever the power (halves in range).
  t = jnp.clip(t, 2 * info.minexp, 2 * info.maxexp - 2).astype(integer_type(dtype))
  return unscaled(jnp.exp2((r + jnp.log2(m)) / p), t)


def max_code(x: jax.Array, acc) -> jax.Array:
  """A float whose maximum over a leaf tells its largest ``|x|`` exactly.

  ``|x|`` where normal; a subnormal's bits minus ``2**nmant`` (a value in
  ``[-2**nmant, 0)``, exact) where not. Max reductions of floats stay fast
  where integer ones are slow (XLA:CPU). For complex ``x``, the larger of
  ``|re|, |im|``: within a factor ``sqrt(2)`` of ``|x|``.
  """
  if jnp.iscomplexobj(x):
    return jnp.maximum(*(max_code(part, acc)
                         for part in (jnp.real(x), jnp.imag(x))))
  y = x.astype(acc)
  bits = magnitude_bits(y)
  subnormal = 2 ** jnp.finfo(acc).nmant
  return jnp.where(bits < subnormal, bits.astype(acc) - subnormal, jnp.abs(y))


def from_max_code(codes: jax.Array, acc) -> jax.Array:
  """The largest ``|x|`` from the maximum of ``max_code``: the code where it
  is positive (or NaN), else the subnormal written from its bits."""
  subnormal = codes <= 0
  offset = 2 ** jnp.finfo(acc).nmant
  written = lax.bitcast_convert_type(
      (jnp.where(subnormal, codes, 0) + offset).astype(integer_type(acc)), acc)
  return jnp.where(subnormal, written, codes)
