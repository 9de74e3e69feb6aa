"""A mixture-of-experts tree, experts stacked in scanned layers (`experts`):
what per-expert norms (`expert_axis`) cost against plain per-leaf norms."""

import statistics
from typing import Any

import jax

import optaxclip as oc
from benchmarks import _cost, _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, interval, verdict
from benchmarks._timing import (
  interleaved_samples,
  median_ratio,
  median_ratio_interval,
  rotated,
  timed_compile,
)
from benchmarks.targets._base import Target, describe_tree
from benchmarks.targets.standalone import clip_call

EXPERTS = 8
EXPERT_AXIS = {"router": None, "w_in": 1, "w_out": 1, "dense": None}
LAYER_AXIS = {"router": 0, "w_in": 0, "w_out": 0, "dense": 0}
# Per layer x expert against per leaf, the same clip: name -> (build, plain's name).
PAIRS: dict[str, tuple[Any, str]] = {
    "clip_by_global_norm(leaf_norms, layer_axis, expert_axis)": (
        lambda: oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=LAYER_AXIS,
                                       expert_axis=EXPERT_AXIS),
        "clip_by_global_norm(leaf_norms)"),
    "clip_by_norm(layer_axis, expert_axis)": (
        lambda: oc.clip_by_norm(1.0, layer_axis=LAYER_AXIS, expert_axis=EXPERT_AXIS),
        "clip_by_norm"),
}
PLAIN = {"clip_by_global_norm(leaf_norms)": lambda: oc.clip_by_global_norm(1.0, leaf_norms=True),
         "clip_by_norm": lambda: oc.clip_by_norm(1.0)}
TRAFFIC_LIMIT = 0.01  # extra passes: per-expert norms are a few scalars per leaf


def moe_shapes(layers: int, d_model: int) -> dict[str, tuple[int, ...]]:
  """A stacked MoE block: router, experts' in and out kernels, a dense kernel."""
  return {"router": (layers, d_model, EXPERTS),
          "w_in": (layers, EXPERTS, d_model, 2 * d_model),
          "w_out": (layers, EXPERTS, 2 * d_model, d_model),
          "dense": (layers, d_model, d_model)}


def _transforms() -> dict[str, Any]:
  return {**{name: build for name, (build, _) in PAIRS.items()}, **PLAIN}


def measure(config: Config) -> dict[str, Any]:
  shapes = moe_shapes(config.scanned_layers[0], config.scanned["d_model"])
  structs = _trees.structs(shapes)
  transforms = _transforms()

  def build(name):
    tx = transforms[name]()
    return lambda: (tx.update, (structs, jax.eval_shape(tx.init, structs)))

  compiled: dict[str, list[float]] = {name: [] for name in transforms}
  passes: dict[str, float] = {}
  for round_ in range(config.compile_repeats):
    for name in rotated(list(transforms), round_):
      seconds, program = timed_compile(build(name))
      compiled[name].append(seconds)
      passes[name] = _cost.compiled_bytes(program) / _trees.tree_bytes(structs)
  grads = _trees.normal_tree(shapes, seed=0)
  run = interleaved_samples({name: clip_call(make(), grads)
                             for name, make in transforms.items()},
                            config.standalone_repeats)
  return {"tree": describe_tree(grads), "compile": compiled, "passes": passes, "run": run}


def _pair_rows(name: str, result: dict[str, Any]) -> tuple[list[list[str]], Check]:
  plain = PAIRS[name][1]
  c, run, passes = result["compile"], result["run"], result["passes"]
  compile_ratio = median_ratio(c[name], c[plain])
  ratio = median_ratio(run[name], run[plain])
  low, high = median_ratio_interval(run[name], run[plain])
  extra = passes[name] - passes[plain]
  passed = extra <= TRAFFIC_LIMIT
  rows = [
      [name, plain, "compile, clip alone (ratio)", f"{statistics.median(c[name]):.3f}",
       f"{statistics.median(c[plain]):.3f}", f"{compile_ratio:.3f}", "", "info"],
      [name, plain, "run, clip alone (ratio)", "", "", f"{ratio:.3f} ({interval(low, high)})",
       "", "info"],
      [name, plain, "traffic, alone (extra passes)", f"{passes[name]:.3f}",
       f"{passes[plain]:.3f}", f"**{extra:+.4f}**", f"<= {TRAFFIC_LIMIT}", verdict(passed)],
  ]
  return rows, Check(f"{name}: extra traffic over {plain} (passes; no second pass)",
                     f"{extra:+.4f}", f"<= {TRAFFIC_LIMIT}", passed)


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  (result,) = results
  rows, checks = [], []
  for name in PAIRS:
    more, check = _pair_rows(name, result)
    rows += more
    checks.append(check)
  return Section(
      key="experts", title="Mixture of experts: per-expert norms against per-leaf norms",
      measured=(f"A stacked MoE tree ({result['tree']}; {EXPERTS} experts, "
                f"{config.scanned_layers[0]} layers); compile times are medians of "
                f"{config.compile_repeats} fresh compiles, run times of "
                f"{config.standalone_repeats} rounds."),
      tables=[Table(["optaxclip", "plain", "measure", "experts", "plain", "ratio",
                     "threshold", "status"], rows)],
      checks=checks,
      notes=["Per layer x expert norms come from the same partial sums as per-leaf "
             "ones: each leaf is still read once for its norms (and once to scale)."])


TARGET = Target("experts", measure, render)
