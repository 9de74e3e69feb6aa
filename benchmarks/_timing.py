"""Wall-clock timing: a `Timer`, medians of interleaved repeats, compile time.

Every run-time measurement follows the same recipe: one warm-up call per
candidate (compilation, allocation), then `repeats` rounds in which each
candidate takes one sample in turn, each round starting with the next one
(A, B, C, then B, C, A, then C, A, B, ...); the result is the median sample
per candidate. A sample is one call, waited for with
`jax.block_until_ready`, or for calls shorter than `MIN_SAMPLE_SECONDS` the
mean of just enough back-to-back calls (each waited for) to last that long,
so that one preemption by the OS scheduler does not decide a sample.
Interleaving spreads slow drifts of a shared machine (other processes, clock
changes) over all candidates instead of penalising whichever ran last; the
rotation gives each candidate every position in a round equally often (the
first call of a round runs measurably faster here: ~2% on the transformer
tree, where memory freed by the previous call is reused differently), and
ratios are taken within each round, then their median.
"""

import gc
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

MIN_SAMPLE_SECONDS = 0.025


class Timer:
  """Context manager measuring wall time: `with Timer() as t: ...; t.seconds`."""

  def __enter__(self) -> "Timer":
    self.seconds = float("nan")
    self._start = time.perf_counter()
    return self

  def __exit__(self, *exc_info) -> None:
    self.seconds = time.perf_counter() - self._start


def timed_call(fn: Callable[[], Any]) -> float:
  """Seconds for one call of `fn`, including waiting for its JAX results."""
  with Timer() as timer:
    jax.block_until_ready(fn())
  return timer.seconds


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
  """Median seconds of `repeats` calls of `fn` after `warmup` calls."""
  return interleaved_medians({"fn": fn}, repeats, warmup)["fn"]


def calls_per_sample(fn: Callable[[], Any]) -> int:
  """How many calls of `fn` one sample averages (1 for slow calls)."""
  seconds = timed_call(fn)
  return max(1, min(1000, math.ceil(MIN_SAMPLE_SECONDS / max(seconds, 1e-9))))


def sample(fn: Callable[[], Any], calls: int) -> float:
  """Mean seconds per call over `calls` calls, each waited for."""
  return sum(timed_call(fn) for _ in range(calls)) / calls


def interleaved_samples(candidates: dict[str, Callable[[], Any]], repeats: int,
                        warmup: int = 1) -> dict[str, list[float]]:
  """`repeats` samples (seconds per call) per candidate, taken in turn."""
  for fn in candidates.values():
    for _ in range(warmup):
      jax.block_until_ready(fn())
  calls = {name: calls_per_sample(fn) for name, fn in candidates.items()}
  samples = {name: [] for name in candidates}
  for round_ in range(repeats):
    for name in rotated(list(candidates), round_):
      samples[name].append(sample(candidates[name], calls[name]))
  return samples


def rotated(names: list[str], round_: int) -> list[str]:
  """`names` in the order of round `round_`: starting at its `round_`-th."""
  start = round_ % len(names) if names else 0
  return names[start:] + names[:start]


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
  """The median sample of each candidate."""
  return {name: statistics.median(times) for name, times in samples.items()}


def interleaved_medians(candidates: dict[str, Callable[[], Any]], repeats: int,
                        warmup: int = 1) -> dict[str, float]:
  """Median seconds per call for each candidate, sampled in turn each round."""
  return medians(interleaved_samples(candidates, repeats, warmup))


def median_ratio(a: list[float], b: list[float]) -> float:
  """Median of the per-round ratios `a[i] / b[i]`: steadier than a ratio of
  medians, for the reason `median_difference` gives."""
  return statistics.median(x / y for x, y in zip(a, b))


def median_ratio_interval(a: list[float], b: list[float], level: float = 0.95,
                          resamples: int = 2000) -> tuple[float, float]:
  """A bootstrap interval for `median_ratio(a, b)`: the rounds resampled
  with replacement (a fixed seed, so a report is reproducible from its
  samples)."""
  ratios = [x / y for x, y in zip(a, b)]
  rng = random.Random(0)
  medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                   for _ in range(resamples))
  tail = (1 - level) / 2
  return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]


def median_difference(a: list[float], b: list[float]) -> float:
  """Median of the per-round differences `a[i] - b[i]`.

  Samples of the same round share the machine's state at that moment, so
  their difference is steadier than the difference of two medians.
  """
  return statistics.median(x - y for x, y in zip(a, b))


def compile_seconds(make_tx: Callable[[], Any], make_updates: Callable[[], Any]
                    ) -> float:
  """Seconds for `jax.jit(tx.update).lower(updates, state).compile()`.

  Fresh every time: a new transform and new tree objects (shape/dtype
  structs, so no device memory is touched), and `jax.clear_caches()` so that
  no trace, lowering or executable of an earlier measurement is reused.
  """
  tx = make_tx()
  updates = make_updates()
  state = jax.eval_shape(tx.init, updates)
  jax.clear_caches()
  gc.collect()
  with Timer() as timer:
    jax.jit(tx.update).lower(updates, state).compile()
  return timer.seconds
