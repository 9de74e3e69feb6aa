"""The global norm and clip of a large tree (`large_tree`; on a GPU the
1.31B-parameter GPT tree), in float32 and bfloat16: against the floor
programs, optax, the measured memory bandwidth and PyTorch."""

import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optaxclip as oc
from benchmarks import _candidates, _torch, _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, ms, verdict
from benchmarks._timing import interleaved_samples, median_ratio
from benchmarks.targets._base import Target
from benchmarks.targets.standalone import clip_call

LIMIT = 1.10  # optaxclip / the floor program: the rescue's scalar test, plus noise
DTYPES = ("float32", "bfloat16")
TORCH_NORM, TORCH_CLIP = ("torch get_total_norm (foreach)",
                          "torch clip_grad_norm_ (foreach, in place)")
# Each kind: (optaxclip, optax, floor, torch, passes over the tree the floor makes).
KINDS = {
    "global norm": ("optaxclip global_norm", "optax.tree.norm", "floor: one read", TORCH_NORM,
                    1),
    "clip": ("optaxclip clip", "optax clip", "floor: two reads and a write", TORCH_CLIP, 3),
}


def bandwidth_probes(size_bytes: int, repeats: int) -> dict[str, float]:
  """Seconds of a copy (`x + 0.0`: a read and a write) and of a sum of
  squares (a read) of one float32 vector of `size_bytes`."""
  x = jax.random.normal(jax.random.key(1), (size_bytes // 4,), jnp.float32)
  copy, sum_squares = jax.jit(lambda x: x + 0.0), jax.jit(lambda x: jnp.sum(x * x))
  samples = interleaved_samples({"copy": lambda: copy(x), "read": lambda: sum_squares(x)},
                                repeats)
  return {"bytes": float(size_bytes),
          **{name: statistics.median(values) for name, values in samples.items()}}


def _torch_candidates(config: Config, shapes: Any, dtype: str) -> dict[str, Callable[[], Any]]:
  torch, device, _ = _torch.load(config.platform)
  if torch is None or device is None:
    return {}
  params = _torch.parameters(torch, device, _trees.shapes_where(shapes, lambda size: True),
                             dtype, seed=0)
  grads = [p.grad for p in params]
  # In place: the grads shrink at the first call; later calls do the same
  # work (torch always multiplies, by a factor clamped to 1).
  return {TORCH_NORM: _torch.synced(torch, device, lambda: torch.nn.utils.get_total_norm(
              grads, foreach=True)),
          TORCH_CLIP: _torch.synced(torch, device, lambda: torch.nn.utils.clip_grad_norm_(
              params, 1.0, foreach=True))}


def measure(config: Config, *, dtype: str) -> dict[str, Any]:
  shapes = _trees.transformer_shapes(**config.large_tree)
  tree = _trees.random_tree(shapes, seed=0, dtype=jnp.dtype(dtype))
  probes = bandwidth_probes(config.bandwidth_bytes, config.repeats)
  norm, optax_norm = jax.jit(oc.functional.global_norm), jax.jit(optax.tree.norm)
  floor_norm, floor_clip = jax.jit(_candidates.floor_norm), jax.jit(_candidates.floor_clip)
  candidates = {"optaxclip global_norm": lambda: norm(tree),
                "optax.tree.norm": lambda: optax_norm(tree),
                "floor: one read": lambda: floor_norm(tree),
                "optaxclip clip": clip_call(_candidates.CLIPS["optaxclip"](), tree),
                "optax clip": clip_call(_candidates.CLIPS["optax clip"](), tree),
                "floor: two reads and a write": lambda: floor_clip(tree),
                **_torch_candidates(config, shapes, dtype)}
  return {"dtype": dtype, "leaves": len(jax.tree.leaves(tree)),
          "tree_bytes": _trees.tree_bytes(tree), "bandwidth": probes,
          "samples": interleaved_samples(candidates, config.standalone_repeats),
          "torch_missing": _torch.load(config.platform)[2]}


def jobs(config: Config) -> list[dict[str, Any]]:
  # A smoke run checks the code, the same for both: bfloat16's, the cheaper.
  return [{"dtype": dtype} for dtype in (DTYPES[1:] if config.mode == "smoke" else DTYPES)]


def _rows(result: dict[str, Any]) -> tuple[list[list[str]], list[Check]]:
  samples, tree_bytes = result["samples"], result["tree_bytes"]
  probe = result["bandwidth"]
  one_read = tree_bytes * probe["read"] / probe["bytes"]  # seconds, at the read probe's rate
  copy_rate = 2 * probe["bytes"] / probe["copy"]  # bytes per second, read and written
  rows, checks = [], []
  for kind, (ours, theirs, floor, torch_name, passes) in KINDS.items():
    for name in (ours, theirs, floor, torch_name):
      if name not in samples:
        continue
      t = statistics.median(samples[name])
      to_floor = median_ratio(samples[name], samples[floor])
      to_optax = median_ratio(samples[name], samples[theirs])
      judged = name == ours
      passed = to_floor <= LIMIT if judged else None
      rows.append([result["dtype"], kind, name, ms(t), f"{t / one_read:.2f}",
                   f"{passes * tree_bytes / t / copy_rate:.0%}",
                   f"**{to_floor:.3f}**" if judged else f"{to_floor:.3f}", f"{to_optax:.3f}",
                   f"<= {LIMIT}" if judged else "", verdict(passed)])
      if judged:
        checks.append(Check(f"{result['dtype']}: {name} / {floor}", f"{to_floor:.3f}",
                            f"<= {LIMIT}", passed))
  return rows, checks


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  rows, checks, probe_rows = [], [], []
  for result in results:
    more_rows, more_checks = _rows(result)
    rows += more_rows
    checks += more_checks
    probe = result["bandwidth"]
    probe_rows.append([result["dtype"], f"{probe['bytes'] / 2**20:.0f}",
                       f"{2 * probe['bytes'] / probe['copy'] / 1e9:.0f}",
                       f"{probe['bytes'] / probe['read'] / 1e9:.0f}"])
  first = results[0]
  missing = first["torch_missing"]
  return Section(
      key="large_tree", title="Global norm and clip of a large tree",
      measured=(f"A GPT-style tree ({config.large_tree}: {first['leaves']} leaves, "
                f"{first['tree_bytes'] / 1e9:.2f} GB in {first['dtype']}), in "
                f"{' and '.join(r['dtype'] for r in results)}, each in a process of its "
                f"own, {config.standalone_repeats} rounds."),
      tables=[Table(["dtype", "kind", "candidate", "median (ms)", "reads of the tree",
                     "share of copy bandwidth", "/ floor", "/ optax", "threshold", "status"],
                    rows),
              Table(["process", "probe (MiB)", "copy (GB/s, read + written)",
                     "sum of squares (GB/s read)"], probe_rows,
                    caption="Bandwidth probes, one float32 vector, same process:")],
      checks=checks, notes=[f"PyTorch left out: {missing}."] if missing else [],
      bars_ms={f"{r['dtype']} {name}": statistics.median(v) * 1e3
               for r in results for name, v in r["samples"].items()})


TARGET = Target("large_tree", measure, render, jobs, platforms=("gpu",))
