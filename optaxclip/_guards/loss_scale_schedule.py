"""The loss-scale schedule: its state, the pure ``adjust``, and the floor.

One rule covers PyTorch's ``GradScaler``, DeepSpeed's ``DynamicLossScaler``
and Megatron-LM's ``DynamicGradScaler`` (their differences are settings; the
derivations are in ``docs/migration/pytorch.md``)::

  on an overflow:  good_steps = -growth_delay
                   if hysteresis_left <= 1:  scale = max(min_scale, scale / factor)
                   else:                     hysteresis_left -= 1
  on a finite step: good_steps += 1
                   if good_steps >= period:  scale *= factor, good_steps = 0,
                                             hysteresis_left = hysteresis
                   if consecutive_hysteresis: hysteresis_left = hysteresis

``adjust`` takes one decision (one optimizer step); what counts as a step
(a micro-batch, or a window of them) is the transform's business.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer

from optaxclip._clip.on_nonfinite import NonFiniteGradientError
from optaxclip._stats import counters

# The largest loss scale: GradScaler grows while the grown float32 is finite
# (2**127 with factor 2). Unscaling takes 1/scale as two normal factors.
MAX_SCALE = float(np.finfo(np.float32).max)
# The smallest: below it the scale itself is subnormal (flushed to zero).
MIN_SCALE = 2.0**-126


def reciprocal(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``1/scale`` as two normal float32 factors (the second 1 up to 2**126):
  above 2**126 ``1/scale`` itself is subnormal, and XLA flushes it to zero.
  Exact for powers of two, as GradScaler's ``1/scale``."""
  second = jnp.where(scale > 2.0**126, jnp.float32(0.25), jnp.float32(1))
  return 1 / (scale * second), second


def unscale_leaf(x: jax.Array, inverse: tuple[jax.Array, jax.Array]
                 ) -> jax.Array:
  """``x`` times both factors of ``reciprocal``: half precision in float32,
  rounded once. The first product is at least the result (a scale above
  1), so it underflows only where the result does."""
  unscaled = x * inverse[0] * inverse[1]
  return unscaled if unscaled.dtype == x.dtype else unscaled.astype(x.dtype)


class LossScaleState(NamedTuple):
  """State of ``dynamic_loss_scale``; every field is a scalar.

  Attributes:
    scale: float32 ``[]``: the loss scale for the next step (multiply the
      loss by it before ``jax.grad``).
    good_steps: int32 ``[]``: finite optimizer steps since the last overflow
      or growth (it restarts at ``-growth_delay`` after an overflow).
    hysteresis: int32 ``[]``: overflows left before the next back-off (1:
      the next overflow backs off); DeepSpeed's ``cur_hysteresis``.
    count: int32 ``[]``: updates seen (micro-batches, with ``every_k_steps``).
    overflow_count: int32 ``[]``: updates whose gradients overflowed.
    min_scale_overflow_count: int32 ``[]``: back-offs due at ``min_scale``,
      where the scale cannot go lower: the run is broken.
    micro_step: int32 ``[]``: micro-batches into the current window.
    window_overflows: int32 ``[]``: how many of them overflowed.
    window_norm: float32 ``[]``: the sum of their unscaled norms, a bound
      on every entry of the window's sum (see ``dynamic_loss_scale``).
  """
  scale: jax.Array
  good_steps: jax.Array
  hysteresis: jax.Array
  count: jax.Array
  overflow_count: jax.Array
  min_scale_overflow_count: jax.Array
  micro_step: jax.Array
  window_overflows: jax.Array
  window_norm: jax.Array

  @classmethod
  def fresh(cls, scale: jax.typing.ArrayLike, *,
            hysteresis: jax.typing.ArrayLike = 1,
            growth_delay: jax.typing.ArrayLike = 0) -> "LossScaleState":
    """The state before the first step, with the loss scale ``scale``."""
    # Copies: the state must not alias the user's (or an injected) array,
    # or donating the state would delete it, or donate one buffer twice.
    # At most MAX_SCALE (a traced initial_scale is clamped to it).
    return cls(scale=jnp.minimum(jnp.array(scale, jnp.float32, copy=True),
                                 MAX_SCALE),
               good_steps=-jnp.array(growth_delay, jnp.int32, copy=True),
               hysteresis=jnp.array(hysteresis, jnp.int32, copy=True),
               count=counters.zero(), overflow_count=counters.zero(),
               min_scale_overflow_count=counters.zero(),
               micro_step=counters.zero(), window_overflows=counters.zero(),
               window_norm=jnp.zeros([], jnp.float32))


class Schedule(NamedTuple):
  """The settings of ``adjust`` (checked; traced when injected)."""
  period: Any
  factor: Any
  min_scale: Any
  hysteresis: Any = 1
  consecutive_hysteresis: bool = False
  growth_delay: Any = 0


def adjust(state: LossScaleState, finite: jax.Array, schedule: Schedule
           ) -> tuple[LossScaleState, jax.Array]:
  """The state after one optimizer step (see the module docstring), and
  whether a back-off was due at ``min_scale``. Growth stops where the grown
  scale would not be a finite float32, as GradScaler's (good_steps and
  hysteresis still restart)."""
  s = schedule
  scale, left = state.scale, state.hysteresis
  factor = jnp.asarray(s.factor, jnp.float32)
  min_scale = jnp.asarray(s.min_scale, jnp.float32)
  full = jnp.asarray(s.hysteresis, jnp.int32)
  grow = finite & (state.good_steps + 1 >= s.period)
  back_off = ~finite & (left <= 1)
  grown = scale * factor
  new_scale = jnp.where(grow & (grown <= MAX_SCALE), grown, jnp.where(
      back_off, jnp.maximum(min_scale, scale / factor), scale))
  good = jnp.where(grow, jnp.zeros([], jnp.int32),
                   counters.increment(state.good_steps))
  refill = (finite if s.consecutive_hysteresis else grow)
  # DeepSpeed keeps 1 once hysteresis is spent: each overflow then backs off.
  left = jnp.where(refill, full, jnp.where(finite | back_off, left, left - 1))
  at_floor = back_off & (scale <= min_scale)
  return state._replace(
      scale=new_scale.astype(jnp.float32),
      good_steps=jnp.where(finite, good, -jnp.asarray(s.growth_delay, jnp.int32)),
      hysteresis=left.astype(jnp.int32),
      min_scale_overflow_count=counters.count_if(
          at_floor, state.min_scale_overflow_count)), at_floor


class MinLossScaleError(NonFiniteGradientError):
  """The gradients overflowed at ``min_scale`` with
  ``raise_error_at_min_scale=True`` (caught as
  ``optaxclip.NonFiniteGradientError`` too).

  Under ``jit`` JAX reports it wrapped in its ``JaxRuntimeError``, which is a
  ``RuntimeError`` too, with this message at its end.
  """


def _raise_if(fn: str, at_floor, scale) -> None:
  # Under vmap the cond below becomes a select and this runs on every step,
  # so it decides from the values, not from being called.
  if bool(at_floor):
    raise MinLossScaleError(
        f"`{fn}`: the gradients overflowed (NaN or Inf) at the smallest loss "
        f"scale, min_scale={float(scale)}, so the scale cannot back off: "
        f"the NaN/Inf is not a float16 overflow (look for a NaN loss, bad "
        f"data or a diverging run). Pass raise_error_at_min_scale=False to "
        f"skip such steps and count them in optaxclip.stats(opt_state)"
        f"['loss_scale/min_scale_overflow_count'], or a smaller min_scale")


def raise_at_floor(fn: str, at_floor: jax.Array, scale: jax.Array) -> None:
  """Raises ``MinLossScaleError`` where ``at_floor``, eagerly or under jit."""
  report = functools.partial(_raise_if, fn)
  if not isinstance(at_floor, Tracer):  # eager: a plain Python raise
    report(at_floor, scale)
    return
  lax.cond(at_floor, lambda: jax.debug.callback(report, at_floor, scale),
           lambda: None)
