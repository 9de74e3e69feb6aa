"""Compile time on trees of many small leaves: a whole training step
(`compile_step`) and the clip alone (`compile`)."""

import math
import statistics
from collections.abc import Callable
from typing import Any

import jax

from benchmarks import _candidates, _trees
from benchmarks._config import Config
from benchmarks._report import Check, Plot, Section, Table, verdict
from benchmarks._timing import compile_seconds, rotated
from benchmarks.targets._base import Target

Build = Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]
SKIP_ABOVE_LEAVES = 1000  # optax's clip may be skipped above this many leaves
OPTAX_LIMIT = 1.0  # both: optaxclip / optax clip, where optax's was compiled
MINIMAL_LIMIT = 1.10  # both: optaxclip's extra / the minimal norm's extra
SLOPE_EXCESS_LIMIT = 0.05  # compile: log-log slope over optax.scale's


def _alone(name: str, leaves: int) -> Build:
  def build():
    tx = _candidates.CLIPS[name]()
    updates = _trees.small_leaf_structs(leaves)
    return tx.update, (updates, jax.eval_shape(tx.init, updates))
  return build


def _step(name: str, leaves: int) -> Build:
  def build():
    clip = _candidates.CLIPS[name.removesuffix(" + adamw")]() if name != "adamw" else None
    tx, step = _candidates.adamw_step(clip)
    grads, params = _trees.small_leaf_structs(leaves), _trees.small_leaf_structs(leaves)
    return step, (grads, jax.eval_shape(tx.init, params), params)
  return build


# optax's clip (slow) last: see `measure_compile`.
ALONE = ("optaxclip", "optax.scale", "minimal norm", "optax clip")
STEP = ("adamw", "optaxclip + adamw", "minimal norm + adamw", "optax clip + adamw")


def measure_compile(config: Config, *, step: bool) -> dict[str, Any]:
  """Fresh compiles of each candidate at each size, in rotated rounds.

  The last candidate, optax's clip (slow), takes part in the first
  `reference_rounds` rounds only; above `SKIP_ABOVE_LEAVES` leaves not at all
  when a linear extrapolation from the previous size exceeds
  `config.compile_skip_s`, and not again at a size where one compile did.
  """
  names, make = (STEP, _step) if step else (ALONE, _alone)
  rounds = config.step_compile_repeats if step else config.compile_repeats
  reference_rounds = (config.step_compile_reference_repeats if step
                      else config.compile_reference_repeats)
  reference, limit = names[-1], config.compile_skip_s
  # The first compiles of a process also set up XLA and LLVM: discarded.
  for name in names if config.discard_first_compiles else ():
    compile_seconds(make(name, config.compile_leaves[0]))
  samples: dict[str, list[list[float]]] = {name: [] for name in names}
  previous = None
  for leaves in config.compile_leaves:
    active: list[str] = list(names)
    if limit and previous and leaves > SKIP_ABOVE_LEAVES:
      if previous[1] * leaves / previous[0] > limit:
        active.remove(reference)
    at_size: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
      if round_ == reference_rounds and reference in active:
        active.remove(reference)
      for name in rotated(active, round_):
        seconds = compile_seconds(make(name, leaves))
        at_size[name].append(seconds)
        if name == reference and limit and seconds > limit and leaves > SKIP_ABOVE_LEAVES:
          active.remove(reference)
    for name in names:
      samples[name].append(at_size[name])
    if at_size[reference]:
      previous = (leaves, statistics.median(at_size[reference]))
  return {"leaves": list(config.compile_leaves), "samples": samples}


def _median(values: list[float]) -> float | None:
  return statistics.median(values) if values else None


def _seconds(values: list[float], config: Config, rounds: int) -> str:
  """The median, saying when it is of fewer compiles than `rounds`."""
  if not values:
    return f"skipped (>{config.compile_skip_s:.0f} s)"
  fewer = f" ({len(values)} run{'s' * (len(values) > 1)})" if len(values) < rounds else ""
  return f"{statistics.median(values):.2f}{fewer}"


def _per_round(a: list[float], b: list[float], fn) -> list[float]:
  return [fn(x, y) for x, y in zip(a, b)]


def _to_optax(ours: list[float], theirs: list[float], what: str
              ) -> tuple[list[str], Check | None]:
  """optaxclip's compile time / optax clip's (median of the per-round ratios,
  over the rounds that compiled optax's): the cells and the check; none
  where optax's was skipped."""
  if not theirs:
    return ["—", "", "info"], None
  ratio = statistics.median(_per_round(ours, theirs, lambda x, y: x / y))
  passed = ratio <= OPTAX_LIMIT
  return ([f"**{ratio:.2f}**", f"<= {OPTAX_LIMIT}", verdict(passed)],
          Check(what, f"{ratio:.2f}", f"<= {OPTAX_LIMIT}", passed))


def loglog_slope(xs: list[float], ys: list[float | None]) -> float | None:
  """Least-squares slope of log(y) against log(x) over the measured points."""
  points = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y is not None]
  if len(points) < 2:
    return None
  mx = statistics.fmean(p[0] for p in points)
  my = statistics.fmean(p[1] for p in points)
  return (sum((x - mx) * (y - my) for x, y in points)
          / sum((x - mx) ** 2 for x, _ in points))


def _minimal_norm_table(config: Config, leaves: list[int], samples: dict[str, list[list[float]]],
                        names: tuple[str, str, str], what: str) -> tuple[Table, list[Check]]:
  """optaxclip's extra compile time over the minimal norm's, both over `base`:
  `names` is `(optaxclip, minimal norm, base)`; judged at
  `config.minimal_norm_leaves` (the issue's 500 in a full run)."""
  ours, minimal, base = names
  rows, checks = [], []
  for i, n in enumerate(leaves):
    rounds = list(zip(samples[ours][i], samples[minimal][i], samples[base][i]))
    our_extra = statistics.median(o - b for o, _, b in rounds)
    min_extra = statistics.median(m - b for _, m, b in rounds)
    # A round where the minimal norm compiled no slower than the base (noise
    # on tiny trees) has no ratio.
    ratios = [(o - b) / (m - b) for o, m, b in rounds if m > b]
    ratio = statistics.median(ratios) if ratios else None
    judged = n == config.minimal_norm_leaves
    passed = (ratio is not None and ratio <= MINIMAL_LIMIT) if judged else None
    shown = "—" if ratio is None else f"**{ratio:.2f}**" if judged else f"{ratio:.2f}"
    rows.append([str(n), f"{our_extra:+.3f}", f"{min_extra:+.3f}", shown,
                 f"<= {MINIMAL_LIMIT:.2f}" if judged else "", verdict(passed)])
    if judged:
      checks.append(Check(f"{n} leaves: {what}", "—" if ratio is None else f"{ratio:.2f}",
                          f"<= {MINIMAL_LIMIT:.2f}", passed))
  table = Table(["leaves", f"optaxclip's extra over {base} (s)",
                 f"the minimal norm's extra over {base} (s)", "ratio", "threshold", "status"],
                rows, caption=f"Against the minimal norm (one concatenate, one sum of "
                              f"squares, an rsqrt factor): {what}, median of the "
                              "per-round ratios:")
  return table, checks


def render_step(config: Config, results: list[dict[str, Any]]) -> Section:
  [result] = results
  leaves, samples = result["leaves"], result["samples"]
  rows, checks = [], []
  for i, n in enumerate(leaves):
    adamw = samples["adamw"][i]
    extras = {}
    for name in STEP[1:]:
      extra = _per_round(samples[name][i], adamw, lambda x, y: (x - y) / y)
      extras[name] = statistics.median(extra) if extra else None
    ours, theirs = extras["optaxclip + adamw"], extras["optax clip + adamw"]
    assert ours is not None
    cells, check = _to_optax(samples["optaxclip + adamw"][i], samples["optax clip + adamw"][i],
                             f"{n} leaves: optaxclip + adamw / optax clip + adamw")
    rounds = min(config.step_compile_repeats, config.step_compile_reference_repeats)
    rows.append([str(n), *(_seconds(samples[name][i], config, rounds) for name in STEP),
                 *cells, f"{ours:+.1%}", f"{extras['minimal norm + adamw']:+.1%}",
                 "—" if theirs is None else f"{theirs:+.1%}"])
    checks += [check] if check else []
  minimal, minimal_checks = _minimal_norm_table(
      config, leaves, samples, ("optaxclip + adamw", "minimal norm + adamw", "adamw"),
      "optaxclip's extra step compile time / the minimal norm's")
  medians = {name: [_median(s) for s in samples[name]] for name in STEP}
  return Section(
      key="compile_step", title="Compile time of a whole training step",
      measured=(f"Trees of {', '.join(map(str, leaves))} small float32 leaves; "
                f"medians of {config.step_compile_repeats} fresh compiles per size "
                "(optax's clip: "
                f"{min(config.step_compile_repeats, config.step_compile_reference_repeats)}"
                "); ratios and extra times (`(t_clip+adamw - t_adamw) / t_adamw`) are "
                "medians of the per-round values."),
      tables=[Table(["leaves", "adamw (s)", "optaxclip + adamw (s)",
                     "minimal norm + adamw (s)", "optax clip + adamw (s)",
                     "optaxclip / optax clip", "threshold", "status",
                     "optaxclip: extra / adamw (info)", "minimal norm: extra / adamw (info)",
                     "optax clip: extra / adamw (info)"], rows), minimal],
      checks=checks + minimal_checks,
      plots=[Plot("compile_step.png", "Compile time of jit(step): clip + AdamW",
                  "leaves in the tree", "lower + compile time (s)", leaves, medians)])


def render_alone(config: Config, results: list[dict[str, Any]]) -> Section:
  [result] = results
  leaves, samples = result["leaves"], result["samples"]
  rows, checks = [], []
  for i, n in enumerate(leaves):
    ratio = statistics.median(_per_round(samples["optaxclip"][i], samples["optax.scale"][i],
                                         lambda x, y: x / y))
    theirs = _median(samples["optax clip"][i])
    scale = _median(samples["optax.scale"][i])
    assert scale is not None
    cells, check = _to_optax(samples["optaxclip"][i], samples["optax clip"][i],
                             f"{n} leaves: optaxclip / optax clip")
    rounds = min(config.compile_repeats, config.compile_reference_repeats)
    rows.append([str(n), *(_seconds(samples[name][i], config, rounds) for name in ALONE),
                 *cells, f"{ratio:.2f}", "—" if theirs is None else f"{theirs / scale:.2f}"])
    checks += [check] if check else []
  medians = {name: [_median(s) for s in samples[name]] for name in ALONE}
  slopes = {name: loglog_slope(leaves, medians[name]) for name in ALONE}
  scale_slope = slopes["optax.scale"]
  slope_rows = []
  for name in ALONE:
    slope = slopes[name]
    measured_at = [n for n, t in zip(leaves, medians[name]) if t is not None]
    where = f"{measured_at[0]}-{measured_at[-1]}" if measured_at else "—"
    if slope is None or scale_slope is None:
      slope_rows.append([name, "—", where, "", "", "info"])
      continue
    excess = slope - scale_slope
    judged = name == "optaxclip"
    passed = excess <= SLOPE_EXCESS_LIMIT if judged else None
    slope_rows.append([name, f"{slope:.3f}", where, f"{excess:+.3f}",
                       f"<= +{SLOPE_EXCESS_LIMIT}" if judged else "reference",
                       verdict(passed)])
    if judged:
      checks.append(Check("optaxclip's log-log slope - optax.scale's", f"{excess:+.3f}",
                          f"<= +{SLOPE_EXCESS_LIMIT}", passed))
  minimal, minimal_checks = _minimal_norm_table(
      config, leaves, samples, ("optaxclip", "minimal norm", "optax.scale"),
      "optaxclip's extra compile time / the minimal norm's")
  return Section(
      key="compile", title="Compile time of the clip alone",
      measured=(f"Trees of {', '.join(map(str, leaves))} small float32 leaves; "
                f"medians of {config.compile_repeats} fresh compiles per size "
                f"(optax's clip: "
                f"{min(config.compile_repeats, config.compile_reference_repeats)}); ratios are "
                "medians of the per-round ratios."),
      tables=[Table(["leaves", *(f"{name} (s)" for name in ALONE),
                     "optaxclip / optax clip", "threshold", "status",
                     "optaxclip / scale (info)", "optax clip / scale (info)"], rows),
              minimal,
              Table(["transform", "log-log slope", "over leaves", "minus optax.scale's",
                     "threshold", "status"], slope_rows,
                    caption="Growth of compile time with the number of leaves "
                            "(least-squares slope of log time against log leaves):")],
      checks=checks + minimal_checks,
      plots=[Plot("compile_time.png", "Compile time of jit(tx.update)",
                  "leaves in the tree", "lower + compile time (s)", leaves,
                  medians)])


def measure_step(config: Config) -> dict[str, Any]:
  return measure_compile(config, step=True)


def measure_alone(config: Config) -> dict[str, Any]:
  return measure_compile(config, step=False)


STEP_TARGET = Target("compile_step", measure_step, render_step,
                     platforms=("cpu", "gpu"))
ALONE_TARGET = Target("compile", measure_alone, render_alone)
