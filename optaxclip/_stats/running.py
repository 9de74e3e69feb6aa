"""Running statistics of gradient norms that one outlier cannot take over.

The adaptive transforms (``zclip``, ``skip_step``'s z-score, ``adagc``) keep
exponential moving averages (EMAs) of past norms. In the plain EMAs of their
reference implementations one finite norm of any size takes over: its
squared deviation overflows the variance (above ~1.8e19 in float32), or its
weight needs ``log(size) / (1 - decay)`` steps to fade, and meanwhile no
spike is found. Here one value's influence is bounded by ``OUTLIER_RATIO``,
whatever its size, and ordinary norms (within that ratio of the level) give
exactly the reference numbers:

- ``capped``: a value fed to a running mean counts as at most
  ``OUTLIER_RATIO`` times it (winsorized);
- ``robust_moments``: the moments of a warm-up buffer leave out values more
  than ``OUTLIER_RATIO`` times its median;
- ``far_above``: whether a value is an outlier against a level (kept out);
- ``stale_streak``: whether statistics are stale: ``RESTART_AFTER`` values
  in a row more than ``OUTLIER_RATIO`` times below their mean, as after an
  outlier too early to be recognised (the first value): the transform then
  starts them again;
- ``capped_signed`` and ``far_from``: ``capped`` and ``far_below`` for
  values of any sign (a loss): the cap is ``OUTLIER_RATIO`` times the level
  ``|mean| + std`` away from the mean, and a value is far from a level
  more than ``OUTLIER_RATIO`` times its own size away (``streak_of``
  counts those streaks);
- ``ema``: the EMA step of a mean and a standard deviation;
- ``frame``: the power of two every moment is computed relative to;
- ``safe_sqrt``: the standard deviation, with a finite gradient at a zero
  variance (a constant history).

Statistics keep the standard deviation, never the variance, and compute
moments on values divided by a power of two near the largest of them
(``frame``): a variance underflows where the values' squares do (below
~1e-19 in float32, where a 5% spread of norms of 1e-18 reads as 0 and every
value above the mean as a spike) and overflows above ~1.8e19. So the
decisions are the same for values ``x`` and ``x * 2**k`` (while the values
and their standard deviation are normal floats), and at ordinary
magnitudes the numbers are the plain formulas' (dividing by a power of two
is exact).

Statistics are kept in ``statistics_dtype(params)``: float32, or float64
when x64 is on and a parameter is float64, so that a norm beyond float32's
range (finite float64 gradients) stays finite.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from optaxclip import _tree

PyTree = Any

# A value more than this many times the level of a statistic is an outlier.
# Far above any ordinary step-to-step change of a gradient norm (loss spikes
# of 10-30x still count in full), far below the 1e3x where a single value
# starts to dominate an EMA for hundreds of steps.
OUTLIER_RATIO = 100.0
# Statistics that this many values in a row find far above them (every value
# more than OUTLIER_RATIO times below their mean) are stale: they start again.
# More than one, so that a single zero norm does not throw a history away.
RESTART_AFTER = 3


def statistics_dtype(params: PyTree) -> jnp.dtype:
  """The float dtype of a state's statistics for ``params`` given to ``init``.

  The dtype the norms of ``params`` accumulate in: float32, or float64 when
  x64 is on and a leaf is float64 (or complex128). Leaves without a dtype
  (Python floats, like ``None``) do not widen it; ``jax.ShapeDtypeStruct``
  leaves count by their dtype.
  """
  leaves = [x for x in _tree.clippable_leaves(params) if hasattr(x, "dtype")]
  return _tree.accumulation_dtype(leaves)


@jax.custom_jvp
def safe_sqrt(x: jax.Array) -> jax.Array:
  """``sqrt(max(x, 0))``, with a zero (not NaN) gradient at 0.

  A custom JVP rather than a ``where`` around the root: the forward pass is
  the plain ``sqrt``, which XLA fuses (with a multiply-add) as before.
  """
  return jnp.sqrt(jnp.maximum(x, 0))


@safe_sqrt.defjvp
def _safe_sqrt_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  root = safe_sqrt(x)
  positive = root > 0
  return root, jnp.where(positive, dx / (2 * jnp.where(positive, root, 1)), 0)


def frame(*values: jax.Array) -> jax.Array:
  """A power of two near the largest finite ``|value|`` of ``values``.

  ``2**(e - 1)`` for the largest ``m * 2**e`` (``0.5 <= m < 1``), within
  the dtype's normal range: values divided by it are at most 2 in size
  (their squares neither overflow nor, for the largest, underflow), and the
  same for ``values * 2**k`` (the division is exact for normal floats).
  """
  largest = functools.reduce(jnp.maximum, [
      jnp.max(jnp.where(jnp.isfinite(v), jnp.abs(v), 0)) for v in values])
  # A constant for gradients: x / scale * scale is x, whatever the scale.
  largest = jax.lax.stop_gradient(largest)
  _, exponent = jnp.frexp(largest)
  info = jnp.finfo(largest.dtype)
  exponent = jnp.clip(exponent - 1, info.minexp, info.maxexp - 1)
  return jnp.ldexp(jnp.ones([], largest.dtype), exponent)


def to_statistics(x: jax.Array, dtype) -> jax.Array:
  """``x`` (a norm, in its accumulation dtype) in the statistics' ``dtype``:
  a finite value beyond that dtype's range saturates at its largest float
  rather than becoming Inf (float64 gradients under x64 with float32
  statistics: a finite norm must not count as non-finite). Factors are
  computed from ``x`` itself."""
  if jnp.dtype(x.dtype) == jnp.dtype(dtype):
    return x
  largest = jnp.finfo(dtype).max
  return jnp.where(jnp.isfinite(x), jnp.clip(x, -largest, largest), x).astype(dtype)


def saturate(x: jax.Array) -> jax.Array:
  """``x`` with ``+inf`` (an overflow) replaced by the largest finite float."""
  return jnp.minimum(x, jnp.finfo(x.dtype).max)


def capped(value: jax.Array, level: jax.Array) -> jax.Array:
  """``value``, at most ``OUTLIER_RATIO * level`` where ``level > 0``."""
  limit = jnp.asarray(OUTLIER_RATIO, level.dtype) * level
  return jnp.where(level > 0, jnp.minimum(value, limit), value)


def far_below(value: jax.Array, level: jax.Array) -> jax.Array:
  """Whether ``value`` is more than ``OUTLIER_RATIO`` times below ``level``.

  True for every finite ``value`` when ``level`` is ``+inf`` (nothing seen).
  """
  return value * jnp.asarray(OUTLIER_RATIO, value.dtype) < level


def stale_streak(streak: jax.Array, value: jax.Array, mean: jax.Array,
                 counts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The streak of values far below ``mean``, and whether to restart.

  ``streak`` counts the steps in a row, among those where ``counts``, whose
  ``value`` was more than ``OUTLIER_RATIO`` times below ``mean``; other
  steps leave it unchanged. Returns the new streak (0 after a restart) and
  whether it reached ``RESTART_AFTER`` at this step.
  """
  return streak_of(streak, far_below(value, mean), counts)


def streak_of(streak: jax.Array, far: jax.Array,
              counts: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``stale_streak`` for a given ``far`` (whether this step's value is far
  from the statistics' level)."""
  streak = jnp.where(counts, jnp.where(far, streak + 1, 0), streak)
  restart = streak >= RESTART_AFTER
  return jnp.where(restart, 0, streak).astype(jnp.int32), restart


def far_above(value: jax.Array, level: jax.Array) -> jax.Array:
  """Whether ``value`` is more than ``OUTLIER_RATIO`` times ``level``."""
  return value > jnp.asarray(OUTLIER_RATIO, level.dtype) * level


def capped_signed(value: jax.Array, mean: jax.Array,
                  std: jax.Array) -> jax.Array:
  """``value``, within ``OUTLIER_RATIO * (|mean| + std)`` of ``mean``
  where that is > 0 (winsorized), for values of any sign.

  The distance is at most half the largest float, so that ``value - mean``
  (two finite values of opposite signs) never overflows in ``ema``.
  """
  limit = jnp.minimum(jnp.asarray(OUTLIER_RATIO, mean.dtype) *
                      (jnp.abs(mean) + std), jnp.finfo(mean.dtype).max / 2)
  return jnp.where(limit > 0, jnp.clip(value, mean - limit, mean + limit),
                   value)


def far_from(value: jax.Array, level: jax.Array) -> jax.Array:
  """Whether ``|value - level| > OUTLIER_RATIO * |value|``: ``value`` is
  tiny against ``level`` (for values >= 0, ``far_below`` with a ratio of
  ``OUTLIER_RATIO + 1``), of either sign."""
  return (jnp.abs(value - level) >
          jnp.asarray(OUTLIER_RATIO, value.dtype) * jnp.abs(value))


def robust_moments(values: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean and population standard deviation of ``values`` without their
  outliers.

  Values above ``OUTLIER_RATIO`` times the median are left out (none when
  the median is 0: there is no scale to compare with); with none left out
  the result is ``mean(values)`` and ``sqrt(mean((values - mean)**2))``,
  computed in the kept values' ``frame``.
  """
  median = jnp.median(values)
  keep = ~((median > 0) & far_above(values, median))
  scale = frame(jnp.where(keep, values, 0))
  scaled = values / scale
  count = jnp.sum(keep).astype(values.dtype)
  kept_mean = jnp.sum(jnp.where(keep, scaled, 0)) / count
  kept_var = jnp.sum(jnp.where(keep, jnp.square(scaled - kept_mean), 0)) / count
  # With nothing left out, the plain formulas' very bits.
  mean = jnp.mean(scaled)
  var = jnp.mean(jnp.square(scaled - mean))
  all_kept = jnp.all(keep)
  return (jnp.where(all_kept, mean, kept_mean) * scale,
          saturate(safe_sqrt(jnp.where(all_kept, var, kept_var)) * scale))


def ema_mean(mean: jax.Array, value: jax.Array, decay: jax.Array) -> jax.Array:
  """``decay * mean + (1 - decay) * value``."""
  return decay * mean + (1 - decay) * value


def ema(mean: jax.Array, std: jax.Array, value: jax.Array, decay: jax.Array,
        *, zclip: bool = False) -> tuple[jax.Array, jax.Array]:
  """The EMA mean and standard deviation after one more ``value``.

  With ``delta = value - mean``, ``var = std**2`` and ``d = decay``:

  - by default, ``mean + (1 - d) * delta`` and ``d * (var + (1 - d) *
    delta**2)``: the weighted mean and variance, updated in the incremental
    form free of the cancellation of ``E[x**2] - E[x]**2`` (West 1979);
    ``d == 0`` starts the statistics at ``value``, with variance 0;
  - with ``zclip``, ZClip's ``d * mean + (1 - d) * value`` and
    ``d * var + (1 - d) * (value - new_mean)**2``.

  Computed in the ``frame`` of the three (no square under- or overflows);
  the standard deviation saturates at the largest float.
  """
  scale = frame(mean, std, value)
  mean, std, value = mean / scale, std / scale, value / scale
  delta = value - mean
  if zclip:
    # value - new_mean is decay * delta: no cancellation near the mean.
    new = ema_mean(mean, value, decay)
    var = decay * jnp.square(std) + (1 - decay) * jnp.square(decay * delta)
  else:
    new = mean + (1 - decay) * delta
    var = decay * (std * std + (1 - decay) * delta * delta)
  return new * scale, saturate(safe_sqrt(var) * scale)


def bias_corrected_decay(decay: jax.Array, count: jax.Array) -> jax.Array:
  """``decay * (1 - decay**n) / (1 - decay**(n+1))`` with ``n = count``.

  The decay that makes an EMA started at 0 the exact weighted mean (weights
  ``decay ** age``) of the ``n + 1`` values it has seen (Shazeer & Stern
  2018, sec. 7.1): 0 for the first value, so the statistics never depend on
  their initial value.
  """
  n = count.astype(decay.dtype)
  return decay * (1 - decay**n) / (1 - decay**(n + 1))
