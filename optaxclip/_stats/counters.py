"""Step counters: saturating int32 counts that every clipper's state keeps.

``count`` (steps seen), ``clipped_count`` (finite steps that were scaled
down) and ``nonfinite_count`` (steps whose norm was NaN or Inf), and the
``clip_rate`` that ``optaxclip.stats`` derives from them.
"""

from typing import Any

import jax
import jax.numpy as jnp

Counter = jax.Array  # int32 [], saturating: a state field counting steps


def zero() -> Counter:
  """A fresh int32 counter (its own buffer: a state's fields never alias,
  so that ``jit`` can donate them)."""
  return jnp.zeros([], jnp.int32)


def increment(counter: Counter) -> Counter:
  """``counter + 1``, saturating at the int32 maximum."""
  return count_if(True, counter)


def count_if(flag: jax.typing.ArrayLike, counter: Counter) -> Counter:
  """``counter + 1`` where ``flag`` (saturating at the int32 maximum)."""
  # An add of a 0/1 rather than a select between two counts: every op here
  # is compiled into the step, and XLA:CPU pays for each.
  below_max = counter < jnp.iinfo(counter.dtype).max
  return counter + (flag & below_max).astype(counter.dtype)


def step_counts(state: Any, *, finite: jax.Array,
                clipped: jax.Array) -> dict[str, jax.Array]:
  """``count``, ``clipped_count`` and ``nonfinite_count`` after one more step.

  ``state`` has the three counters; ``clipped`` only counts when ``finite``.
  """
  return {"count": increment(state.count),
          "clipped_count": count_if(finite & clipped, state.clipped_count),
          "nonfinite_count": count_if(~finite, state.nonfinite_count)}


def clip_rate(state: Any) -> jax.Array:
  """The fraction of steps that were clipped, as float32."""
  return (state.clipped_count / jnp.maximum(state.count, 1)).astype(jnp.float32)
