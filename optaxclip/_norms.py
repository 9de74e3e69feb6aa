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
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from optaxclip import _exact, _tree, _validation
from optaxclip._grouping import Group, Grouped, Keep
from optaxclip._sharding import LOCAL, Reduction, make_reduction

# Transforms reach the sharding module through the core.
from optaxclip._sharding import whole_shapes as whole_shapes

PyTree = Any

# XLA's cost analysis counts both sides of the rescue's ``lax.cond``, though
# the rescue runs only when the plain sums fail: benchmarks/ (and
# tests/test_traffic.py) measure its share with a build that leaves it out
# (False). Never False in a program that trains.
BUILD_RESCUE = True


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
    nonzero = _exact.nonzero_bits(x.real.astype(acc)) | _exact.nonzero_bits(
        x.imag.astype(acc))
  else:
    nonzero = _exact.nonzero_bits(x.astype(acc))
  return _pow(magnitude(x, acc), p, nonzero=nonzero)


def _reduce(grouped: Grouped, elementwise, reduction: Reduction, *,
            maximum: bool, total: bool, initial: float = 0,
            groups: list[Group] | None = None) -> jax.Array:
  """Sums (or maxima, at least ``initial``) of ``elementwise(values, group)``
  per unit over all devices of ``reduction``, as a vector in unit order;
  with ``total``, of all units together, as a scalar. ``groups`` (default
  ``grouped.groups``) may pair the leaves with their tangents.
  """
  groups = grouped.groups if groups is None else groups
  reduce = functools.partial(jnp.max, initial=initial) if maximum else jnp.sum
  across = reduction.max if maximum else reduction.sum
  if total and reduction.replicated_axes is None:
    # Each group reduces to a scalar and these combine by scalar ops: no
    # small vector is reduced (XLA:CPU compiles each small reduction as a
    # costly kernel of its own), and the devices share one all-reduce.
    combine = jnp.maximum if maximum else jnp.add
    return across(functools.reduce(
        combine, [reduce(elementwise(group.values, group))
                  for group in groups]))
  partials = across(grouped.per_unit(groups, elementwise, reduce),
                    grouped.sizes)
  if not total:
    return partials
  return jnp.max(partials) if maximum else jnp.sum(partials)


def _power_sums(grouped, p, acc, reduction: Reduction, *,
                total: bool) -> jax.Array:
  return _reduce(grouped, lambda x, _: _elementwise_power(x, p, acc),
                 reduction, maximum=_is_order(p, math.inf), total=total)


def _exact_maxima(grouped, acc, reduction: Reduction, *, total: bool
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(usable, exponent, peak)`` of each leaf's (or all leaves') largest
  ``|x|`` (of a complex leaf: its largest real or imaginary part).

  ``peak`` is exact, subnormal or not; ``exponent`` is its ``frexp``
  exponent where ``usable`` (finite and not 0), else 0.
  """
  offset = 2 ** jnp.finfo(acc).nmant
  codes = _reduce(grouped, lambda x, group: _exact.max_code(x, acc), reduction,
                         maximum=True, total=total, initial=-offset)
  subnormal = codes <= 0
  bits = jnp.where(subnormal,
                   (jnp.where(subnormal, codes, 0) + offset).astype(
                       _exact.integer_type(acc)), _exact.bits(codes))
  usable = (bits > 0) & (bits < _exact.bits(jnp.asarray(jnp.inf, acc)))
  exponent = jnp.where(usable, _exact.exponent_of_bits(bits, acc), 0)
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


def _rescued_by_fixed_scale(grouped, p, acc, reduction, sums, floor, *,
                            total: bool) -> jax.Array:
  """``p`` in ``{1, 2}``: the plain pass redone scaled by a fixed power of
  two, where it underflowed (or, for ``p = 2``, overflowed).

  Underflowed sums (below ``floor``) are redone with ``2**(nmant -
  minexp/2)`` (2**86 in float32), which lifts the square of the smallest
  subnormal into the normal range and keeps these sums (under
  ``n * 2**-103``) far from overflow. Overflowed (or NaN) sums of squares
  are redone with ``2**-(maxexp/2 + 1)`` (2**-65), which keeps the square
  of the largest float finite. Others keep ``2**0``: the same terms,
  summed again (in another order XLA may pick: an ulp or two apart). One
  pass, no maximum: the usual orders' rescue is a single reduction.
  """
  info = jnp.finfo(acc)
  down, up = -(info.maxexp // 2 + 1), info.nmant - info.minexp // 2
  squares = _is_order(p, 2)
  overflow = ~(sums < jnp.inf) if squares else jnp.zeros_like(sums, bool)
  underflow = (sums < floor) & ~overflow
  here = _here(reduction, grouped)
  scale = _exact.Scale(
      (jnp.where(here(overflow), 2.0 ** down,
                 jnp.where(here(underflow), 2.0 ** up, 1)).astype(acc),),
      jnp.where(here(underflow), 2.0 ** (up + info.minexp - info.nmant),
                0).astype(acc))

  def redo(x, group):
    scaled = scale.pick(group.pick)
    return scaled.square(x, acc) if squares else scaled.magnitude(x, acc)

  redone = _reduce(grouped, redo, reduction, maximum=False, total=total)
  roots = safe_root(redone, 2) if squares else redone
  if squares:
    roots = roots * jnp.where(overflow, 2.0 ** -down, 1).astype(acc)
  return jnp.where(underflow, _exact.unscaled(roots, -up), roots)


# Up to this order, powers of the rescaled values (largest in [0.5, 1.5))
# keep every term that matters in the normal range; above it the rescue
# divides them by the largest first, at the cost of one more pass.
_SCALED_ORDER_LIMIT = 64


def _rescued_roots(grouped, p, acc, reduction, sums, floor, *,
                   total: bool) -> jax.Array:
  """Norms from power sums of ``|x| / 2**k``, ``2**k`` just above the
  largest ``|x|`` (per leaf, or for all leaves with ``total``).

  Where the largest ``|x|`` is 0 or not finite, the plain sums' root
  stands (their NaN or Inf, or 0).
  """
  usable, exponents, _ = _exact_maxima(grouped, acc, reduction, total=total)
  here = _here(reduction, grouped)
  scale = _exact.Scale.by(-here(exponents), acc)

  def scaled(x, group):
    return scale.pick(group.pick).magnitude(x, acc)

  divisor = divisor_here = None
  if isinstance(p, jax.Array) or p > _SCALED_ORDER_LIMIT:
    peaks = _reduce(grouped, scaled, reduction, maximum=True, total=total)
    divisor = jnp.where(usable & (p > _SCALED_ORDER_LIMIT), peaks, 1)
    divisor_here = here(divisor)

  def power(x, group):
    y = scaled(x, group)
    if divisor_here is not None:
      y = y / group.pick(divisor_here)
    return _pow(y, p)

  roots = safe_root(_reduce(grouped, power, reduction, maximum=False,
                                   total=total), p)
  if divisor is not None:
    roots = roots * divisor
  return jnp.where(usable, _exact.unscaled(roots, exponents), safe_root(sums, p))


def _switch_on_order(norm_fn, p: jax.Array) -> jax.Array:
  """Runs ``norm_fn`` with a traced order (``optax.inject_hyperparams``).

  The usual orders keep their fast, exact formulations; any other runs the
  generic ``|x| ** p`` path. Only the selected branch runs.
  """
  branches = [lambda: norm_fn(2.0), lambda: norm_fn(1.0),
              lambda: norm_fn(math.inf), lambda: norm_fn(p)]
  index = jnp.select([p == 2, p == 1, p == jnp.inf], [0, 1, 2], 3)
  return lax.switch(index, branches)


def _by_order(norm_fn) -> Callable[..., jax.Array]:
  """``norm_fn(leaves, p, reduction, keep)``, compiled once per tree
  structure, order, reduction and kept axes.

  Called eagerly, a norm would otherwise re-trace its ``lax.cond`` at every
  call; inside a user's ``jit`` the inner jit is simply inlined. A traced
  order (``optax.inject_hyperparams``) dispatches with ``lax.switch``.
  """
  compiled = jax.jit(norm_fn, static_argnums=(1, 2, 3))

  @functools.wraps(norm_fn)
  def call(leaves: list[jax.Array], p: Any, reduction: Reduction = LOCAL,
           keep: tuple[Keep, ...] | None = None) -> jax.Array:
    if not isinstance(p, jax.Array):
      return compiled(leaves, p, reduction, keep)
    return _switch_on_order(
        lambda q: (norm_fn if isinstance(q, jax.Array) else compiled)(
            leaves, q, reduction, keep), p)

  return call


def _grouped(leaves, keep, reduction: Reduction, *, total: bool) -> Grouped:
  return Grouped(leaves, None if total else keep,
                 merge=total and reduction.replicated_axes is None)


def _here(reduction: Reduction, grouped: Grouped
          ) -> Callable[[jax.Array], jax.Array]:
  """Reads this device's units out of a vector of every device's (see
  ``Reduction.local``), for ``Group.pick``."""
  return functools.partial(reduction.local, sizes=grouped.sizes)


def _norms_of(leaves, p, acc, reduction: Reduction, *, keep,
              total: bool) -> jax.Array:
  """The norms: plain power sums, and the rescue only where they fail."""
  grouped = _grouped(leaves, keep, reduction, total=total)
  sums = _power_sums(grouped, p, acc, reduction, total=total)
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
    rescued = functools.partial(_rescued_by_fixed_scale, grouped, p, acc,
                                reduction, sums, floor, total=total)
  else:
    rescued = functools.partial(_rescued_roots, grouped, p, acc, reduction,
                                sums, floor, total=total)
  if not BUILD_RESCUE:
    return safe_root(sums, p)
  return lax.cond(any_in_batch(needed), rescued,
                  lambda: safe_root(sums, p))


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
                   keep, total: bool, dp: Any = None) -> jax.Array:
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
  grouped = _grouped(leaves, keep, reduction, total=total)
  pairs = grouped.zip(dots)
  mine = _here(reduction, grouped)(norms)  # the norms of these leaves' units
  bits = _exact.bits(mine)
  usable = (bits > 0) & (bits < _exact.bits(jnp.asarray(jnp.inf, acc)))

  if _is_order(p, math.inf):
    def peak(x, group):  # (a zero norm has no usable peak: see `share`)
      a = (_exact.bits(magnitude(x, acc)) if jnp.iscomplexobj(x)
           else _exact.magnitude_bits(x.astype(acc)))
      return a == group.pick(bits)
    counts = _reduce(grouped, lambda x, group: peak(x, group).astype(acc),
                            reduction, maximum=False, total=total)
    share = jnp.where(usable & (counts > 0), 1 / jnp.maximum(counts, 1), 0)

    def weights(x, group):
      return jnp.where(peak(x, group), group.pick(share), 0)
  else:
    scale = _exact.Scale.by(-jnp.where(usable, _exact.exponent_of_bits(bits, acc), 0), acc)
    mantissa = jnp.where(usable, scale.apply(jnp.where(usable, mine, 0)), 1)
    # |x| / norm: 0 for an infinite norm (an overflow of finite |x|), NaN
    # for a NaN one.
    otherwise = jnp.where(jnp.isnan(mine), mine, 0)

    def ratios(x, group):
      ratio = (scale.pick(group.pick).magnitude(x, acc)
               / group.pick(mantissa))
      return jnp.where(group.pick(usable), ratio,
                       group.pick(otherwise))

    def weights(x, group):
      if _is_order(p, 1):
        nonzero = (magnitude(x, acc) > 0 if jnp.iscomplexobj(x)
                   else _exact.nonzero_bits(x.astype(acc)))
        return nonzero.astype(acc)
      return _weights_of_ratios(ratios(x, group), p)

  def terms(pair, group):
    x, dx = pair
    return weights(x, group) * _along(x, dx, acc)

  tangents = _reduce(grouped, terms, reduction, maximum=False, total=total,
                     groups=pairs)
  if dp is None:
    return tangents

  def entropy(x, group):
    r = ratios(x, group)
    positive = r > 0
    safe = jnp.where(positive, r, 1)
    return jnp.where(positive, safe ** p * jnp.log(safe), r * 0)

  by_order = norms / p * _reduce(grouped, entropy, reduction,
                                        maximum=False, total=total)
  return tangents + by_order * dp.astype(acc)


def _p_norms(leaves, p, reduction: Reduction, *, keep: tuple[Keep, ...] | None,
             total: bool) -> jax.Array:
  """The ``p``-norm of each unit (a vector in the accumulation dtype, in
  unit order: see ``Grouped``) or, with ``total``, of all leaves together
  (a scalar).

  Differentiable by the formula (``_norm_tangents``): finite gradients for
  every order and magnitude whose norm is finite, zero at zero. A traced
  order is an argument of its own (a custom derivative may not close over
  a traced value), with its derivative too.
  """
  leaves = [jnp.asarray(x) for x in leaves]
  acc = _tree.accumulation_dtype(leaves)
  if not leaves:
    return jnp.zeros([] if total else [0], acc)
  norms_of = functools.partial(_norms_of, acc=acc, reduction=reduction,
                               keep=keep, total=total)
  tangents_of = functools.partial(_norm_tangents, acc=acc, reduction=reduction,
                                  keep=keep, total=total)

  @functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
  def static(leaves, p):
    return norms_of(leaves, p)

  @static.defjvp
  def static_jvp(p, primals, tangents):
    (leaves,), (dots,) = primals, tangents
    out = static(leaves, p)
    return out, tangents_of(leaves, dots, out, p)

  @jax.custom_jvp
  def traced(leaves, p):
    return norms_of(leaves, p)

  def traced_jvp(primals, tangents):
    (leaves, p), (dots, dp) = primals, tangents
    out = traced(leaves, p)
    dots = [jnp.zeros(x.shape, x.dtype) if isinstance(d, SymbolicZero) else d
            for x, d in zip(leaves, dots)]
    dp = None if isinstance(dp, SymbolicZero) else dp
    return out, tangents_of(leaves, dots, out, p, dp=dp)

  # Symbolic zeros: no pass over the leaves for the order's derivative
  # unless the order is differentiated.
  traced.defjvp(traced_jvp, symbolic_zeros=True)
  if isinstance(p, jax.Array):
    return traced(leaves, p)
  return static(leaves, p)


@_by_order
def norm_of_leaves(leaves, p, reduction, keep):
  """The ``p``-norm of all ``leaves`` taken together, as a scalar."""
  del keep  # a total keeps nothing
  return _p_norms(leaves, p, reduction, keep=None, total=True)


@_by_order
def leaf_norms(leaves, p, reduction, keep):
  """The ``p``-norm of each leaf, as a vector in the accumulation dtype;
  with ``keep`` (per leaf, the axes it keeps), of each unit, as a vector in
  unit order (``units`` splits it per leaf), holding every device's units
  where a kept axis is sharded (``Reduction.local``)."""
  return _p_norms(leaves, p, reduction, keep=keep, total=False)


class Units(NamedTuple):
  """Per-unit norms of some leaves (see ``units``)."""
  here: list[jax.Array]  # per leaf, this device's units, shaped as its kept axes
  everywhere: list[jax.Array]  # per leaf, every device's units (each once), a vector


def units(leaves: list[jax.Array], p: Any, reduction: Reduction,
          keep: tuple[Keep, ...], *, keepdims: bool = False) -> Units:
  """The ``p``-norm of each unit, from one computation and one all-reduce.

  ``here``: per leaf, an array of its kept axes' shape (with ``keepdims``,
  of its rank, to broadcast against it). ``everywhere``: per leaf, the
  norms of its units on all devices, each once, the same on every device
  (where no kept axis is sharded, ``here`` flattened): statistics over all
  units need no second all-reduce.
  """
  grouped = Grouped(leaves, keep, plan=[])
  combined = leaf_norms(leaves, p, reduction, keep)
  counts = reduction.unit_counts(grouped.sizes)
  starts = np.cumsum((0,) + counts)
  everywhere = [lax.slice_in_dim(combined, int(start), int(start) + count)
                for start, count in zip(starts, counts)]
  here = [part.reshape(shape) for part, shape in zip(
      reduction.local_parts(combined, grouped.sizes),
      grouped.unit_shapes(leaves, keepdims=keepdims))]
  return Units(here, everywhere)


def unit_norms(leaves: list[jax.Array], p: Any, reduction: Reduction,
               keep: tuple[Keep, ...], *, keepdims: bool = False
               ) -> list[jax.Array]:
  """``units(...).here``: per leaf, the norms of this device's units."""
  return units(leaves, p, reduction, keep, keepdims=keepdims).here


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
  grouped = Grouped(leaves)
  local = jnp.all(grouped.per_unit(grouped.groups,
                                   lambda x, _: jnp.isfinite(x), jnp.all))
  if not axis_names:
    return local
  return lax.pmin(local.astype(jnp.int32), axis_names).astype(jnp.bool_)
