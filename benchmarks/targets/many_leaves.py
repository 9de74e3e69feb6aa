"""Many small leaves at run time, against optax and PyTorch (`many_leaves`),
in several runs of fresh processes."""

import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import _candidates, _torch, _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, ms, verdict
from benchmarks._timing import interleaved_samples, median_ratio
from benchmarks.targets._base import Target
from benchmarks.targets.standalone import clip_call

TORCH = "torch clip_grad_norm_ (foreach)"
# (optaxclip, compared with, judged): judged against optax, like for like
# (both returning new arrays); PyTorch's for information (issue 28).
COMPARISONS = [
    ("optaxclip", "optax clip", True),
    ("optaxclip, in place", TORCH, None),
    ("optaxclip, in place", "optax clip, in place", None),
    ("optaxclip", TORCH, None),
]


def _torch_clip(platform: str, arrays: list[np.ndarray]) -> Callable[[], None] | None:
  """`clip_grad_norm_(params, 1.0, foreach=True)` on copies of `arrays`."""
  torch, device, _ = _torch.load(platform)
  if torch is None:
    return None
  params = []
  for a in arrays:
    p = torch.nn.Parameter(torch.from_numpy(a.copy()).to(device))
    p.grad = torch.from_numpy(a.copy()).to(device)
    params.append(p)

  def clip() -> None:
    # The grads shrink in place at the first call; later calls do the same
    # work (torch always multiplies, by a factor clamped to 1).
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    if device == "cuda":
      torch.cuda.synchronize()

  return clip


def _in_place_clip_call(tx: optax.GradientTransformation,
                        arrays: list[np.ndarray]) -> Callable[[], Any]:
  """`jit(tx.update, donate_argnums=0)`, each call clipping the previous
  call's output: the gradients' buffers are reused, as PyTorch's in-place
  `clip_grad_norm_` reuses its tensors."""
  update = jax.jit(tx.update, donate_argnums=0)
  grads = [jnp.asarray(a) for a in arrays]
  holder = [grads, tx.init(grads)]

  def clip() -> Any:
    holder[0], _ = update(*holder)
    return holder[0]

  return clip


def measure(config: Config, *, run: int) -> dict[str, Any]:
  del run  # each run is the same measurement, in a fresh process
  arrays = _trees.normal_arrays(config.many_leaves, 1000, seed=2)
  grads = [jnp.asarray(a) for a in arrays]
  candidates = {}
  for name in ("optaxclip", "optax clip"):
    candidates[name] = clip_call(_candidates.CLIPS[name](), grads)
    candidates[f"{name}, in place"] = _in_place_clip_call(_candidates.CLIPS[name](), arrays)
  torch_clip = _torch_clip(config.platform, arrays)
  if torch_clip is not None:
    candidates[TORCH] = torch_clip
  return {"samples": interleaved_samples(candidates, config.repeats),
          "torch_missing": _torch.load(config.platform)[2]}


def jobs(config: Config) -> list[dict[str, Any]]:
  return [{"run": i} for i in range(config.many_leaves_runs)]


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  runs = [r["samples"] for r in results]
  rows, checks = [], []
  for mine, other, judged in COMPARISONS:
    if other not in runs[0]:
      continue
    ratios = [median_ratio(s[mine], s[other]) for s in runs]
    ratio = statistics.median(ratios)
    passing = sum(r < 1 for r in ratios)
    passed = ratio < 1 if judged else None
    t_mine = statistics.median(statistics.median(s[mine]) for s in runs)
    t_other = statistics.median(statistics.median(s[other]) for s in runs)
    rows.append([mine, ms(t_mine), other, ms(t_other), f"**{ratio:.2f}**",
                 " ".join(f"{r:.2f}" for r in ratios), f"{passing}/{len(runs)}",
                 "< 1" if judged else "reference", verdict(passed)])
    checks.append(Check(f"{mine} / {other} (runs below 1: {passing}/{len(runs)})",
                        f"{ratio:.2f}", "< 1" if judged else "reference", passed))
  bars = {name: statistics.median(statistics.median(s[name]) for s in runs) * 1e3
          for name in runs[0]}
  missing = results[0]["torch_missing"]
  return Section(
      key="many_leaves", title="Many small leaves at run time",
      measured=(f"{config.many_leaves} leaves of 1000 float32 values; {len(runs)} runs, "
                f"each in a fresh process of {config.repeats} rounds. The ratio is the "
                "median over runs of each run's median per-round ratio."),
      tables=[Table(["optaxclip", "median (ms)", "compared with", "median (ms)",
                     "ratio", "ratio per run", "runs below 1", "threshold", "status"],
                    rows)],
      checks=checks, notes=[f"PyTorch left out: {missing}."] if missing else [],
      bars_ms=bars)


TARGET = Target("many_leaves", measure, render, jobs, platforms=("cpu", "gpu"))
