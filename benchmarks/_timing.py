"""Wall-clock timing: rotated rounds of samples, intervals, compile time.

The recipe (warm-up, rotated rounds, samples of at least
`MIN_SAMPLE_SECONDS`, per-round ratios) and why: benchmarks/README.md,
"Methodology".
"""

import concurrent.futures
import gc
import math
import multiprocessing
import os
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


def bootstrap_interval(values: list[float], level: float = 0.95,
                       resamples: int = 2000) -> tuple[float, float]:
  """A bootstrap interval for the median of `values` (per-round ratios or
  differences): the rounds resampled with replacement, with a fixed seed so
  that a report is reproducible from its samples."""
  rng = random.Random(0)
  medians_ = sorted(statistics.median(rng.choices(values, k=len(values)))
                    for _ in range(resamples))
  tail = (1 - level) / 2
  return medians_[int(tail * resamples)], medians_[int((1 - tail) * resamples) - 1]


def median_ratio_interval(a: list[float], b: list[float]) -> tuple[float, float]:
  """The 95% bootstrap interval of `median_ratio(a, b)`."""
  return bootstrap_interval([x / y for x, y in zip(a, b)])


def median_difference(a: list[float], b: list[float]) -> float:
  """Median of the per-round differences `a[i] - b[i]`.

  Samples of the same round share the machine's state at that moment, so
  their difference is steadier than the difference of two medians.
  """
  return statistics.median(x - y for x, y in zip(a, b))


def compile_seconds(build: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]
                    ) -> float:
  """Seconds for `jax.jit(fn).lower(*args).compile()`, `(fn, args) = build()`.

  Fresh every time: `build` makes a new transform and new tree objects
  (shape/dtype structs, so no device memory is touched), and
  `jax.clear_caches()` drops every trace, lowering and executable of an
  earlier measurement.
  """
  return timed_compile(build)[0]


def timed_compile(build: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]
                  ) -> tuple[float, Any]:
  """`compile_seconds(build)` and the compiled program (for its cost analysis)."""
  fn, args = build()
  jax.clear_caches()
  gc.collect()
  with Timer() as timer:
    compiled = jax.jit(fn).lower(*args).compile()
  return timer.seconds, compiled


def in_fresh_process(fn: Callable[..., Any], *args: Any,
                     env: dict[str, str] | None = None, **kwargs: Any) -> Any:
  """`fn(*args, **kwargs)` in a new Python process (`spawn`) with `env` added
  to its environment; the result.

  `fn` must be a module-level function. A fresh process measures from the
  same state every time: after hundreds of fresh compiles, run times in the
  same process (PyTorch's too) came out 20-35% slower, not by the same
  factor for every candidate; and a process whose library was patched
  (`_cost.without_rescue_branch`) must not measure anything else.
  """
  spawn = multiprocessing.get_context("spawn")
  saved = {name: os.environ.get(name) for name in env or {}}
  os.environ.update(env or {})  # what the new process starts with
  try:
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
      return pool.submit(fn, *args, **kwargs).result()
  finally:
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value
