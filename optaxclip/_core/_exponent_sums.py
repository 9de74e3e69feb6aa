"""Sums of powers of ``|x|`` as one reduction of the entries' bits.

The one-pass kernel's reductions of small leaves (merged many to a group,
``_batching``, or one leaf's own units) and of pair orders (``_one_pass``):
one reduction whose only input is each entry's bits, so that XLA:GPU fuses
the concatenation of up to ~64 leaves into the reduction that reads it.
Blue's three masked sums make it write the concatenation out (sibling
sums) or, as one reduction of a one-hot of the bands, fuse only ~16
leaves; pairs computed per entry as two inputs make it write the pairs out
(H100, deviceless, 200 small leaves in groups of 64: 9 fusions and 1.008
passes here, 3.86 passes for pairs, 2.9 for the one-hot).

For ``p`` 1 and 2 each entry is the pair ``(E, t)``: ``E`` its biased
exponent field (at least 1), ``t = (|x| / 2**(E - bias))**p``, exact for
subnormals (``E = 1`` and a mantissa below 1, read from the bits; no
arithmetic on a subnormal, which XLA:CPU and TPUs flush). The reduction
keeps the largest ``E`` and the sum of the ``t`` rescaled to it by exact
powers of two (terms more than ``2**minexp`` below the largest are
dropped: far below its rounding). Entries enter the reduction as raw bits
tagged by ``t = -1`` and are decoded inside the reducer (``tagged_reduce``,
which pair orders use with their own pairs).
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optaxclip._core import _exact
from optaxclip._core._batching import Partials, sibling_sums
from optaxclip._core._blocks import blocked_reduce

_RAW = -1.0  # the `t` of an entry not yet decoded (a sum is never negative)


class ExponentSum(NamedTuple):
  """A sum of ``|x|**p`` as ``total * 2**(p * (exponent - bias))``:
  ``exponent`` the largest biased exponent field among the entries (0 for
  none), ``total`` at least 1 where that entry is normal."""
  exponent: jax.Array
  total: jax.Array


def _power_of_two_or_zero(k: jax.Array, dtype) -> jax.Array:
  """``2**k`` from its bits, 0 below the normal range (``k`` < maxexp)."""
  info = jnp.finfo(dtype)
  return jnp.where(k >= info.minexp,
                   _exact._power_of_two(jnp.maximum(k, info.minexp), dtype), 0)


def _field_pair(key: jax.Array, p: int, dtype) -> tuple[jax.Array, jax.Array]:
  """An entry's ``(E, t)`` from its bits ``key`` (``p`` 1 or 2)."""
  info = jnp.finfo(dtype)
  bias = info.maxexp - 1
  field = key >> info.nmant
  # 1.f for a normal entry, 0.f (exact: Sterbenz) for a subnormal one.
  mantissa = lax.bitcast_convert_type(
      (key & ((1 << info.nmant) - 1)) | (bias << info.nmant), dtype)
  mantissa = mantissa - jnp.where(field == 0, 1, 0).astype(dtype)
  term = mantissa * mantissa if p == 2 else mantissa
  # NaN and Inf (the top field) as themselves: they swamp any finite sum.
  term = jnp.where(field == 2 * info.maxexp - 1,
                   lax.bitcast_convert_type(key, dtype), term)
  return jnp.maximum(field, 1), term


def _field_sums(p: int):
  """Adds ``(E, t)`` pairs: the larger ``E``, the sums rescaled to it by
  exact powers of two."""
  def combine(a, b):
    (ea, ta), (eb, tb) = a, b
    top = jnp.maximum(ea, eb)
    weight = lambda e: _power_of_two_or_zero(p * (e - top), ta.dtype)  # noqa: E731
    return top, ta * weight(ea) + tb * weight(eb)
  return combine


def raw(x: jax.Array, acc) -> tuple[jax.Array, jax.Array]:
  """The entries of real ``x`` as a tagged reduction takes them: their
  bits in ``acc`` (of ``|x|``), each marked not yet decoded."""
  bits = _exact.magnitude_bits(x.astype(acc))
  return bits, jnp.full(bits.shape, _RAW, acc)


def _decoded(decode: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
             pair: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """A ``raw`` entry decoded (``decode(bits)``, a pair); a sum as it is."""
  key, t = pair
  exponent, term = decode(key)
  entry = t < 0  # a sum (NaN too) is not below 0
  return (jnp.where(entry, exponent.astype(key.dtype), key),
          jnp.where(entry, term, t))


def tagged_reduce(values: tuple[jax.Array, jax.Array], init,
                  decode: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
                  combine: Callable[[Any, Any], tuple[jax.Array, jax.Array]],
                  axes: tuple[int, ...], block: int) -> tuple[jax.Array, jax.Array]:
  """Reduces ``raw`` entries (``values``) to pairs over ``axes``: each
  operand of ``combine`` decoded first. The result of two entries or more
  comes out of ``combine``; of one entry, XLA may return it as it is (it
  takes ``init`` for an identity): then it is decoded after (an epilogue
  XLA:GPU gives a kernel of its own, so only then)."""
  def combined(a, b):
    return combine(_decoded(decode, a), _decoded(decode, b))
  key, t = blocked_reduce(values, init, combined, axes, block)
  if math.prod(values[0].shape[a] for a in axes) > 1:
    return key, t
  return _decoded(decode, (key, t))


# Partial sums of rows of this many entries: XLA:GPU reduces each group in
# one kernel, then all groups' partials in one more (a reduction of a whole
# group would take two kernels: H100, 150 small leaves, 5 fusions against 7).
_ROW = 4096


def _reduce(values, p: int, block: int, axes) -> ExponentSum:
  dtype = values[1].dtype
  init = (jnp.zeros([], values[0].dtype), jnp.zeros([], dtype))
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return ExponentSum(*tagged_reduce(
      values, init, lambda key: _field_pair(key, p, dtype), _field_sums(p),
      axes, block))


def partial_sums(x: jax.Array, p: int, acc, *, block: int) -> ExponentSum:
  """Sums of ``|x|**p`` (``p`` 1 or 2) over all of ``x`` as one reduction of
  its bits: partial sums of rows of ``_ROW`` entries (vectors; ``total``
  adds them up), or with ``block`` (a backend that adds one entry after
  the other: XLA:CPU) the whole sum, in blocks of ``block``, as a vector of
  one."""
  if jnp.iscomplexobj(x):
    if p != 2:
      raise ValueError("exponent sums of complex entries take p = 2")
    x = jnp.stack([jnp.real(x), jnp.imag(x)])  # |x|**2 = re**2 + im**2
  bits = _exact.magnitude_bits(x.astype(acc)).reshape(-1)
  if block:
    rows = bits.reshape(1, -1)
  else:  # padded with zeros: (E, t) = (1, 0), nothing to the sum
    count = -(-bits.size // _ROW)
    rows = lax.pad(bits, jnp.zeros([], bits.dtype),
                   [(0, count * _ROW - bits.size, 0)]).reshape(count, _ROW)
  return _reduce((rows, jnp.full(rows.shape, _RAW, acc)), p, block, 1)


def _summed(partials: tuple[jax.Array, ...], p: int, block: int) -> ExponentSum:
  """The sum of ``partial_sums`` (of one group, or several side by side)."""
  return _reduce(partials, p, block, 0)


def _scaled(s: ExponentSum, p: int, shift: Any) -> jax.Array:
  """``total * 2**(p * unbiased exponent + shift)``, the exponent clipped to
  the normal range (used only where it lies there)."""
  info = jnp.finfo(s.total.dtype)
  k = p * (s.exponent - (info.maxexp - 1)) + shift
  return s.total * _exact._power_of_two(
      jnp.clip(k, info.minexp, info.maxexp - 1), s.total.dtype)


def blue_partials(x: jax.Array, acc, blue: Any, *, block: int) -> Partials:
  """``x``'s squares for Blue's three accumulators (``blue``: their
  thresholds and scales, ``_one_pass._Blue``): partial sums, finished as
  ``blue_sums``."""
  return Partials(partial_sums(x, 2, acc, block=block),
                  lambda sums: blue_sums(_summed(sums, 2, block), blue))


def one_norm_partials(x: jax.Array, acc, tiny: int, *, block: int) -> Partials:
  """``|x|`` for the 1-norm's two accumulators: partial sums, finished as
  ``one_norm_sums``."""
  return Partials(partial_sums(x, 1, acc, block=block),
                  lambda sums: one_norm_sums(_summed(sums, 1, block), tiny))


class Bits(NamedTuple):
  """A leaf's entries as ``raw`` gives them: what an ``elementwise`` of
  ``_batching.reduce_many`` gives, per unit, for a reducer of
  ``blue_reducer`` to reduce as one reduction of its bits."""
  values: tuple[jax.Array, jax.Array]


def blue_reducer(blue: Any, *, block: int):
  """A ``reducer`` of ``reduce_many`` for Blue's three sums: of ``Bits``,
  one reduction of pairs, as ``blue_sums``; else three sibling sums."""
  def reducer(out, axis):
    if isinstance(out, Bits):
      summed = _reduce(out.values, 2, block, tuple(axis))
      return blue_sums(summed, blue)
    return sibling_sums(out, axis)
  return reducer


def blue_sums(s: ExponentSum, blue: Any) -> tuple[jax.Array, ...]:
  """``s`` (``p = 2``) as Blue's three accumulators (``blue``: their
  thresholds and scales, ``_one_pass._Blue``): all of it in the band of its
  largest entry, scaled as that band's entries are; each a normal float."""
  info = jnp.finfo(s.total.dtype)
  top = s.exponent - (info.maxexp - 1)  # the largest entry is in [2**top, 2**(top+1))
  zero = jnp.zeros_like(s.total)
  in_small, in_big = top < blue.small, top >= blue.big
  return (jnp.where(in_small, _scaled(s, 2, 2 * blue.small_scale), zero),
          jnp.where(in_small | in_big, zero, _scaled(s, 2, 0)),
          jnp.where(in_big, _scaled(s, 2, 2 * blue.big_scale), zero))


def one_norm_sums(s: ExponentSum, tiny: int) -> tuple[jax.Array, jax.Array]:
  """``s`` (``p = 1``) as the 1-norm's two accumulators (``_one_pass``):
  below ``2**tiny`` scaled by ``2**-tiny``, else as it is."""
  info = jnp.finfo(s.total.dtype)
  in_tiny = s.exponent - (info.maxexp - 1) < tiny
  zero = jnp.zeros_like(s.total)
  return (jnp.where(in_tiny, _scaled(s, 1, -tiny), zero),
          jnp.where(in_tiny, zero, _scaled(s, 1, 0)))
