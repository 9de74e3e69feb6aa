"""A scanned model's tree, its layers stacked on a leading axis (`scanned`):
compile time, run time and traffic of the clip against optax's."""

import statistics
from typing import Any

import jax

from benchmarks import _candidates, _cost, _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, interval, ms, verdict
from benchmarks._timing import (
  compile_seconds,
  interleaved_samples,
  median_ratio,
  median_ratio_interval,
  rotated,
)
from benchmarks.targets._base import Target, describe_tree
from benchmarks.targets.compile_time import ALONE_RATIO_LIMIT, STEP_EXTRA_LIMIT
from benchmarks.targets.standalone import clip_call

CLIPS = ("optaxclip", "optax clip")


def _compile_samples(grads: Any, rounds: int) -> dict[str, list[float]]:
  """Fresh compiles of the clips alone and in AdamW's step, in rotated rounds."""
  def alone(name):
    def build():
      tx = _candidates.CLIPS[name]()
      return tx.update, (grads, jax.eval_shape(tx.init, grads))
    return build

  def step(name):
    def build():
      tx, fn = _candidates.adamw_step(_candidates.CLIPS[name]() if name else None)
      return fn, (grads, jax.eval_shape(tx.init, grads), grads)
    return build

  builds = {**{name: alone(name) for name in (*CLIPS, "optax.scale")},
            **{f"{name} + adamw": step(name) for name in CLIPS}, "adamw": step(None)}
  for build in builds.values():  # the first compiles also set up XLA: discarded
    compile_seconds(build)
  samples = {name: [] for name in builds}
  for round_ in range(rounds):
    for name in rotated(list(builds), round_):
      samples[name].append(compile_seconds(builds[name]))
  return samples


def measure(config: Config, *, layers: int) -> dict[str, Any]:
  shapes = _trees.stacked_transformer_shapes(layers=layers, **config.scanned)
  structs = _trees.structs(shapes)
  compiled = _compile_samples(structs, config.compile_repeats)
  traffic = _cost.traffic(list(CLIPS), {"tree": structs})["tree"]
  grads = _trees.normal_tree(shapes, seed=0)
  run = interleaved_samples({name: clip_call(_candidates.CLIPS[name](), grads)
                             for name in CLIPS}, config.standalone_repeats)
  return {"layers": layers, "tree": describe_tree(grads), "compile": compiled,
          "traffic": traffic, "run": run}


def jobs(config: Config) -> list[dict[str, Any]]:
  return [{"layers": n} for n in config.scanned_layers]


def _rows(result: dict[str, Any]) -> tuple[list[list[str]], list[Check]]:
  layers, c, run, traffic = (result["layers"], result["compile"], result["run"],
                             result["traffic"])
  med = {name: statistics.median(v) for name, v in c.items()}
  extra = statistics.median((x - y) / y for x, y in zip(c["optaxclip + adamw"], c["adamw"]))
  optax_extra = statistics.median((x - y) / y
                                  for x, y in zip(c["optax clip + adamw"], c["adamw"]))
  alone = median_ratio(c["optaxclip"], c["optax.scale"])
  ratio = median_ratio(run["optaxclip"], run["optax clip"])
  low, high = median_ratio_interval(run["optaxclip"], run["optax clip"])
  outcomes = (extra <= STEP_EXTRA_LIMIT, alone <= ALONE_RATIO_LIMIT, low <= 1.0)
  rows = [
      [str(layers), "compile, step (s)", f"{med['optaxclip + adamw']:.3f}",
       f"{med['optax clip + adamw']:.3f}", f"adamw {med['adamw']:.3f}",
       f"**{extra:+.1%}** extra (optax {optax_extra:+.1%})",
       f"<= {STEP_EXTRA_LIMIT:.0%}", verdict(outcomes[0])],
      [str(layers), "compile, clip alone (s)", f"{med['optaxclip']:.3f}",
       f"{med['optax clip']:.3f}", f"optax.scale {med['optax.scale']:.3f}",
       f"**{alone:.2f}** x scale", f"<= {ALONE_RATIO_LIMIT}", verdict(outcomes[1])],
      [str(layers), "run, clip alone (ms)", ms(statistics.median(run["optaxclip"])),
       ms(statistics.median(run["optax clip"])), "",
       f"**{ratio:.3f}** ({interval(low, high)})", "interval contains 1.0 or below",
       verdict(outcomes[2])],
  ]
  for measure_, floor in (("alone", 3.0), ("step extra", 1.0)):
    rows.append([str(layers), f"traffic, {measure_} (passes)",
                 f"{traffic['optaxclip'][measure_]:.3f}",
                 f"{traffic['optax clip'][measure_]:.3f}", f"floor {floor:.1f}",
                 "", "", "info"])
  rows.append([str(layers), "per-layer clippers", "not yet measured: layer_axis", "",
               "", "", "", "not measured"])
  names = ("extra compile time of the step / adamw's", "compile alone / optax.scale",
           "run time / optax clip, 95% interval")
  values = (f"{extra:+.1%}", f"{alone:.2f}", interval(low, high))
  thresholds = (f"<= {STEP_EXTRA_LIMIT:.0%}", f"<= {ALONE_RATIO_LIMIT}",
                "contains 1.0 or below")
  checks = [Check(f"{layers} layers: optaxclip {n}", v, t, p)
            for n, v, t, p in zip(names, values, thresholds, outcomes)]
  return rows, checks


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  rows, checks = [], []
  for result in results:
    more_rows, more_checks = _rows(result)
    rows += more_rows
    checks += more_checks
  trees = "; ".join(f"{r['layers']} layers: {r['tree']}" for r in results)
  return Section(
      key="scanned", title="Scanned models: layers stacked on a leading axis",
      measured=(f"Stacked transformer trees ({trees}); compile times are medians of "
                f"{config.compile_repeats} fresh compiles, run times of "
                f"{config.standalone_repeats} rounds."),
      tables=[Table(["layers", "measure", "optaxclip", "optax clip", "reference",
                     "optaxclip", "threshold", "status"], rows)],
      checks=checks,
      notes=["`layer_axis` (per-layer clippers) does not exist yet: not measured, "
             "no number stands in for it."])


TARGET = Target("scanned", measure, render, jobs)
