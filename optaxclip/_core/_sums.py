"""Power sums that stay right at every magnitude: the elementwise powers,
the plain pass, and the rescue that runs only when it failed.

``p``-norms are ``(sum |x|**p) ** (1/p)`` of absolute values, and ``inf``
is ``max |x|``; complex leaves use ``|x|``. Values are widened to the
accumulation dtype ``acc`` (float32 at least) before any arithmetic:
squares of fp16 overflow above 256 and bf16 squares would keep 8 bits.

The plain power sum overflows float32 for |x| above ~1.8e19 (squares) and
loses everything below ~1e-19 (squares flush to zero); hardware that
flushes subnormal numbers (XLA:CPU does) reads an entry below ~1.2e-38 as 0
in any arithmetic. Only then, decided at run time by ``lax.cond``, a second
pass sums rescaled values, reading subnormal entries from their bits and
writing a subnormal norm from its bits. For ``p = 1`` and ``p = 2`` the
scale is a fixed power of two, chosen by which end failed, so the rescue is
one more pass and nothing else; other orders first find the largest |x| and
rescale by the power of two just above it. Sums of ``|x|`` overflow only
when the norm itself does, and maxima (``inf``) need no rescue. Finite
input therefore gives the right finite norm, and ordinary input pays
nothing for the safety net; a NaN or Inf anywhere gives a NaN or Inf norm.
"""

import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optaxclip._core import _exact
from optaxclip._core._batching import Grouped, reduce
from optaxclip._core._mesh import Reduction


def rescue_enabled() -> bool:
  """Whether norms are built with their rescue: always, unless the
  environment says ``OPTAXCLIP_RESCUE=off``.

  XLA's cost analysis counts both sides of the rescue's ``lax.cond``,
  though the rescue runs only when the plain sums fail; to measure its
  share, benchmarks/ and tests/test_traffic.py build programs without it,
  in a process of their own ([docs/design.md](../design.md)). Never in a program
  that trains. Read when a norm is traced (clear JAX's caches after a change).
  """
  return os.environ.get("OPTAXCLIP_RESCUE", "on") != "off"


def is_order(p: Any, value: float) -> bool:
  """Whether the norm order is statically ``value`` (a traced order never is)."""
  return not isinstance(p, jax.Array) and p == value


def integer_power(p: Any) -> int | None:
  """``p`` as an int when it is a static whole number up to 64, else None."""
  if isinstance(p, jax.Array) or not float(p).is_integer() or p > 64:
    return None
  return int(p)


def magnitude(x: jax.Array, acc: jnp.dtype) -> jax.Array:
  """``|x|`` in ``acc``; a complex leaf's in its own precision (no upcast)."""
  return jnp.abs(x).astype(acc) if jnp.iscomplexobj(x) else jnp.abs(x.astype(acc))


def power(a: jax.Array, p: Any, *, nonzero: jax.Array | None = None
          ) -> jax.Array:
  """``a ** p`` for ``a >= 0``; NaN stays NaN.

  The generic path (``p < 1`` or a traced ``p``) masks ``a > 0`` so that
  the power of 0 needs no ``log(0)``. Given ``nonzero`` (whether ``a`` is
  not 0, read from its bits), an ``a`` that is not 0 but reads as 0 (a
  subnormal, on hardware that flushes them, as XLA:CPU does) gives
  ``inf``: for ``p < 1`` its power is a normal number that would be lost,
  and an infinite sum sends the norm to the rescue, which reads it
  exactly. (For ``p >= 1`` such a power is below the precision floor,
  which sends small sums to the rescue anyway.)
  """
  k = integer_power(p)
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
  if is_order(p, 1) or is_order(p, math.inf):
    return s
  positive = (s > 0) & (s < jnp.inf)
  safe = jnp.where(positive, s, 1)
  root = jnp.sqrt(safe) if is_order(p, 2) else _exact.root(safe, p)
  return jnp.where(positive, root, s)  # s itself for 0, Inf and NaN


def elementwise_power(x: jax.Array, p: Any, acc: jnp.dtype) -> jax.Array:
  """``|x| ** p`` in ``acc`` (``|x|`` for ``inf``), without a sqrt for p=2."""
  if is_order(p, math.inf):
    return magnitude(x, acc)
  if is_order(p, 2) and not jnp.iscomplexobj(x):
    y = x.astype(acc)
    return y * y
  if is_order(p, 2):
    re, im = jnp.real(x).astype(acc), jnp.imag(x).astype(acc)
    return re * re + im * im
  if jnp.iscomplexobj(x):
    nonzero = _exact.nonzero_bits(x.real.astype(acc)) | _exact.nonzero_bits(
        x.imag.astype(acc))
  else:
    nonzero = _exact.nonzero_bits(x.astype(acc))
  return power(magnitude(x, acc), p, nonzero=nonzero)




def here(reduction: Reduction, grouped: Grouped):
  """Reads this device's units out of a vector of every device's (see
  ``Reduction.local``), for ``Group.pick``."""
  return functools.partial(reduction.local, sizes=grouped.sizes)


def _precision_floor(grouped: Grouped, acc, reduction: Reduction) -> jax.Array:
  """Power sums below this may have lost terms to underflow.

  Each flushed term loses at most ``tiny``; with ``n`` terms a sum above
  ``n * tiny / eps`` is still accurate to float precision.
  """
  info = jnp.finfo(acc)
  count = grouped.entries * reduction.device_count()
  return jnp.asarray(float(info.tiny) / float(info.eps), acc) * count


def _rescued_by_fixed_scale(grouped, p, acc, reduction, sums, floor, divisor,
                            *, total: bool) -> jax.Array:
  """``p`` in ``{1, 2}``: the plain pass redone scaled by a fixed power of
  two, where it underflowed (or, for ``p = 2``, overflowed).

  Underflowed sums (below ``floor``) are redone with ``2**(nmant -
  minexp/2)`` (2**86 in float32), which lifts the square of the smallest
  subnormal into the normal range and keeps these sums (under
  ``n * 2**-103``) far from overflow. Overflowed (or NaN) sums of squares
  are redone with ``2**-(maxexp/2 + 1)`` (2**-65), which keeps the square
  of the largest float finite. Others keep ``2**0``: the same terms,
  summed again (in another order XLA may pick: an ulp or two apart).
  """
  info = jnp.finfo(acc)
  down, up = -(info.maxexp // 2 + 1), info.nmant - info.minexp // 2
  squares = is_order(p, 2)
  overflow = ~(sums < jnp.inf) if squares else jnp.zeros_like(sums, bool)
  underflow = (sums < floor) & ~overflow
  mine = here(reduction, grouped)
  scale = _exact.Scale(
      (jnp.where(mine(overflow), 2.0 ** down,
                 jnp.where(mine(underflow), 2.0 ** up, 1)).astype(acc),),
      jnp.where(mine(underflow), 2.0 ** (up + info.minexp - info.nmant),
                0).astype(acc))

  def redo(x, group):
    scaled = scale.pick(group.pick)
    return scaled.square(x, acc) if squares else scaled.magnitude(x, acc)

  redone = reduce(grouped, redo, reduction, maximum=False, total=total)
  roots = (safe_root(redone, 2) if squares else redone) / divisor
  if squares:
    roots = roots * jnp.where(overflow, 2.0 ** -down, 1).astype(acc)
  return jnp.where(underflow, _exact.unscaled(roots, -up), roots)


def _exact_maxima(grouped, acc, reduction: Reduction, *, total: bool
                  ) -> tuple[jax.Array, jax.Array]:
  """``(usable, exponent)`` of each unit's (or all units') largest ``|x|``
  (of a complex leaf: its largest real or imaginary part): its ``frexp``
  exponent, read exactly (subnormal or not), where ``usable`` (finite and
  not 0), else 0."""
  offset = 2 ** jnp.finfo(acc).nmant
  codes = reduce(grouped, lambda x, group: _exact.max_code(x, acc), reduction,
                 maximum=True, total=total, initial=-offset)
  subnormal = codes <= 0
  bits = jnp.where(subnormal,
                   (jnp.where(subnormal, codes, 0) + offset).astype(
                       _exact.integer_type(acc)), _exact.bits(codes))
  usable = (bits > 0) & (bits < _exact.bits(jnp.asarray(jnp.inf, acc)))
  return usable, jnp.where(usable, _exact.exponent_of_bits(bits, acc), 0)


# Up to this order, powers of the rescaled values (largest in [0.5, 1.5))
# keep every term that matters in the normal range; above it the rescue
# divides them by the largest first, at the cost of one more pass.
_SCALED_ORDER_LIMIT = 64


def rescued_roots(grouped, p, acc, reduction, sums, floor, divisor, *,
                   total: bool) -> jax.Array:
  """Norms from power sums of ``|x| / 2**k``, ``2**k`` just above the
  largest ``|x|`` (per unit, or for all units with ``total``).

  Where the largest ``|x|`` is 0 or not finite, the plain sums' root
  stands (their NaN or Inf, or 0).
  """
  del floor  # the scale comes from the largest |x|
  usable, exponents = _exact_maxima(grouped, acc, reduction, total=total)
  scale = _exact.Scale.by(-here(reduction, grouped)(exponents), acc)

  def scaled(x, group):
    return scale.pick(group.pick).magnitude(x, acc)

  peak_divisor = peak_here = None
  if isinstance(p, jax.Array) or p > _SCALED_ORDER_LIMIT:
    peaks = reduce(grouped, scaled, reduction, maximum=True, total=total)
    peak_divisor = jnp.where(usable & (p > _SCALED_ORDER_LIMIT), peaks, 1)
    peak_here = here(reduction, grouped)(peak_divisor)

  def powered(x, group):
    y = scaled(x, group)
    if peak_here is not None:
      y = y / group.pick(peak_here)
    return power(y, p)

  roots = safe_root(reduce(grouped, powered, reduction, maximum=False,
                           total=total), p)
  if peak_divisor is not None:
    roots = roots * peak_divisor
  return jnp.where(usable, _exact.unscaled(roots / divisor, exponents),
                   safe_root(sums, p) / divisor)


def norms_of(grouped: Grouped, p, acc, reduction: Reduction, *,
             total: bool, divisor: jax.Array | np.ndarray | None = None
             ) -> jax.Array:
  """The ``p``-norm of each unit of ``grouped`` (a vector in unit order) or,
  with ``total``, of all of them (a scalar): plain power sums, and the
  rescue only where they fail. With ``divisor`` (one per unit), each norm
  divided by it before any rescaling: an RMS stays finite where the norm
  itself would overflow."""
  if is_order(p, math.inf) and not grouped.complex:
    # A maximum neither overflows nor underflows; a subnormal one is read
    # from its bits (a float maximum reads it as 0 where subnormals flush).
    offset = 2 ** jnp.finfo(acc).nmant
    codes = reduce(grouped, lambda x, _: _exact.max_code(x, acc), reduction,
                   maximum=True, total=total, initial=-offset)
    return _exact.from_max_code(codes, acc)
  sums = reduce(grouped, lambda x, _: elementwise_power(x, p, acc), reduction,
                maximum=is_order(p, math.inf), total=total)
  plain = lambda: safe_root(sums, p) if divisor is None else (  # noqa: E731
      safe_root(sums, p) / divisor)
  if is_order(p, math.inf) or not rescue_enabled():
    return plain()  # (complex leaves: their largest modulus)
  floor = _precision_floor(grouped, acc, reduction)
  if is_order(p, 1):
    # Sums of |x| overflow only when the norm does: only an underflow (of
    # subnormal entries read as 0) needs the rescue.
    needed = sums < floor
  else:
    # Inf and NaN fail both comparisons; the rescue then propagates them.
    needed = ~((sums >= floor) & (sums < jnp.inf))
  fixed = is_order(p, 2) or is_order(p, 1)
  rescued = functools.partial(
      _rescued_by_fixed_scale if fixed else rescued_roots,
      grouped, p, acc, reduction, sums, floor,
      jnp.ones([], acc) if divisor is None else divisor, total=total)
  return lax.cond(any_in_batch(needed), rescued, plain)


@jax.custom_batching.custom_vmap
def any_in_batch(needed: jax.Array) -> jax.Array:
  """Whether any of ``needed`` holds: a rescue's ``lax.cond`` predicate.

  Under ``vmap``, one answer for the whole batch. An answer per example
  would make the ``lax.cond`` a select that runs the rescue for every
  example on every step (3x the run time of a vmapped clip, measured), and
  that selects the operands (the leaves) by it, which an Explicit mesh
  refuses for split leaves. An example that did not need the rescue gets
  its norm from the rescue then, within an ulp or two.
  """
  return jnp.any(needed)


@any_in_batch.def_vmap
def _any_in_batch_vmap(axis_size, in_batched, needed):
  del axis_size, in_batched
  return jnp.any(needed), False
