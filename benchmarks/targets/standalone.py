"""The clip alone at run time, against the memory floor (`standalone`)."""

import statistics
from collections.abc import Callable
from typing import Any

import jax
import optax

import optaxclip as oc
from benchmarks import _candidates, _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, interval, ms, verdict
from benchmarks._timing import interleaved_samples, median_ratio, median_ratio_interval
from benchmarks.targets._base import Target, describe_tree

CLIPS = ("optaxclip", "optax clip")
TEMP_TOLERANCE = 0.01  # donated temporary bytes / tree bytes, over optax clip's
MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes",
                 "output_size_in_bytes", "alias_size_in_bytes")


def clip_call(tx: optax.GradientTransformation, grads: Any) -> Callable[[], Any]:
  update, state = jax.jit(tx.update), tx.init(grads)
  return lambda: update(grads, state)


def _donated_memory(tx: optax.GradientTransformation, grads: Any) -> dict[str, int] | None:
  """`memory_analysis()` of the update compiled with the updates donated."""
  compiled = jax.jit(tx.update, donate_argnums=0).lower(grads, tx.init(grads)).compile()
  try:
    stats = compiled.memory_analysis()
  except (NotImplementedError, RuntimeError, AttributeError):
    return None
  return None if stats is None else {f: int(getattr(stats, f)) for f in MEMORY_FIELDS}


def measure(config: Config) -> dict[str, Any]:
  shapes = _trees.transformer_shapes(**config.transformer)
  grads = _trees.normal_tree(shapes, seed=0)
  norm, scale = jax.jit(oc.functional.global_norm), jax.jit(optax.scale(0.5).update)
  candidates = {name: clip_call(_candidates.CLIPS[name](), grads) for name in CLIPS}
  candidates["norm pass"] = lambda: norm(grads)
  candidates["scale pass"] = lambda: scale(grads, optax.EmptyState())
  return {"tree": describe_tree(grads), "tree_bytes": _trees.tree_bytes(grads),
          "samples": interleaved_samples(candidates, config.standalone_repeats),
          "memory": {name: _donated_memory(_candidates.CLIPS[name](), grads)
                     for name in CLIPS}}


def _memory_row(name: str, stats: dict[str, int] | None, tree_bytes: int,
                limit: float | None) -> tuple[list[str], Check]:
  """A row of the donated memory: optaxclip's (`limit`, optax's share plus
  `TEMP_TOLERANCE`) judged, optax's (`limit` None) the reference."""
  what = f"{name}: donated temporary bytes / tree bytes"
  threshold = "reference" if limit is None else f"<= optax clip's + {TEMP_TOLERANCE:.0%}"
  if stats is None:
    return [name, "n/a", "n/a", "n/a", "n/a", "n/a", threshold, "info"], Check(
        what, "n/a", threshold, None)
  share = stats["temp_size_in_bytes"] / tree_bytes
  passed = None if limit is None else share <= limit
  return ([name, *(f"{stats[f] / 2**20:.2f}" for f in MEMORY_FIELDS[:1]), f"**{share:.1%}**",
           *(f"{stats[f] / 2**20:.2f}" for f in MEMORY_FIELDS[1:]), threshold,
           verdict(passed)],
          Check(what, f"{share:.1%}", threshold, passed))


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  [result] = results
  samples = result["samples"]
  t = {name: statistics.median(values) for name, values in samples.items()}
  floor = [a + b for a, b in zip(samples["norm pass"], samples["scale pass"])]
  to_floor = {name: median_ratio(samples[name], floor) for name in CLIPS}
  ratio = median_ratio(samples["optaxclip"], samples["optax clip"])
  low, high = median_ratio_interval(samples["optaxclip"], samples["optax clip"])
  at_floor, tie = to_floor["optaxclip"] <= 1.0, low <= 1.0
  rows = [["optaxclip", ms(t["optaxclip"]), f"**{to_floor['optaxclip']:.3f}**", "<= 1.0",
           verdict(at_floor), f"**{ratio:.3f}**", interval(low, high),
           "contains 1.0 or below", verdict(tie)],
          ["optax clip", ms(t["optax clip"]), f"{to_floor['optax clip']:.3f}", "reference",
           "info", "1", "", "", ""],
          ["floor: norm pass + scale pass", ms(statistics.median(floor)), "1", "", "",
           "", "", "", ""]]
  checks = [Check("optaxclip time / floor", f"{to_floor['optaxclip']:.3f}", "<= 1.0",
                  at_floor),
            Check("optaxclip / optax clip, 95% interval", interval(low, high),
                  "contains 1.0 or below", tie)]
  memory, memory_rows = result["memory"], []
  optax_temp = memory["optax clip"]
  limit = (None if optax_temp is None
           else optax_temp["temp_size_in_bytes"] / result["tree_bytes"] + TEMP_TOLERANCE)
  for name in CLIPS:
    row, check = _memory_row(name, memory[name], result["tree_bytes"],
                             limit if name == "optaxclip" else None)
    memory_rows.append(row)
    checks += [check] if name == "optaxclip" else []
  scale_share = median_ratio(samples["scale pass"], floor)
  return Section(
      key="standalone", title="Standalone clip at the memory floor",
      measured=(f"The transformer tree ({result['tree']}), {config.standalone_repeats} "
                f"rounds; the scale pass is {scale_share:.0%} of the floor."),
      tables=[Table(["clip", "median (ms)", "time / floor", "threshold", "status",
                     "optaxclip / optax", "95% interval", "threshold", "status"], rows),
              Table(["clip", "temp (MiB)", "temp / tree", "arguments (MiB)",
                     "outputs (MiB)", "aliased (MiB)", "threshold", "status"],
                    memory_rows, caption="Memory with the updates donated:")],
      checks=checks,
      bars_ms={name: value * 1e3 for name, value in t.items()})


TARGET = Target("standalone", measure, render)
