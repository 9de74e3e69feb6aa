"""The derivative of every norm, by formula.

``d norm = sum sign(x) (|x| / norm)**(p - 1) dx`` (for ``inf``: ``d|x|`` at
the largest ``|x|``, shared by ties), plus, for a traced order,
``norm / p * sum r**p log r * dp`` with ``r = |x| / norm``. ``r`` is formed
from exact powers of two and a division by ``norm``'s mantissa, so no step
overflows or loses a subnormal, whatever the magnitude: finite and right
wherever the norm is finite, 0 at 0. Differentiating the computation
itself would multiply a zero cotangent by the infinite derivative of an
overflowed plain sum (the rescue's branch not taken) and give NaN.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optaxclip._core import _exact
from optaxclip._core._batching import Grouped, reduce
from optaxclip._core._mesh import Reduction
from optaxclip._core._sums import here, integer_power, is_order, magnitude


def weights_of_ratios(r: jax.Array, p: Any) -> jax.Array:
  """``r ** (p - 1)``: the derivative of a ``p``-norm by ``|x|``, with
  ``r = |x| / norm`` in ``[0, 1]``; 0 where ``r`` is 0, NaN where NaN."""
  if is_order(p, 2):
    return r
  k = integer_power(p)
  if k is not None:
    return lax.integer_pow(r, k - 1)
  if not isinstance(p, jax.Array) and p > 1:
    return r ** (p - 1)
  positive = r > 0  # p < 1 (or traced): no 0 ** negative
  return jnp.where(positive, jnp.where(positive, r, 1) ** (p - 1), r * 0)


def along(values: jax.Array, dots: jax.Array, acc) -> jax.Array:
  """``d|x|`` along ``dx``: ``sign(x) * dx``, or for complex ``x`` the part
  of ``dx`` along ``x / |x|`` (0 at ``x = 0``)."""
  if jnp.iscomplexobj(values):
    modulus = jnp.abs(values)
    nonzero = modulus > 0
    unit = jnp.where(nonzero, values / jnp.where(nonzero, modulus, 1), 0)
    return jnp.real(jnp.conj(unit) * dots).astype(acc)
  # The sign from the sign bit: a subnormal's is read right.
  return jnp.where(jnp.signbit(values), -dots, dots).astype(acc)


def _peak_weights(grouped: Grouped, acc, reduction: Reduction, bits, usable,
                  total: bool):
  """``inf``: the weight of each entry, 1/ties at a unit's largest ``|x|``."""
  def peak(x, group):  # (a zero norm has no usable peak: see `share`)
    a = (_exact.bits(magnitude(x, acc)) if jnp.iscomplexobj(x)
         else _exact.magnitude_bits(x.astype(acc)))
    return a == group.pick(bits)
  counts = reduce(grouped, lambda x, group: peak(x, group).astype(acc),
                  reduction, maximum=False, total=total)
  share = jnp.where(usable & (counts > 0), 1 / jnp.maximum(counts, 1), 0)
  return lambda x, group: jnp.where(peak(x, group), group.pick(share), 0)


def _ratios(mine, bits, usable, acc):
  """``|x| / norm`` per entry, from exact powers of two: 0 for an infinite
  norm (an overflow of finite |x|), NaN for a NaN one."""
  scale = _exact.Scale.by(-jnp.where(usable, _exact.exponent_of_bits(bits, acc), 0), acc)
  mantissa = jnp.where(usable, scale.apply(jnp.where(usable, mine, 0)), 1)
  otherwise = jnp.where(jnp.isnan(mine), mine, 0)

  def ratios(x, group):
    ratio = scale.pick(group.pick).magnitude(x, acc) / group.pick(mantissa)
    return jnp.where(group.pick(usable), ratio, group.pick(otherwise))
  return ratios


def norm_tangents(grouped: Grouped, dots, norms, p, acc, reduction: Reduction,
                  *, total: bool, dp: Any = None) -> jax.Array:
  """The derivative of the norms of ``grouped`` along ``dots`` (the
  leaves' tangents, grouped as the leaves are) and ``dp`` (a traced
  order's)."""
  mine = here(reduction, grouped)(norms)  # the norms of these leaves' units
  bits = _exact.bits(mine)
  usable = (bits > 0) & (bits < _exact.bits(jnp.asarray(jnp.inf, acc)))
  ratios = None if is_order(p, math.inf) else _ratios(mine, bits, usable, acc)
  if ratios is None:
    weights = _peak_weights(grouped, acc, reduction, bits, usable, total)
  elif is_order(p, 1):
    def weights(x, group):
      del group
      nonzero = (magnitude(x, acc) > 0 if jnp.iscomplexobj(x)
                 else _exact.nonzero_bits(x.astype(acc)))
      return nonzero.astype(acc)
  else:
    def weights(x, group):
      assert ratios is not None
      return weights_of_ratios(ratios(x, group), p)

  def terms(pair, group):
    x, dx = pair
    return weights(x, group) * along(x, dx, acc)

  tangents = reduce(grouped, terms, reduction, maximum=False, total=total,
                    groups=grouped.zip(dots))
  if dp is None:
    return tangents

  def entropy(x, group):
    assert ratios is not None  # a traced order is never inf
    r = ratios(x, group)
    positive = r > 0
    safe = jnp.where(positive, r, 1)
    return jnp.where(positive, safe ** p * jnp.log(safe), r * 0)

  by_order = norms / p * reduce(grouped, entropy, reduction, maximum=False,
                                total=total)
  return tangents + by_order * dp.astype(acc)
