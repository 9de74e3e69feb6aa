"""Spike statistics of one guarded value (a norm or a loss), as pure functions.

``skip_step`` judges each value it guards against statistics of that
value's past, then feeds the statistics once every guard has spoken (a step
skipped for its loss must not feed the norm's EMA). So each mode has a
verdict and a feed, and ``verdict``/``feed`` dispatch on the statistics:

- EMA mode (``window`` None): ``ema_verdict`` / ``ema_feed``: exponential
  moving averages of the accepted values, winsorized (``_stats.running``);
- window mode: ``window_verdict`` / ``window_feed``: the plain mean and
  Bessel standard deviation of the last ``N`` finite values, skipped ones
  included (OLMo-core's and MaxText's rule), ``N`` floats of state.

A ``Verdict`` says whether the value is a spike (a z-score above the
threshold once the warm-up is over) and whether the statistics start
again from it. The rules that keep any finite sequence from stalling the
guard, and their bounds, are argued in docs/guards.md.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from optaxclip._stats import counters, running
from optaxclip._types import Scalar


class Running(NamedTuple):
  """Running statistics of one guarded value (``float``: the state's).

  Attributes:
    mean: float ``[]``: the mean of the values in the statistics.
    std: float ``[]``: their standard deviation (not the variance, which
      underflows for values below ~1e-19 in float32: ``_stats.running``).
    count: int32 ``[]``: values in the statistics since they last started.
    streak: int32 ``[]``: values in a row the statistics disagree with;
      ``RESTART_AFTER`` start them again (EMA mode).
    window: float ``[N]``: the last ``N`` finite values, oldest first
      (window mode; the last ``count`` hold values); None in EMA mode.
  """
  mean: jax.Array
  std: jax.Array
  count: jax.Array
  streak: jax.Array
  window: jax.Array | None = None

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike,
            window: int | None = None) -> "Running":
    """The statistics before the first value, their floats in ``dtype``;
    a ``window`` of that many values, or EMAs (None)."""
    return cls(mean=jnp.zeros([], dtype), std=jnp.zeros([], dtype),
               count=counters.zero(), streak=counters.zero(),
               window=None if window is None else jnp.zeros([window], dtype))


class Verdict(NamedTuple):
  """What the statistics say of one value.

  Attributes:
    spike: bool ``[]``: a finite value above ``mean + zscore * std`` (or
      that far from the mean either way, two-sided), after the warm-up.
    restart: bool ``[]``: the statistics start again from this value.
    disagrees: bool ``[]``: young statistics do not take this value in
      full (it is a spike, or beyond their winsorizing cap).
    z: float ``[]``: ``(value - mean) / std``: 0 during the warm-up for a
      finite value, +-inf off a zero ``std``, NaN for NaN.
  """
  spike: jax.Array
  restart: jax.Array
  disagrees: jax.Array
  z: jax.Array


def _in_frame(stats: Running, value: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
  """``value - mean`` and ``std`` in their ``running.frame``: the same
  for values times any power of two (no difference underflows)."""
  scale = running.frame(value, stats.mean, stats.std)
  return value / scale - stats.mean / scale, stats.std / scale


def zscore_of(stats: Running, value: jax.Array, active: jax.Array
              ) -> jax.Array:
  """``(value - mean) / std``; 0 while not ``active`` for a finite value,
  +-inf above or below a zero ``std`` (a constant history)."""
  deviation, std = _in_frame(stats, value)
  positive = std > 0
  z = jnp.where(positive, deviation / jnp.where(positive, std, 1),
                jnp.where(deviation == 0, 0, jnp.sign(deviation) * jnp.inf))
  return jnp.where(active | ~jnp.isfinite(value), z, 0).astype(value.dtype)


def is_spike(stats: Running, value: jax.Array, zscore: Scalar | None,
             active: jax.Array, two_sided: bool) -> jax.Array:
  """Whether a finite, ``active`` value is more than ``zscore`` standard
  deviations above the mean (or away from it, ``two_sided``)."""
  if zscore is None:
    return jnp.zeros([], bool)
  deviation, std = _in_frame(stats, value)
  if two_sided:
    deviation = jnp.abs(deviation)
  # A product, not z: at zscore=inf nothing is a spike (inf * 0 is NaN).
  limit = jnp.asarray(zscore, value.dtype) * std
  return jnp.isfinite(value) & active & (deviation > limit)


def _capped(stats: Running, value: jax.Array, signed: bool) -> jax.Array:
  """``value`` as the EMA takes it in (winsorized, ``_stats.running``)."""
  if signed:
    return running.capped_signed(value, stats.mean, stats.std)
  return running.capped(value, stats.mean)


def ema_verdict(stats: Running, value: jax.Array, *, zscore: Scalar | None,
                warmup_steps: Scalar, two_sided: bool = False,
                signed: bool = False) -> Verdict:
  """The EMA statistics' verdict on ``value`` (in their dtype).

  The z-test starts once ``max(warmup_steps, 1)`` values were fed. Young
  statistics (fewer than ``RESTART_AFTER`` values past that) disagree with
  a finite value they would not take in full, a spike or one beyond their
  cap; ``RESTART_AFTER`` such values in a row (as when an outlier was the
  first value) start them again from the last one, which is then no spike.
  ``signed``: values of any sign (a loss), else >= 0 (a norm).
  """
  start = jnp.maximum(warmup_steps, 1)
  active = stats.count >= start
  spike = is_spike(stats, value, zscore, active, two_sided)
  young = stats.count < start + running.RESTART_AFTER
  beyond = _capped(stats, value, signed) != value
  disagrees = jnp.isfinite(value) & young & (beyond | spike)
  restart = disagrees & (stats.streak + 1 >= running.RESTART_AFTER)
  return Verdict(spike=spike & ~restart, restart=restart, disagrees=disagrees,
                 z=zscore_of(stats, value, active))


def ema_feed(stats: Running, value: jax.Array, verdict: Verdict, *,
             accepted: jax.Array, release: jax.Array, decay: Scalar,
             signed: bool = False) -> Running:
  """The EMA statistics after a step with ``value`` and its ``verdict``.

  An ``accepted`` value feeds the bias-corrected EMA
  (``running.bias_corrected_decay``): winsorized, or in full when
  it is a spike let through by ``release`` (a lasting level, see
  ``skip_step``). ``RESTART_AFTER`` accepted values in a row far below the
  mean (or, ``signed``, tiny against their distance to it), or young
  statistics' disagreements, start the statistics again from the last.
  """
  d = running.bias_corrected_decay(
      jnp.asarray(decay, stats.mean.dtype), stats.count)
  fed = jnp.where(release & verdict.spike, value,
                  _capped(stats, value, signed))
  mean, std = running.ema(stats.mean, stats.std, fed, d)
  below = (running.far_from(value, stats.mean) if signed
           else running.far_below(value, stats.mean))
  streak, restart = running.streak_of(
      stats.streak, verdict.disagrees | (accepted & below),
      accepted | verdict.disagrees)
  return stats._replace(
      mean=jnp.where(restart, value, jnp.where(accepted, mean, stats.mean)),
      std=jnp.where(restart, 0, jnp.where(accepted, std, stats.std)),
      count=jnp.where(restart, 1, counters.count_if(accepted, stats.count)),
      streak=streak)


def window_moments(window: jax.Array, count: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """Mean and Bessel standard deviation (``n - 1``, at least 1) of the
  last ``count`` values of ``window``, as MaxText's
  ``_compute_rolling_stats``.

  Computed in the values' ``running.frame`` (exact: the same roundings),
  so that neither the sum nor the squares over- or underflow; the standard
  deviation saturates at the largest float.
  """
  size = window.shape[0]
  valid = jnp.arange(size) >= size - count
  scale = running.frame(jnp.where(valid, window, 0))
  scaled = jnp.where(valid, window / scale, 0)
  n = count.astype(window.dtype)
  mean = jnp.sum(scaled) / jnp.maximum(n, 1)
  var = (jnp.sum(jnp.where(valid, jnp.square(scaled - mean), 0)) /
         jnp.maximum(n - 1, 1))
  return mean * scale, running.saturate(running.safe_sqrt(var) * scale)


def window_verdict(stats: Running, value: jax.Array, *,
                   zscore: Scalar | None, warmup_steps: Scalar,
                   two_sided: bool = False) -> Verdict:
  """The window's verdict on ``value``: the z-test against the values
  before it, once ``max(warmup_steps, 1)`` (at most ``N``) are in."""
  assert stats.window is not None
  start = jnp.minimum(jnp.maximum(warmup_steps, 1), stats.window.shape[0])
  active = stats.count >= start
  never = jnp.zeros([], bool)
  return Verdict(spike=is_spike(stats, value, zscore, active, two_sided),
                 restart=never, disagrees=never,
                 z=zscore_of(stats, value, active))


def window_feed(stats: Running, value: jax.Array) -> Running:
  """The window after a step with ``value``: every finite value goes in,
  skipped or not (so that a lasting level becomes the baseline)."""
  assert stats.window is not None
  finite = jnp.isfinite(value)
  window = jnp.where(finite, jnp.roll(stats.window, -1).at[-1].set(value),
                     stats.window)
  count = jnp.where(finite, jnp.minimum(stats.count + 1, window.shape[0]),
                    stats.count).astype(jnp.int32)
  mean, std = window_moments(window, count)
  return stats._replace(mean=mean, std=std, count=count, window=window)


def default_warmup(stats: Running) -> int:
  """``warmup_steps`` when not given: 100 values for the EMAs; for a
  window of ``N``, OLMo-core's and MaxText's ``max(2, N // 2) - 1``
  values before the one judged."""
  if stats.window is None:
    return 100
  return max(2, stats.window.shape[0] // 2) - 1


def verdict(stats: Running, value: jax.Array, *, zscore: Scalar | None,
            warmup_steps: Scalar, two_sided: bool, signed: bool) -> Verdict:
  """``ema_verdict`` or ``window_verdict``, by the statistics' mode."""
  if stats.window is None:
    return ema_verdict(stats, value, zscore=zscore, warmup_steps=warmup_steps,
                       two_sided=two_sided, signed=signed)
  return window_verdict(stats, value, zscore=zscore,
                        warmup_steps=warmup_steps, two_sided=two_sided)


def feed(stats: Running, value: jax.Array, judged: Verdict, *,
         accepted: jax.Array, release: jax.Array, decay: Scalar,
         signed: bool) -> Running:
  """``ema_feed`` or ``window_feed``, by the statistics' mode."""
  if stats.window is None:
    return ema_feed(stats, value, judged, accepted=accepted, release=release,
                    decay=decay, signed=signed)
  return window_feed(stats, value)
