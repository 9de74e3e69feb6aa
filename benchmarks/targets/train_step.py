"""The clip's cost inside a training step, timed (`train_step`): a second
view of what `traffic` counts in bytes."""

import resource
import statistics
from collections.abc import Callable
from typing import Any

import jax
import optax

import optaxclip as oc
from benchmarks import _candidates, _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, ms, verdict
from benchmarks._timing import bootstrap_interval, interleaved_samples
from benchmarks.targets._base import Target, describe_tree

LIMIT = 1.25  # (t_clip+adamw - t_adamw) / t_norm: one norm pass, plus noise
STEPS = {"optaxclip + adamw": "optaxclip", "optax clip + adamw": "optax clip",
         "adamw": None}
NORMS = ("optaxclip global_norm", "optax.tree.norm")
# Every call reuses freed memory instead of faulting in fresh pages, whose
# number depends on XLA's buffer assignment, not on the work: README, Methodology.
REUSE_MEMORY = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
                "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(1 << 28)}


def _step_call(clip: optax.GradientTransformation | None, grads: Any,
               params: Any) -> Callable[[], Any]:
  """A jitted step, its parameters and state carried from call to call (not
  donated: on XLA:CPU that adds a copy of every donated buffer)."""
  tx, step = _candidates.adamw_step(clip)
  update = jax.jit(step)
  carried = [params, tx.init(params)]

  def call() -> Any:
    carried[0], carried[1] = update(grads, carried[1], carried[0])
    return carried

  return call


def _page_faults(fn: Callable[[], Any], calls: int = 5) -> float:
  """Minor page faults per call of `fn` (fresh pages the kernel zeroes)."""
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(calls):
    jax.block_until_ready(fn())
  return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def measure(config: Config) -> dict[str, Any]:
  shapes = _trees.transformer_shapes(**config.transformer)
  grads, params = _trees.normal_tree(shapes, seed=0), _trees.normal_tree(shapes, seed=1)
  norm, optax_norm = jax.jit(oc.functional.global_norm), jax.jit(optax.tree.norm)
  candidates = {name: _step_call(_candidates.CLIPS[clip]() if clip else None, grads, params)
                for name, clip in STEPS.items()}
  candidates[NORMS[0]] = lambda: norm(grads)
  candidates[NORMS[1]] = lambda: optax_norm(grads)
  samples = interleaved_samples(candidates, config.train_step_repeats)
  return {"tree": describe_tree(grads), "samples": samples,
          "page_faults": {name: _page_faults(fn) for name, fn in candidates.items()}}


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  [result] = results
  samples, faults = result["samples"], result["page_faults"]
  t = {name: statistics.median(values) for name, values in samples.items()}
  t_norm = t[NORMS[0]]
  rows, checks = [], []
  for name, clip in STEPS.items():
    if clip is None:
      continue
    differences = [(x - y) / t_norm for x, y in zip(samples[name], samples["adamw"])]
    ratio = statistics.median(differences)
    low, high = bootstrap_interval(differences)
    judged = clip == "optaxclip"
    passed = ratio <= LIMIT if judged else None
    rows.append([clip, ms(t[name]), ms(t["adamw"]), ms(t_norm), f"**{ratio:.2f}**",
                 f"{low:.2f} to {high:.2f}", f"<= {LIMIT}" if judged else "reference",
                 verdict(passed)])
    checks.append(Check(f"{clip}: (clip+adamw - adamw) / norm", f"{ratio:.2f}",
                        f"<= {LIMIT}" if judged else "reference", passed))
  fault_rows = [[name, ms(t[name]), f"{faults[name]:.0f}"] for name in samples]
  return Section(
      key="train_step", title="The clip's cost in a training step, timed",
      measured=(f"The transformer tree ({result['tree']}), {config.train_step_repeats} "
                "rounds, in a process whose allocator reuses freed memory; the "
                "difference is the median of the per-round differences, with its 95% "
                "bootstrap interval, in units of one norm pass."),
      tables=[Table(["clip", "clip + adamw (ms)", "adamw (ms)", "norm (ms)",
                     "(clip+adamw - adamw) / norm", "95% interval", "threshold",
                     "status"], rows),
              Table(["candidate", "median (ms)", "page faults per call"], fault_rows,
                    caption="Fresh pages per call (0 when memory is reused; unequal "
                            "counts would make the times unequal for that reason "
                            "alone):")],
      checks=checks,
      bars_ms={name: value * 1e3 for name, value in t.items()})


TARGET = Target("train_step", measure, render, env=REUSE_MEMORY)
