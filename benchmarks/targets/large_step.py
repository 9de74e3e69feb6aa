"""The clip and the guards in AdamW's step on a large tree (`large_step`; on a
GPU the 1.31B-parameter GPT tree), timed: against optax's clip, the one-read
floor and PyTorch's fused AdamW."""

import collections
import statistics
from collections.abc import Callable
from typing import Any

import jax
import optax

import optaxclip as oc
from benchmarks import _candidates, _torch, _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, ms, verdict
from benchmarks._timing import bootstrap_interval, interleaved_samples
from benchmarks.targets._base import Target
from benchmarks.targets.train_step import LIMIT, REUSE_MEMORY

BASE, OPTAX = "optaxclip + adamw", "optax clip + adamw"
FLOOR = "floor: one read"
SHARED_SIZE = 1 << 16  # state arrays of at least this many elements are shared


def _clipped() -> optax.GradientTransformation:
  return optax.chain(oc.clip_by_global_norm(1.0), optax.adamw(1e-3))


STEPS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw": lambda: optax.adamw(1e-3),
    BASE: _clipped,
    OPTAX: lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "skip_step(optaxclip + adamw, zscore=6)": lambda: oc.skip_step(_clipped(), zscore=6.0),
    "dynamic_loss_scale(optaxclip + adamw)": lambda: oc.dynamic_loss_scale(_clipped()),
    "optax.apply_if_finite(optaxclip + adamw, 10)": lambda: optax.apply_if_finite(
        _clipped(), 10),
}
# A smoke run checks the code: one step of each kind (no clip, the clip, a guard).
SMOKE_STEPS = ("adamw", BASE, "skip_step(optaxclip + adamw, zscore=6)")
TORCH_STEPS = ("torch AdamW", "torch clip_grad_norm_ + AdamW")


def _shared(state: Any, pool: dict[Any, Any]) -> Any:
  """`state` with its large arrays (AdamW's moments, zeros at init) taken
  from `pool`, the first step's: no step writes them (none is donated), so
  every step can read the same ones, and a tree of gigabytes fits once."""
  seen: collections.Counter = collections.Counter()

  def share(x):
    if x.size < SHARED_SIZE:
      return x
    key = (x.shape, x.dtype)
    seen[key] += 1
    return pool.setdefault((*key, seen[key]), x)

  return jax.tree.map(share, state)


def _step_call(tx: optax.GradientTransformation, grads: Any, params: Any,
               pool: dict[Any, Any]) -> Callable[[], Any]:
  """`jit(step)` on the same inputs at every call: the same work each time."""
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  update, state = jax.jit(step), _shared(tx.init(params), pool)
  return lambda: update(grads, state, params)


def _measure_jax(config: Config, shapes: Any) -> dict[str, Any]:
  grads = _trees.random_tree(shapes, seed=0)
  params = _trees.random_tree(shapes, seed=1)
  floor, pool = jax.jit(_candidates.floor_norm), {}
  candidates = {name: _step_call(build(), grads, params, pool) for name, build in STEPS.items()
                if config.mode != "smoke" or name in SMOKE_STEPS}
  candidates[FLOOR] = lambda: floor(grads)
  return {"samples": interleaved_samples(candidates, config.train_step_repeats),
          "leaves": len(jax.tree.leaves(grads)), "tree_bytes": _trees.tree_bytes(grads)}


def _measure_torch(config: Config, shapes: Any) -> dict[str, Any]:
  torch, device, missing = _torch.load(config.platform)
  if torch is None or device is None:
    return {"torch_missing": missing}
  params = _torch.parameters(torch, device, _trees.shapes_where(shapes, lambda size: True),
                             "float32", seed=0)
  # Fused on CUDA, as a user would pick; the CPU has the foreach kernels.
  adamw = torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if device == "cuda"
                                                 else {"foreach": True}))

  def clipped() -> None:
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    adamw.step()

  candidates = {TORCH_STEPS[0]: _torch.synced(torch, device, adamw.step),
                TORCH_STEPS[1]: _torch.synced(torch, device, clipped)}
  return {"samples": interleaved_samples(candidates, config.train_step_repeats),
          "torch_missing": ""}


def measure(config: Config, *, library: str) -> dict[str, Any]:
  shapes = _trees.transformer_shapes(**config.large_tree)
  return (_measure_jax if library == "jax" else _measure_torch)(config, shapes)


def jobs(config: Config) -> list[dict[str, Any]]:
  del config
  return [{"library": "jax"}, {"library": "torch"}]  # torch's memory in its own process


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  result, torch_result = results
  samples = result["samples"]
  t = {name: statistics.median(values) for name, values in samples.items()}
  unit = t[FLOOR]
  rows, checks = [], []
  for name in (name for name in STEPS if name in samples):
    over = "adamw" if name in ("adamw", BASE, OPTAX) else BASE
    differences = [(x - y) / z for x, y, z in zip(samples[name], samples[over], samples[FLOOR])]
    extra = statistics.median(differences)
    low, high = bootstrap_interval(differences)
    judged = name == BASE
    passed = extra <= LIMIT if judged else None
    rows.append([name, ms(t[name]), "" if name == "adamw" else over,
                 "" if name == "adamw" else f"**{extra:+.2f}**" if judged else f"{extra:+.2f}",
                 "" if name == "adamw" else f"{low:+.2f} to {high:+.2f}",
                 f"<= {LIMIT}" if judged else "", verdict(passed)])
    if judged:
      checks.append(Check(f"{name}: (step - adamw) / one read", f"{extra:.2f}", f"<= {LIMIT}",
                          passed))
  rows.append([FLOOR, ms(unit), "", "1", "", "the unit", "info"])
  notes = []
  if torch_result["torch_missing"]:
    notes.append(f"PyTorch left out: {torch_result['torch_missing']}.")
  else:
    torch_t = {name: statistics.median(v) for name, v in torch_result["samples"].items()}
    extra = (torch_t[TORCH_STEPS[1]] - torch_t[TORCH_STEPS[0]]) / unit
    rows += [[TORCH_STEPS[0], ms(torch_t[TORCH_STEPS[0]]), "", "", "", "own process", "info"],
             [TORCH_STEPS[1], ms(torch_t[TORCH_STEPS[1]]), TORCH_STEPS[0], f"{extra:+.2f}",
              "", "own process", "info"]]
  return Section(
      key="large_step", title="The clip and the guards in AdamW's step on a large tree",
      measured=(f"A GPT-style tree ({config.large_tree}: {result['leaves']} float32 leaves, "
                f"{result['tree_bytes'] / 1e9:.2f} GB), {config.train_step_repeats} rounds; "
                "extra time is the median of the per-round differences over the step "
                "named, in units of the one-read floor norm timed in the same round, with "
                "its 95% bootstrap interval."),
      tables=[Table(["step", "median (ms)", "over", "extra / one read", "95% interval",
                     "threshold", "status"], rows)],
      checks=checks, notes=notes,
      bars_ms={name: value * 1e3 for name, value in t.items()})


TARGET = Target("large_step", measure, render, jobs, env=REUSE_MEMORY, platforms=("gpu",))
