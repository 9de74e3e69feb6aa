"""The sizes and repeats of a run: `FULL`, `QUICK` (small sizes, a first look)
or `SMOKE` (the smallest that runs every target's code, for tests), and what
`for_platform` changes on a GPU."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  mode: str
  fresh_processes: bool  # each job in a fresh process (`_timing.in_fresh_process`)
  platform: str  # "cpu" or "gpu": the JAX backend (and PyTorch's device)
  repeats: int  # rounds of interleaved run-time samples
  train_step_repeats: int  # the same for the train step, a small difference of large times
  standalone_repeats: int  # the same for the standalone clip, a ratio near 1
  compile_repeats: int  # rounds of fresh compiles of a clip alone, per size
  step_compile_repeats: int  # rounds of fresh compiles of a train step, per size
  compile_reference_repeats: int  # of those, rounds that compile optax's slow clip
  step_compile_reference_repeats: int  # the same in a train step
  compile_leaves: tuple[int, ...]  # tree sizes of the compile targets
  minimal_norm_leaves: int  # of those, where optaxclip / the minimal norm is judged
  compile_skip_s: float | None  # optax's clip above 1000 leaves: skip when slower
  discard_first_compiles: bool  # one compile per candidate first, not timed
  transformer: dict[str, int]  # `_trees.transformer_shapes` arguments
  guard_compile_repeats: int  # rounds of fresh compiles of the guarded steps
  traffic_parts: bool  # traffic of the transformer's large and small leaves apart
  scanned: dict[str, int]  # the same, without `layers`, for stacked layers
  scanned_layers: tuple[int, ...]
  scanned_clips: tuple[str, ...] | None  # of `targets/scanned.py`'s CLIPS; None: all
  many_leaves: int  # leaves of 1000 float32 elements
  many_leaves_runs: int  # fresh processes, each a full run of that target
  accuracy_size: int  # float32 elements in one vector
  half_shapes: tuple[tuple[int, ...], ...]  # the bf16/fp16 tree
  large_tree: dict[str, int]  # `_trees.transformer_shapes` arguments of `large_*`
  bandwidth_bytes: int  # the bandwidth probes' float32 vector
  accelerator_targets: tuple[str, ...]  # of `accelerators.PLATFORMS`
  accelerator_llm: dict[str, int]  # `accelerators.llm_tree` arguments
  accelerator_small_leaves: int  # `accelerators.small_tree`'s leaves
  accelerator_lora_layers: int  # `accelerators.lora_tree`'s layers (14 leaves each)
  accelerator_steps: tuple[str, ...] | None  # of `accelerators`' steps (the clip always); None: all


FULL = Config(
    mode="full", fresh_processes=True, platform="cpu", repeats=15, train_step_repeats=31,
    standalone_repeats=41, compile_repeats=11, step_compile_repeats=3,
    compile_reference_repeats=3, step_compile_reference_repeats=1,
    compile_leaves=(250, 500, 1000, 2000, 4000), minimal_norm_leaves=500,
    compile_skip_s=30.0, discard_first_compiles=True,
    transformer=dict(vocab=32000, d_model=512, layers=12, seq_len=1024),
    guard_compile_repeats=5,
    traffic_parts=True,
    scanned=dict(vocab=32000, d_model=512, seq_len=1024), scanned_layers=(12, 48),
    scanned_clips=None,
    many_leaves=2000, many_leaves_runs=5, accuracy_size=10**8,
    half_shapes=((1024, 1024),) * 4,
    large_tree=dict(vocab=32000, d_model=512, layers=12, seq_len=1024),
    bandwidth_bytes=1 << 28,
    # the 0.74B-parameter tree of issue 34, 2000 small leaves, LoRA on 48 layers
    accelerator_targets=("h100", "tpu_v5e"),
    accelerator_llm=dict(vocab=32000, d=2048, layers=12, f=8192, heads=16, experts=8),
    accelerator_small_leaves=2000, accelerator_lora_layers=48, accelerator_steps=None)
QUICK = dataclasses.replace(
    FULL, mode="quick", repeats=5, train_step_repeats=7, standalone_repeats=7,
    compile_repeats=1, step_compile_repeats=1, compile_leaves=(50, 100),
    minimal_norm_leaves=100,
    transformer=dict(vocab=32000, d_model=256, layers=8, seq_len=512),
    guard_compile_repeats=1,
    traffic_parts=False,
    scanned=dict(vocab=4096, d_model=128, seq_len=256), scanned_layers=(4,),
    many_leaves=250, many_leaves_runs=2, accuracy_size=10**7,
    half_shapes=((1024, 1024),) * 2,
    large_tree=dict(vocab=32000, d_model=256, layers=8, seq_len=512), bandwidth_bytes=1 << 26)
# Every target's code path (the traffic of large and small leaves apart
# too: the tiny transformer's token embedding, 1100 x 32, is one large leaf)
# and the report, on trees a loaded 2-core machine compiles in seconds (a
# one-layer transformer): what tests/test_benchmarks.py runs. Its numbers
# mean nothing, so its jobs share one process (a build without the rescue
# still gets its own).
SMOKE = dataclasses.replace(
    FULL, mode="smoke", fresh_processes=False, repeats=1, train_step_repeats=1,
    standalone_repeats=1, compile_repeats=1, step_compile_repeats=1,
    compile_reference_repeats=1, step_compile_reference_repeats=1, compile_leaves=(8, 16),
    minimal_norm_leaves=16, discard_first_compiles=False, guard_compile_repeats=1,
    transformer=dict(vocab=1100, d_model=32, layers=1, seq_len=32),
    scanned=dict(vocab=256, d_model=32, seq_len=32), scanned_layers=(2,),
    # each kind of row: a global clip, its leaf_norms twin, a per-layer clip
    # against optax clip, and AGC (its own reference, no traffic floor)
    scanned_clips=("clip_by_global_norm", "clip_by_global_norm(leaf_norms, layer_axis)",
                   "clip_by_norm(layer_axis)", "adaptive_grad_clip(layer_axis)"),
    many_leaves=16, many_leaves_runs=1, accuracy_size=10**4,
    half_shapes=((64, 64),) * 2,
    large_tree=dict(vocab=1100, d_model=32, layers=1, seq_len=32), bandwidth_bytes=1 << 20,
    # the H100 only (a TPU's programs go through the same code), the clip only
    accelerator_targets=("h100",),
    accelerator_llm=dict(vocab=1024, d=256, layers=2, f=1024, heads=4, experts=4),
    accelerator_small_leaves=5, accelerator_lora_layers=1, accelerator_steps=())

# The GPT-style tree of 1.31B parameters (292 leaves, 5.24 GB in float32): a
# GPU's only (a CPU run keeps the transformer tree).
GPU_LARGE_TREE = dict(vocab=50304, d_model=2048, layers=24, seq_len=2048)
# A full GPU run, in one 10-minute command on an H100 (benchmarks/README.md,
# "On a GPU"): a GPU compiles ~4x slower than this project's CPUs, so one
# size of the compile target (and a small one, whose first compiles are the
# discarded ones), one run of many leaves.
GPU_FULL = dict(large_tree=GPU_LARGE_TREE, bandwidth_bytes=1 << 30, compile_leaves=(50, 500),
                step_compile_repeats=2, many_leaves_runs=1)


def for_platform(config: Config, platform: str) -> Config:
  """`config` on `platform` ("cpu" or "gpu"): a full GPU run's sizes are `GPU_FULL`."""
  config = dataclasses.replace(config, platform=platform)
  if platform == "gpu" and config.mode == "full":
    config = dataclasses.replace(config, **GPU_FULL)
  return config
