"""optaxclip benchmarks: compile time, run time and accuracy against references.

    python benchmarks/run.py                  # full suite (~10 min on 2 CPU cores)
    python benchmarks/run.py --quick          # small sizes, under a minute
    python benchmarks/run.py --only compile,accuracy --out /tmp/bench
    python benchmarks/run.py --platform gpu   # JAX's GPU backend

Writes `README.md` (one table per target, each ratio next to its target and
PASS/FAIL), `results.json` and PNG plots to `benchmarks/results/` (or `--out`).
See `benchmarks/README.md` for what each target measures.
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import multiprocessing
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmark the checkout, installed or not
  sys.path.insert(0, str(ROOT))

import _report  # noqa: E402
import _timing  # noqa: E402
import _trees  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import Check, Section, Table, verdict  # noqa: E402
from _timing import (  # noqa: E402
  Timer,
  compile_seconds,
  interleaved_samples,
  median_difference,
  median_ratio,
  median_ratio_interval,
  median_time,
  medians,
  rotated,
)

import optaxclip as oc  # noqa: E402

F = oc.functional
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Config:
  mode: str
  repeats: int  # rounds of interleaved run-time calls
  train_step_repeats: int  # the same for target 2, a small difference of large times
  standalone_repeats: int  # the same for target 3, a ratio near 1
  compile_repeats: int  # rounds of fresh compiles per size
  compile_reference_repeats: int  # of those, rounds that compile optax's clip
  compile_leaves: tuple[int, ...]
  compile_skip_s: float | None  # optax's clip above 1000 leaves: skip when slower
  transformer: dict[str, int]  # `_trees.transformer_shapes` arguments
  many_leaves: int  # target 4: leaves of 1000 float32 elements
  accuracy_size: int  # target 5: float32 elements in one vector
  half_shapes: tuple[tuple[int, ...], ...]  # target 5: the bf16/fp16 tree


FULL = Config(
    mode="full", repeats=15, train_step_repeats=31, standalone_repeats=41,
    compile_repeats=11,
    compile_reference_repeats=3,
    compile_leaves=(250, 500, 1000, 2000, 4000), compile_skip_s=30.0,
    transformer=dict(vocab=32000, d_model=512, layers=12, seq_len=1024),
    many_leaves=2000, accuracy_size=10**8,
    half_shapes=((1024, 1024),) * 4)
QUICK = dataclasses.replace(
    FULL, mode="quick", repeats=7, train_step_repeats=11, standalone_repeats=7,
    compile_repeats=3,
    compile_leaves=(100, 250),
    transformer=dict(vocab=32000, d_model=256, layers=8, seq_len=512),
    many_leaves=250, accuracy_size=10**7, half_shapes=((1024, 1024),) * 2)


def ms(seconds: float) -> str:
  return f"{seconds * 1e3:.2f}"


def describe_tree(tree: Any) -> str:
  return (f"{len(jax.tree.leaves(tree))} leaves, {_trees.tree_size(tree) / 1e6:.1f}M "
          f"float32 values ({_trees.tree_bytes(tree) / 2**20:.0f} MiB)")


class Context:
  """What a target's candidates share: the transformer tree and PyTorch,
  made on first use (each target runs in a process of its own)."""

  def __init__(self, config: Config, platform: str):
    self.config = config
    self.platform = platform

  @functools.cached_property
  def shapes(self) -> Any:
    return _trees.transformer_shapes(**self.config.transformer)

  @functools.cached_property
  def grads(self) -> Any:
    return _trees.normal_tree(self.shapes, seed=0)

  @functools.cached_property
  def params(self) -> Any:
    return _trees.normal_tree(self.shapes, seed=1)

  @functools.cached_property
  def torch(self) -> tuple[Any, str | None, str]:
    """`(torch module or None, device, why it is missing)`."""
    try:
      import torch
    except ImportError:
      return None, None, "torch is not installed"
    if self.platform == "cpu":
      return torch, "cpu", ""
    if torch.cuda.is_available():
      return torch, "cuda", ""
    return None, None, "this torch has no CUDA"


# ---------------------------------------------------------------- target 1

COMPILE_TRANSFORMS = {
    "optaxclip": lambda: oc.clip_by_global_norm(1.0),
    "optax.scale": lambda: optax.scale(0.5),
    "optax clip": lambda: optax.clip_by_global_norm(1.0),
}
SKIP_ABOVE_LEAVES = 1000  # optax's clip may be skipped above this many leaves


def _compile_samples(leaves: int, config: Config, skip: set[str]
                     ) -> dict[str, list[float]]:
  """Compile seconds per transform, one per round, in interleaved rounds.

  Optax's clip, a slow reference, takes part in the first
  `config.compile_reference_repeats` rounds only; not at all when in `skip`,
  and not again at a size above `SKIP_ABOVE_LEAVES` where one compile took
  longer than `config.compile_skip_s`.
  """
  active = {k: v for k, v in COMPILE_TRANSFORMS.items() if k not in skip}
  samples = {name: [] for name in COMPILE_TRANSFORMS}
  for round_ in range(config.compile_repeats):
    if round_ == config.compile_reference_repeats:
      active.pop("optax clip", None)
    for name in rotated(list(active), round_):
      seconds = compile_seconds(active[name],
                                lambda: _trees.small_leaf_structs(leaves))
      samples[name].append(seconds)
      too_slow = config.compile_skip_s and seconds > config.compile_skip_s
      if name == "optax clip" and leaves > SKIP_ABOVE_LEAVES and too_slow:
        del active[name]
  return samples


def _predicted_too_slow(leaves: int, previous: tuple[int, float] | None,
                        config: Config) -> bool:
  """Whether optax's clip would exceed the skip limit, extrapolating linearly
  from the previous size (its compile time grows faster than linearly)."""
  if not config.compile_skip_s or leaves <= SKIP_ABOVE_LEAVES or not previous:
    return False
  prev_leaves, prev_seconds = previous
  return prev_seconds * leaves / prev_leaves > config.compile_skip_s


def _seconds_cell(samples: list[float], config: Config) -> str:
  if not samples:
    return f"skipped (>{config.compile_skip_s:.0f}s)"
  expected = min(config.compile_repeats, config.compile_reference_repeats)
  runs = f" ({len(samples)} run)" if len(samples) < expected else ""
  return f"{statistics.median(samples):.2f}{runs}"


def target_compile(config: Config, ctx: Context) -> Section:
  rows, checks = [], []
  seconds = {name: [] for name in COMPILE_TRANSFORMS}
  previous = None
  # Warm-up: the first compiles of a process also set up XLA and LLVM, a
  # cost no later compile pays; one discarded compile of each transform.
  for make_tx in COMPILE_TRANSFORMS.values():
    compile_seconds(make_tx, lambda: _trees.small_leaf_structs(config.compile_leaves[0]))
  for leaves in config.compile_leaves:
    skip = {"optax clip"} if _predicted_too_slow(leaves, previous, config) else set()
    samples = _compile_samples(leaves, config, skip)
    medians = {k: statistics.median(v) if v else None for k, v in samples.items()}
    for name, value in medians.items():
      seconds[name].append(value)
    scale, optax_clip = medians["optax.scale"], medians["optax clip"]
    if optax_clip is not None:
      previous = (leaves, optax_clip)
    ratio = median_ratio(samples["optaxclip"], samples["optax.scale"])
    passed = ratio <= 2.0
    status = verdict(passed) + (" (stretch)" if ratio <= 1.5 else "")
    optax_ratio = f"{optax_clip / scale:.2f}" if optax_clip is not None else "—"
    rows.append([str(leaves), _seconds_cell(samples["optaxclip"], config),
                 _seconds_cell(samples["optax.scale"], config),
                 _seconds_cell(samples["optax clip"], config),
                 f"**{ratio:.2f}**", "<= 2.0 (stretch 1.5)", status, optax_ratio])
    checks.append(Check(f"{leaves} leaves: optaxclip / optax.scale",
                        f"{ratio:.2f}", "<= 2.0", passed))
  table = Table(["leaves", "optaxclip (s)", "optax.scale (s)", "optax clip (s)",
                 "optaxclip / scale", "target", "status",
                 "optax clip / scale (ref.)"], rows)
  return Section(
      key="compile", title="Compile time vs leaf count",
      description=(
          "Lower + compile time of `jax.jit(tx.update)` on trees of small "
          "float32 leaves (shapes cycling through "
          f"{', '.join(str(s) for s in _trees.SMALL_SHAPES)}), for "
          "`oc.clip_by_global_norm(1.0)`, `optax.scale(0.5)` (an elementwise "
          "pass: the floor any clipper pays) and `optax.clip_by_global_norm(1.0)`. "
          f"Times are medians of {config.compile_repeats} fresh compiles "
          f"(optax's clip: {config.compile_reference_repeats}); the ratio is the "
          "median of the ratios within each round. Target: optaxclip / scale "
          "<= 2.0 at every size (stretch 1.5)."),
      tables=[table], checks=checks,
      series={"leaves": list(config.compile_leaves), "seconds": seconds})


# ---------------------------------------------------------------- target 2

def _train_step(clip: Any, grads: Any, params: Any) -> Callable[[], Any]:
  """A jitted AdamW update, after `clip` when given, ready to call.

  As in a training loop, the optimizer state is donated to each call and
  replaced by the one it returns (its moments are updated in place).
  """
  adamw = optax.adamw(1e-3)
  tx = optax.chain(clip, adamw) if clip is not None else adamw
  update = jax.jit(tx.update, donate_argnums=1)
  state = [tx.init(params)]

  def step() -> Any:
    updates, state[0] = update(grads, state[0], params)
    return updates

  return step


def target_train_step(config: Config, ctx: Context) -> Section:
  grads, params = ctx.grads, ctx.params
  norm, optax_norm = jax.jit(F.global_norm), jax.jit(optax.tree.norm)
  samples = interleaved_samples({
      "optaxclip clip + adamw": _train_step(oc.clip_by_global_norm(1.0), grads, params),
      "optax clip + adamw": _train_step(optax.clip_by_global_norm(1.0), grads, params),
      "adamw": _train_step(None, grads, params),
      "optaxclip global_norm": lambda: norm(grads),
      "optax.tree.norm": lambda: optax_norm(grads),
  }, config.train_step_repeats)
  t = medians(samples)
  t_norm = t["optaxclip global_norm"]
  rows, checks = [], []
  for library, key, target in [("optaxclip", "optaxclip clip + adamw", 0.75),
                               ("optax", "optax clip + adamw", None)]:
    ratio = median_difference(samples[key], samples["adamw"]) / t_norm
    passed = ratio <= target if target is not None else None
    rows.append([library, ms(t[key]), ms(t["adamw"]), ms(t_norm), f"**{ratio:.2f}**",
                 f"<= {target}" if target else "reference (~1.8)", verdict(passed)])
    checks.append(Check(f"{library}: (clip+adamw - adamw) / norm", f"{ratio:.2f}",
                        f"<= {target}" if target else "reference", passed))
  table = Table(["clip", "clip + adamw (ms)", "adamw (ms)", "norm (ms)",
                 "(clip+adamw - adamw) / norm", "target", "status"], rows)
  return Section(
      key="train_step", title="Clipping overhead inside a training step",
      description=(
          f"A transformer-shaped gradient tree ({describe_tree(grads)}). "
          "`jit(optax.chain(clip, optax.adamw(1e-3)).update, donate_argnums=1)` "
          "(the state donated and carried from call to call, as in a training "
          "loop) against the same for `optax.adamw(1e-3)`, in units of one "
          "`jit(F.global_norm)` pass over the same tree (the same denominator "
          "for both libraries). The norm must be read once; optaxclip's scaling "
          "should fuse into AdamW's own pass, while a separate scaling pass "
          "costs about one more norm. The difference is the median of the "
          "per-round differences (steadier than the difference of the medians "
          f"shown), over {config.train_step_repeats} rounds. Target for "
          "optaxclip: <= 0.75."),
      tables=[table], checks=checks,
      notes=[f"`optax.tree.norm` on the same tree: {ms(t['optax.tree.norm'])} ms."],
      bars_ms={name: value * 1e3 for name, value in t.items()})


# ---------------------------------------------------------------- target 3

def _clip_call(tx: optax.GradientTransformation, grads: Any) -> Callable[[], Any]:
  update, state = jax.jit(tx.update), tx.init(grads)
  return lambda: update(grads, state)


def _donated_memory(tx: optax.GradientTransformation, grads: Any) -> Any:
  """`memory_analysis()` of the update compiled with the updates donated."""
  compiled = (jax.jit(tx.update, donate_argnums=0)
              .lower(grads, tx.init(grads)).compile())
  try:
    return compiled.memory_analysis()
  except (NotImplementedError, RuntimeError, AttributeError):
    return None


def _memory_row(library: str, stats: Any, tree_bytes: int) -> tuple[list[str], Check]:
  mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
  if stats is None:
    return [library, "n/a", "n/a", "n/a", "n/a", "n/a", "< 10%", "info"], Check(
        f"{library}: donated temp bytes / tree bytes", "n/a", "< 10%", None)
  share = stats.temp_size_in_bytes / tree_bytes
  passed = share < 0.10
  row = [library, mib(stats.temp_size_in_bytes), f"**{share:.1%}**",
         mib(stats.argument_size_in_bytes), mib(stats.output_size_in_bytes),
         mib(stats.alias_size_in_bytes), "< 10%", verdict(passed)]
  return row, Check(f"{library}: donated temp bytes / tree bytes", f"{share:.1%}",
                    "< 10%", passed)


def target_standalone(config: Config, ctx: Context) -> Section:
  grads = ctx.grads
  transforms = {"optaxclip": oc.clip_by_global_norm(1.0),
                "optax": optax.clip_by_global_norm(1.0)}
  norm, scale = jax.jit(F.global_norm), jax.jit(optax.scale(0.5).update)
  candidates = {name: _clip_call(tx, grads) for name, tx in transforms.items()}
  candidates["norm pass"] = lambda: norm(grads)
  candidates["scale pass"] = lambda: scale(grads, optax.EmptyState())
  samples = interleaved_samples(candidates, config.standalone_repeats)
  t = medians(samples)
  ratio = median_ratio(samples["optaxclip"], samples["optax"])
  low, high = median_ratio_interval(samples["optaxclip"], samples["optax"])
  floor = [a + b for a, b in zip(samples["norm pass"], samples["scale pass"])]
  floor_ratios = {name: median_ratio(samples[name], floor) for name in transforms}
  scale_share = median_ratio(samples["scale pass"], floor)
  time_rows = [["optaxclip", ms(t["optaxclip"]), f"**{ratio:.3f}**",
                f"{low:.3f}-{high:.3f}", f"{floor_ratios['optaxclip']:.2f}", "<= 1.0",
                verdict(ratio <= 1.0)],
               ["optax", ms(t["optax"]), "1.00", "", f"{floor_ratios['optax']:.2f}",
                "reference", "info"],
               ["floor: norm pass + scale pass", ms(statistics.median(floor)), "", "",
                "1.00", "reference", "info"]]
  checks = [Check("optaxclip / optax clip time", f"{ratio:.3f}", "<= 1.0", ratio <= 1.0)]
  tree_bytes = _trees.tree_bytes(grads)
  memory_rows = []
  for name, tx in transforms.items():
    row, check = _memory_row(name, _donated_memory(tx, grads), tree_bytes)
    memory_rows.append(row)
    checks.append(check)
  return Section(
      key="standalone", title="Standalone clip",
      description=(
          f"`jit(tx.update)(grads, state)` alone on the transformer tree "
          f"({describe_tree(grads)}), over {config.standalone_repeats} rounds. "
          "Target: optaxclip no slower than optax (ratio <= 1.0, within noise). "
          "The floor for any clipper is one read of the tree for its norm "
          "(`jit(F.global_norm)`) plus one elementwise pass that writes a "
          "fresh tree (`jit(optax.scale(0.5).update)`), timed in the same "
          f"rounds; both libraries sit on it ({scale_share:.0%} of it is the "
          "elementwise pass, on a CPU mostly writing and page-faulting the "
          "new output buffers), so the ratio between them is a tie within a "
          "few percent of noise: the interval is a bootstrap 95% interval "
          "of the median ratio over the rounds. Then both compiled with "
          "`jax.jit(tx.update, donate_argnums=0)`: XLA's "
          "`compiled.memory_analysis()` must show no full-size temporary "
          f"(temp bytes < 10% of the tree's {tree_bytes / 2**20:.0f} MiB)."),
      tables=[Table(["clip", "median (ms)", "optaxclip / optax", "95% interval",
                     "/ floor", "target", "status"], time_rows),
              Table(["clip", "temp (MiB)", "temp / tree", "arguments (MiB)",
                     "outputs (MiB)", "aliased (MiB)", "target", "status"],
                    memory_rows, caption="Memory with the updates donated:")],
      checks=checks,
      bars_ms={f"{name} clip": value * 1e3 for name, value in t.items()})


# ---------------------------------------------------------------- target 4

def _torch_clip(ctx: Context, arrays: list[np.ndarray]) -> Callable[[], None] | None:
  """`clip_grad_norm_(params, 1.0, foreach=True)` on copies of `arrays`."""
  torch, device, _ = ctx.torch
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


# (name, clip, compared with, judged): the first two are like for like:
# both return new arrays, or both reuse the gradients' buffers.
MANY_LEAVES_COMPARISONS = [
    ("optaxclip", "optax", True),
    ("optaxclip, in place", "torch clip_grad_norm_ (foreach)", True),
    ("optaxclip, in place", "optax, in place", None),
    ("optaxclip", "torch clip_grad_norm_ (foreach)", None),
]


def target_many_leaves(config: Config, ctx: Context) -> Section:
  arrays = _trees.normal_arrays(config.many_leaves, 1000, seed=2)
  grads = [jnp.asarray(a) for a in arrays]
  ours, theirs = oc.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
  candidates = {"optaxclip": _clip_call(ours, grads),
                "optax": _clip_call(theirs, grads),
                "optaxclip, in place": _in_place_clip_call(ours, arrays),
                "optax, in place": _in_place_clip_call(theirs, arrays)}
  torch_clip = _torch_clip(ctx, arrays)
  if torch_clip is not None:
    candidates["torch clip_grad_norm_ (foreach)"] = torch_clip
  samples = interleaved_samples(candidates, config.repeats)
  t = medians(samples)
  rows, checks = [], []
  for mine, other, judged in MANY_LEAVES_COMPARISONS:
    if other not in samples:
      continue
    ratio = median_ratio(samples[mine], samples[other])
    passed = ratio < 1 if judged else None
    rows.append([mine, ms(t[mine]), other, ms(t[other]), f"**{ratio:.2f}**",
                 "< 1" if judged else "reference", verdict(passed)])
    checks.append(Check(f"{mine} / {other}", f"{ratio:.2f}",
                        "< 1" if judged else "reference", passed))
  notes = [] if torch_clip else [f"PyTorch left out: {ctx.torch[2]}."]
  return Section(
      key="many_leaves", title="Many small leaves at run time",
      description=(
          f"{config.many_leaves} leaves of 1000 float32 elements: "
          "`jit(tx.update)` of optaxclip and optax, which return new arrays; "
          "the same with the gradients donated (`donate_argnums=0`, each call "
          "clipping the last call's output), which reuses their buffers as "
          "`torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)` (PyTorch's "
          "default thread count) does in place on the same values. Per-call "
          "dispatch of the many arguments is included, as in a real step. "
          "Target: optaxclip faster than optax and than PyTorch (ratio < 1), "
          "each compared like for like; the other ratios are for reference."),
      tables=[Table(["optaxclip", "median (ms)", "compared with", "median (ms)",
                     "ratio", "target", "status"], rows)],
      checks=checks, notes=notes,
      bars_ms={name: value * 1e3 for name, value in t.items()})


# ---------------------------------------------------------------- target 5

def _float64_norm(arrays: list[np.ndarray]) -> float:
  """The exact-enough norm, summed in float64 chunk by chunk."""
  total = 0.0
  for a in arrays:
    flat = a.reshape(-1)
    for start in range(0, flat.size, 1 << 22):
      chunk = flat[start:start + (1 << 22)].astype(np.float64)
      total += float(chunk @ chunk)
  return math.sqrt(total)


def _relative_error(value: Any, reference: float) -> float:
  value = float(value)
  return abs(value - reference) / reference if math.isfinite(value) else math.inf


def _torch_norm(ctx: Context, arrays: list[np.ndarray], dtype_name: str) -> float | None:
  """What `clip_grad_norm_` computes: the norm of the per-tensor norms."""
  torch, device, _ = ctx.torch
  if torch is None:
    return None
  dtype = getattr(torch, dtype_name)
  tensors = [torch.from_numpy(np.require(a, requirements="W")).to(device=device, dtype=dtype)
             for a in arrays]
  norms = torch.stack([torch.linalg.vector_norm(x) for x in tensors])
  return float(torch.linalg.vector_norm(norms))


def _accuracy_row(ctx: Context, case: str, arrays: list[np.ndarray],
                  dtype: Any) -> tuple[list[str], Check]:
  tree = [jnp.asarray(a, dtype) for a in arrays]
  seen = [np.asarray(x.astype(jnp.float32)) for x in tree]  # the rounded values
  reference = _float64_norm(seen)
  errors = [_relative_error(jax.jit(F.global_norm)(tree), reference),
            _relative_error(jax.jit(optax.tree.norm)(tree), reference)]
  torch_norm = _torch_norm(ctx, seen, jnp.dtype(dtype).name)
  errors.append(None if torch_norm is None else _relative_error(torch_norm, reference))
  cells = ["n/a" if e is None else f"{e:.1e}" for e in errors]
  passed = errors[0] <= 1e-6
  size = sum(a.size for a in arrays)
  row = [case, f"{size:.3g}", f"**{cells[0]}**", cells[1], cells[2], "<= 1e-6",
         verdict(passed)]
  return row, Check(f"{case}: relative error", cells[0], "<= 1e-6", passed)


def target_accuracy(config: Config, ctx: Context) -> Section:
  rng = np.random.default_rng(3)
  cases = [
      ("float32, one vector", [rng.standard_normal(config.accuracy_size, np.float32)],
       jnp.float32),
      ("bfloat16 tree", [rng.standard_normal(s, np.float32) for s in config.half_shapes],
       jnp.bfloat16),
      ("float16 tree", [rng.standard_normal(s, np.float32) for s in config.half_shapes],
       jnp.float16),
  ]
  rows, checks = [], []
  for case, arrays, dtype in cases:
    row, check = _accuracy_row(ctx, case, arrays, dtype)
    rows.append(row)
    checks.append(check)
  notes = [] if ctx.torch[0] else [f"PyTorch left out: {ctx.torch[2]}."]
  return Section(
      key="accuracy", title="Accuracy of the norm",
      description=(
          "Relative error of the global norm of N(0, 1) values against a float64 "
          "numpy norm of the same values (for bf16/fp16: the values after "
          "rounding). optaxclip: `jit(F.global_norm)`; optax: "
          "`jit(optax.tree.norm)`; PyTorch: the norm of per-tensor "
          "`torch.linalg.vector_norm`s, i.e. what `clip_grad_norm_` returns. "
          "Target for optaxclip: <= 1e-6."),
      tables=[Table(["case", "elements", "optaxclip", "optax", "torch", "target",
                     "status"], rows)],
      checks=checks, notes=notes)


# ---------------------------------------------------------------- target 6

def _plain_norm(tree: Any) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(tree)))


def _with_huge_value(tree: Any) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  first = leaves[0]
  leaves[0] = first.at[(0,) * first.ndim].set(1e20)
  return treedef.unflatten(leaves)


def target_fallback(config: Config, ctx: Context) -> Section:
  grads = ctx.grads
  huge = _with_huge_value(grads)
  norm, plain = jax.jit(F.global_norm), jax.jit(_plain_norm)
  samples = interleaved_samples({
      "optaxclip global_norm": lambda: norm(grads),
      "plain sqrt(sum(x*x))": lambda: plain(grads),
  }, config.repeats)
  t = medians(samples)
  # Timed apart: interleaved, the slow triggered call would run just before
  # (and disturb the caches of) the call it is compared with.
  t["optaxclip, fallback triggered"] = median_time(lambda: norm(huge), config.repeats)
  ratio = median_ratio(samples["optaxclip global_norm"],
                       samples["plain sqrt(sum(x*x))"])
  triggered = t["optaxclip, fallback triggered"] / t["plain sqrt(sum(x*x))"]
  rows = [["optaxclip global_norm", ms(t["optaxclip global_norm"]), f"**{ratio:.2f}**",
           "<= 1.05 (noise)", verdict(ratio <= 1.05)],
          ["plain sqrt(sum(x*x))", ms(t["plain sqrt(sum(x*x))"]), "1.00", "reference",
           "info"],
          ["optaxclip, fallback triggered (one 1e20)",
           ms(t["optaxclip, fallback triggered"]), f"{triggered:.2f}", "—", "info"]]
  huge_norm, plain_huge = float(norm(huge)), float(plain(huge))
  return Section(
      key="fallback", title="Overflow-safe norm costs nothing when not triggered",
      description=(
          f"`jit(F.global_norm)` on the transformer tree ({describe_tree(grads)}) "
          "against a plain `jnp.sqrt(sum(jnp.sum(x * x) for x in leaves))`. "
          "Target: ratio <= 1.05, a tolerance for timing noise. For information, "
          "the time when the rescaling pass does run (one value set to 1e20), "
          "measured after the comparison rather than interleaved with it."),
      tables=[Table(["norm", "median (ms)", "ratio to plain", "target", "status"],
                    rows)],
      checks=[Check("optaxclip / plain norm", f"{ratio:.2f}", "<= 1.05 (noise)",
                    ratio <= 1.05),
              Check("fallback triggered / plain norm", f"{triggered:.2f}", "—", None)],
      notes=[f"With the 1e20 value optaxclip's norm is {huge_norm:.4g} "
             f"(the plain norm gives {plain_huge:.4g})."],
      bars_ms={name: value * 1e3 for name, value in t.items()})


# ---------------------------------------------------------------- driver

TARGETS = {
    "compile": target_compile,
    "train_step": target_train_step,
    "standalone": target_standalone,
    "many_leaves": target_many_leaves,
    "accuracy": target_accuracy,
    "fallback": target_fallback,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description="Benchmark optaxclip against optax and PyTorch.")
  parser.add_argument("--quick", action="store_true",
                      help="small sizes and fewer repeats (under a minute on 2 cores)")
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                      help=f"output folder (default: {DEFAULT_OUT.relative_to(ROOT)})")
  parser.add_argument("--only", default=",".join(TARGETS),
                      help=f"comma-separated targets to run: {', '.join(TARGETS)}")
  parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                      help="JAX backend to run on (default: cpu)")
  parser.add_argument("--no-skip", action="store_true",
                      help="measure optax's clip compile time at every size")
  args = parser.parse_args(argv)
  args.only = [name.strip() for name in args.only.split(",") if name.strip()]
  unknown = [name for name in args.only if name not in TARGETS]
  if unknown or not args.only:
    parser.error(f"--only: unknown target(s) {', '.join(unknown) or '(none given)'}; "
                 f"choose from {', '.join(TARGETS)}")
  return args


def select_platform(name: str) -> None:
  """Runs JAX on `name`'s backend, or exits saying why it cannot."""
  if name == "cpu":
    jax.config.update("jax_platforms", "cpu")
    return
  try:
    gpus = jax.devices("gpu")
  except RuntimeError as error:
    sys.exit(f"--platform gpu: JAX has no GPU backend on this machine ({error}). "
             "Install a CUDA/ROCm build of jaxlib, or run with --platform cpu.")
  jax.config.update("jax_default_device", gpus[0])


def run_target(key: str, config: Config, platform: str) -> Section:
  """Runs target `key` in this process, with a context of its own."""
  select_platform(platform)
  return TARGETS[key](config, Context(config, platform))


def run_target_in_fresh_process(key: str, config: Config, platform: str) -> Section:
  """Runs target `key` in a new Python process and returns its section.

  Each target starts from the same state: no target runs in a process that
  an earlier one left behind (after the compile target's hundreds of fresh
  compiles, every run time measured here in the same process, PyTorch's
  included, was 20-35% slower, and not by the same factor for each).
  """
  spawn = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
    return pool.submit(run_target, key, config, platform).result()


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  select_platform(args.platform)
  config = QUICK if args.quick else FULL
  if args.no_skip:
    config = dataclasses.replace(config, compile_skip_s=None)
  args.out.mkdir(parents=True, exist_ok=True)
  env = _report.environment()
  numbers = {key: i for i, key in enumerate(TARGETS, start=1)}
  sections = []
  with Timer() as total:
    for key in args.only:
      print(f"[{numbers[key]}/{len(TARGETS)}] {key} ...", end=" ", flush=True)
      with Timer() as timer:
        section = run_target_in_fresh_process(key, config, args.platform)
      sections.append(section)
      print(f"{verdict(section.passed)} ({timer.seconds:.1f} s)", flush=True)
    plots = _report.write_plots(sections, args.out)
  settings = {"command": _report.command_line(), "mode": config.mode,
              "repeats": config.repeats, "compile_repeats": config.compile_repeats,
              "compile_reference_repeats": config.compile_reference_repeats,
              "train_step_repeats": config.train_step_repeats,
              "standalone_repeats": config.standalone_repeats,
              "isolation": "each target in a fresh Python process",
              "min_sample_ms": _timing.MIN_SAMPLE_SECONDS * 1e3}
  markdown = _report.render_markdown(sections, numbers, env, settings, plots,
                                     total.seconds)
  (args.out / "README.md").write_text(markdown)
  results = {"environment": env, "settings": settings,
             "config": dataclasses.asdict(config),
             "sections": [dataclasses.asdict(s) for s in sections]}
  (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
  print(f"wrote {args.out / 'README.md'}, results.json and {', '.join(plots) or 'no plots'} "
        f"in {total.seconds:.1f} s")


if __name__ == "__main__":
  main()
