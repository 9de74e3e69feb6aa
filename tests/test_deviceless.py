"""The programs an H100 and TPUs run, compiled here on the CPU (deviceless).

XLA:GPU's and XLA:TPU's optimizing compilers run on this machine
(tests/deviceless.py); the optimized program is read after fusion, next to
optax's program for the same tree, compiled in the same test: kernels
(fusions), the fusions that read each gradient, bytes accessed (XLA's cost
analysis over the gradients' bytes: passes), conditionals and all-reduces.
What the numbers are today: docs/design.md, Platforms.
"""

import functools
import math
from typing import NamedTuple

import deviceless as dl
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from kernel_table import (
  WIDTH,
  GuardCase,
  close,
  guard_views,
  narrow_rows,
  norm_views,
  reference,
  report,
  table,
  zero_multiplies,
)

import optaxclip as oc

F = oc.functional
TARGETS = ("h100", "tpu_v5e", "tpu_v6e")
PLATFORM = {"h100": "cuda", "tpu_v5e": "tpu", "tpu_v6e": "tpu", "tpu_v5e_8": "tpu"}
INF = float("inf")
NORMS = {"float32, ord 2": (jnp.float32, 2.0), "float32, ord 1": (jnp.float32, 1.0),
         "float32, ord inf": (jnp.float32, INF), "float32, ord 3": (jnp.float32, 3.0),
         "bfloat16, ord 2": (jnp.bfloat16, 2.0), "bfloat16, ord inf": (jnp.bfloat16, INF)}
TOLERANCE = 0.01  # "within 1%": of optax's bytes, or of AdamW's + one pass


def model(dtype=jnp.float32) -> dict:
  """A decoder of 2 stacked layers with experts, as (shape, dtype) pairs: 17
  MiB in float32; its matrices are large leaves for the library (over 2**15
  entries), its norms and router small ones, and it compiles in seconds."""
  layers, d, heads, f, experts, vocab = 2, 256, 4, 1024, 4, 4096
  attn = {name: ((layers, d, heads, d // heads), dtype) for name in ("query", "key", "value")}
  return {"embed": ((vocab, d), dtype),
          "layers": {"attn": {**attn, "out": ((layers, d, d), dtype)},
                     "mlp": {"w1": ((layers, d, f), dtype), "w2": ((layers, f, d), dtype)},
                     "ln1": ((layers, d), dtype), "ln2": ((layers, d), dtype),
                     "moe": {"router": ((layers, d, experts), dtype),
                             "w_in": ((layers, experts, d, d), dtype)}},
          "head": ((d, vocab), dtype), "ln_f": ((d,), dtype)}


LAYER_AXIS = {"embed": None, "layers": 0, "head": None, "ln_f": None}
EXPERT_AXIS = {"embed": None, "head": None, "ln_f": None,
               "layers": {"attn": None, "mlp": None, "ln1": None, "ln2": None,
                          "moe": {"router": None, "w_in": 1}}}
FROZEN_ROUTER = {"embed": True, "head": True, "ln_f": True,
                 "layers": {"attn": True, "mlp": True, "ln1": True, "ln2": True,
                            "moe": {"router": False, "w_in": True}}}
NOT_MATRICES = {"embed": True, "head": True, "ln_f": True, "layers": False}  # Muon's own
GROUPS = {"embed": "embed", "head": "head", "ln_f": "body", "layers": "body"}
HEADS = oc.AttentionHeads(query="layers/attn/query", key="layers/attn/key", layer_axis=0)


def _adamw():
  return optax.adamw(1e-3)


def _clipped(**kw):
  return optax.chain(oc.clip_by_global_norm(1.0, **kw), _adamw())


# Each a builder of the transform whose whole step is compiled (the update
# and optax.apply_updates), beside AdamW's step alone.
STEPS = {
    "clip": _clipped,
    "clip(leaf_norms, layer_axis)": lambda: _clipped(leaf_norms=True, layer_axis=LAYER_AXIS),
    "clip(leaf_norms, layer_axis, expert_axis)":
        lambda: _clipped(leaf_norms=True, layer_axis=LAYER_AXIS, expert_axis=EXPERT_AXIS),
    "clip(mask)": lambda: _clipped(mask=FROZEN_ROUTER),
    "clip(scale_only)": lambda: _clipped(scale_only=NOT_MATRICES),
    "clip(groups)": lambda: _clipped(groups=GROUPS),
    "adaptive_grad_clip": lambda: optax.chain(oc.adaptive_grad_clip(0.01), _adamw()),
    "clip_by_block_rms": lambda: optax.chain(oc.clip_by_block_rms(0.01), _adamw()),
    "zclip": lambda: optax.chain(oc.zclip(), _adamw()),
    "adagc": lambda: optax.chain(oc.adagc(), _adamw()),
    "adamw, then qk_clip": lambda: optax.chain(_adamw(), oc.qk_clip(100.0, heads=HEADS)),
    "skip_step(clip, zscore)": lambda: oc.skip_step(_clipped(), zscore=6.0),
    "skip_step(clip, zscore, window)": lambda: oc.skip_step(_clipped(), zscore=6.0, window=16),
    "dynamic_loss_scale(clip)": lambda: oc.dynamic_loss_scale(_clipped()),
    "dynamic_loss_scale(clip, every_k_steps)":
        lambda: oc.dynamic_loss_scale(_clipped(), every_k_steps=4),
}
EXTRA_ARGS = {"adamw, then qk_clip": {"max_logits": ((2, 4), jnp.float32)}}


def _stepper(tx: optax.GradientTransformation, names=()):
  """The step: `tx`'s update, with the extra keyword arguments `names`
  after the parameters, and optax.apply_updates."""
  def step(grads, state, params, *values):
    updates, state = tx.update(grads, state, params, **dict(zip(names, values)))
    return optax.apply_updates(params, updates), state
  return step


def _step_args(tx: optax.GradientTransformation, target: str, grads: dict,
               extra: dict | None = None) -> tuple:
  """`_stepper(tx, names)` and the arguments it is compiled for on `target`:
  gradients and parameters shaped as `grads`, a fresh state, the `extra`
  keyword arguments in the order of `names` (sorted)."""
  g = dl.specs(grads, target)
  state = dl.specs(jax.eval_shape(tx.init, g), target)
  extra = extra or {}
  names = sorted(extra)
  return _stepper(tx, names), (g, state, g, *[dl.specs(extra[n], target) for n in names])


def _step_program(tx: optax.GradientTransformation, target: str, grads: dict,
                  extra: dict | None = None) -> dl.Program:
  """The compiled step (`_step_args`)."""
  return dl.compile(*_step_args(tx, target, grads, extra), keep_unused=True)


@functools.cache
def step_program(name: str, target: str) -> dl.Program:
  if name == "adamw":
    return _step_program(_adamw(), target, model())
  if name == "optax clip":
    return _step_program(optax.chain(optax.clip_by_global_norm(1.0), _adamw()), target,
                         model())
  return _step_program(STEPS[name](), target, model(), EXTRA_ARGS.get(name))


def _floor_norm(ord):
  """The one-read norm of order `ord` a user writes: one reduction per leaf."""
  def norm(tree):
    leaves = [jnp.abs(x.astype(jnp.float32)) for x in jax.tree.leaves(tree)]
    if ord == INF:
      return jnp.max(jnp.stack([jnp.max(x) for x in leaves]))
    return sum(jnp.sum(x ** ord) for x in leaves) ** (1 / ord)
  return norm


@functools.cache
def norm_programs(target: str, name: str) -> tuple[dl.Program, dl.Program]:
  """optaxclip's global norm of `model()` and its reference: optax's for
  ord 2, the one-read floor otherwise."""
  dtype, ord = NORMS[name]
  grads = dl.specs(model(dtype), target)
  reference = optax.tree.norm if ord == 2 else _floor_norm(ord)
  return (dl.compile(lambda g: F.global_norm(g, ord), (grads,)),
          dl.compile(reference, (grads,)))


def one_read(target: str) -> float:
  """One read of `model()` in passes: 1.0, or optax's norm where XLA:TPU's
  prefetch copies (HBM to VMEM) count in the bytes accessed too (3.6 on a
  v5e for this tree; ~1.0 for leaves too large to prefetch)."""
  return max(1.0, norm_programs(target, "float32, ord 2")[1].passes)


def _show(what: str, target: str, ours: dl.Program, theirs: dl.Program) -> str:
  return (f"{what} on {target}: optaxclip {ours.fusions} fusions / {ours.passes:.4f} passes "
          f"/ readers {max(ours.readers)} ({ours.seconds:.2f} s), reference "
          f"{theirs.fusions} / {theirs.passes:.4f} ({theirs.seconds:.2f} s)")


def shares(target: str) -> pytest.MarkDecorator:
  """The tests of a target's cached programs (`step_program`, `norm_programs`,
  `small_programs`) in one pytest-xdist worker (`make test`'s `--dist
  loadgroup`): each program compiled once in the run (a deviceless compile
  is not kept in JAX's persistent cache)."""
  return pytest.mark.xdist_group(f"deviceless {target}")


def _cases(names, tpu_v5e: tuple[str, ...], tpu_v6e: tuple[str, ...]) -> list:
  """(name, target): every name on the H100 (XLA:GPU, whose fusion choices
  differ most from the CPU's), those of `tpu_v5e` and `tpu_v6e` on the TPUs
  (a TPU compile takes seconds), each in its target's worker (`shares`)."""
  targets = {"h100": tuple(names), "tpu_v5e": tpu_v5e, "tpu_v6e": tpu_v6e}
  return [pytest.param(name, target, id=f"{name}-{target}", marks=shares(target))
          for name in names for target in TARGETS if name in targets[target]]


class Known(NamedTuple):
  """A step that misses the limit today (issue 34): what it measured, which
  it may not exceed (a regression fails), and why it misses."""
  passes: float
  readers: int
  why: str


# What the current code misses (measured 2026-11-28; issue 34); the test
# prints the limit it computes beside each.
KNOWN_STEPS = {
    # The parameters' unit norms are a read of the parameters before AdamW's
    # pass can start: one more than the limit allows (optax's AGC + AdamW:
    # H100 8.441, over it too); the units of 2 entries of this tree's
    # stacked 3-D leaves (optax's units without layer_axis) are written out.
    ("adaptive_grad_clip", "h100"): Known(
        11.278, 2, "AGC reads the gradients and the parameters apart, and writes the "
                   "norms of units of 2 entries out (optax's AGC 8.441)"),
    ("adaptive_grad_clip", "tpu_v5e"): Known(
        25.466, 2, "AGC reads the gradients and the parameters apart (optax's AGC 21.461)"),
    # The window's accumulator is read and written every micro-batch: optax's
    # MultiSteps of the unguarded clip + AdamW pays those two passes too.
    ("dynamic_loss_scale(clip, every_k_steps)", "h100"): Known(
        13.137, 4, "the window's sum is written out, its check re-reads it "
                   "(optax.MultiSteps(optax clip + AdamW) 11.002)"),
    ("dynamic_loss_scale(clip, every_k_steps)", "tpu_v5e"): Known(
        29.129, 2, "the window's sum is written out (optax.MultiSteps(optax clip + AdamW) "
                   "26.630)"),
}


# --------------------------------------------------------------------------
# The helper: private APIs still answer

@pytest.mark.parametrize("target", TARGETS)
def test_the_deviceless_helper_still_answers(target):
  dl.require(PLATFORM[target])
  grads = dl.specs({"w": ((512, 256), jnp.float32), "b": ((256,), jnp.float32)}, target)
  # (and a large constant, which the program's text elides)
  shift = np.random.default_rng(0).standard_normal(256).astype(np.float32)
  double = lambda g: {"w": g["w"] * 2.0, "b": g["b"] * 2.0 + shift}  # noqa: E731
  values = {"w": np.arange(512 * 256, dtype=np.float32).reshape(512, 256),
            "b": np.linspace(-1, 1, 256, dtype=np.float32)}
  try:
    program = dl.compile(double, (grads,))
    doubled = dl.on_cpu(program, double, (grads,))(values)
  except Exception as error:  # noqa: BLE001  (any change of jax's private APIs)
    pytest.fail(f"the deviceless compile for {target}, or its run here, failed "
                f"({type(error).__name__}: {error}): {dl.UPDATE}")
  np.testing.assert_array_equal(doubled["w"], 2 * values["w"], err_msg=dl.UPDATE)
  np.testing.assert_array_equal(doubled["b"], 2 * values["b"] + shift, err_msg=dl.UPDATE)
  # One elementwise kernel per leaf (or one for both), each leaf read once;
  # read and written once: 2.0 passes (a TPU prefetches the small leaf too).
  assert 1 <= program.fusions <= 2 and program.readers == (1, 1), dl.UPDATE
  assert 2.0 <= program.passes <= 2.1, dl.UPDATE
  assert program.conditionals == 0 and program.all_reduces == 0, dl.UPDATE


def test_a_bitcast_runs_here_as_a_reshape_only_between_c_order_layouts():
  # A bitcast reinterprets memory: a reshape where both arrays are laid out
  # in C order (axes of size 1 anywhere), a transpose where not.
  def module(layout: str) -> str:
    return (f"  %a = f32[64,32]{{{layout}}} parameter(0)\n"
            "  ROOT %b = f32[2048]{0} bitcast(%a)\n"
            "  %c = s32[8]{0} parameter(1)\n"
            "  %d = f32[8]{0} bitcast(%c)")
  converted = dl._for_the_cpu(module("1,0"))
  assert "reshape(%a)" in converted and "bitcast-convert(%c)" in converted, converted
  assert "bitcast(" not in converted, converted
  with pytest.raises(NotImplementedError, match="bitcast between layouts"):
    dl._for_the_cpu(module("0,1"))
  with pytest.raises(NotImplementedError, match="shape and element type"):
    dl._for_the_cpu("  %c = s32[2,4]{1,0} parameter(1)\n  %d = f32[8]{0} bitcast(%c)")


@pytest.mark.parametrize("ci", ["true", ""])
def test_missing_packages_skip_with_a_hint_but_fail_in_ci(monkeypatch, ci):
  monkeypatch.setitem(dl.PACKAGES, "cuda", ("optaxclip_no_such_package",))
  monkeypatch.setenv("CI", ci)
  outcome = pytest.fail.Exception if ci else pytest.skip.Exception
  with pytest.raises(outcome, match="optaxclip_no_such_package: install them with"):
    dl.require("cuda")
  assert "pip install -r" in dl.missing("cuda") and "make install-test" in dl.missing("cuda")


def test_requirements_follow_the_installed_jaxlib():
  import importlib.metadata
  jaxlib = importlib.metadata.version("jaxlib")
  wanted = dl.requirements()
  assert f'jax-cuda12-plugin=={jaxlib}; sys_platform == "linux"' in wanted
  assert f'jax-cuda12-pjrt=={jaxlib}; sys_platform == "linux"' in wanted
  assert not any("cuda12]" in r or "with-cuda" in r for r in wanted)  # compile-only
  [tpu] = [r for r in wanted if r.startswith("libtpu")]
  pinned = [r for r in importlib.metadata.requires("jax") if r.startswith("libtpu")]
  assert tpu.split(";")[0] in pinned[0], (tpu, pinned)


# --------------------------------------------------------------------------
# Global norm: one read of each leaf, optax's bytes

@pytest.mark.parametrize("name, target", _cases(
    NORMS, ("float32, ord 2", "float32, ord 1", "float32, ord 3", "bfloat16, ord 2"),
    ("float32, ord 2",)))
def test_global_norm_reads_each_leaf_once(name, target):
  ours, theirs = norm_programs(target, name)
  shown = _show(f"global norm ({name})", target, ours, theirs)
  print(shown)
  assert ours.conditionals == 0, shown
  assert set(ours.readers) == {1}, f"readers per leaf {ours.readers}: {shown}"
  assert ours.passes <= theirs.passes * (1 + TOLERANCE), shown


def test_unit_norms_read_each_leaf_once():
  # AGC's units (optax's: a matrix's columns, a 3-D leaf's axis 0), each
  # leaf's norms broadcast to it as optax.transforms.unitwise_norm gives
  # them. XLA:GPU wrote Blue's three sibling column sums out and read them
  # again (7.35 passes, two readers of a leaf); what may remain above
  # optax's is the norms of units of a few entries written once (2.82).
  target = "h100"
  grads = dl.specs(model(), target)
  ours = dl.compile(lambda g: jax.tree.map(F.unitwise_norm, g), (grads,))
  theirs = dl.compile(lambda g: jax.tree.map(optax.transforms.unitwise_norm, g), (grads,))
  shown = _show("unitwise_norm of every leaf", target, ours, theirs)
  print(shown)
  assert ours.conditionals == 0, shown
  assert set(ours.readers) == {1}, f"readers per leaf {ours.readers}: {shown}"
  assert ours.passes <= theirs.passes + 1.0, shown


# --------------------------------------------------------------------------
# The clip and the guards inside AdamW's step: one more read at most

@pytest.mark.parametrize("name, target", _cases(
    STEPS, ("clip", "clip(groups)", "adaptive_grad_clip",
            "dynamic_loss_scale(clip, every_k_steps)"), ("clip",)))
def test_step_adds_at_most_one_read_to_adamw(name, target):
  ours, adamw = step_program(name, target), step_program("adamw", target)
  limit = (adamw.passes + one_read(target)) * (1 + TOLERANCE)
  label = name if "adamw" in name else f"{name} + adamw"
  shown = (f"{label} on {target}: {ours.fusions} fusions / {ours.passes:.4f} passes / "
           f"readers {max(ours.readers)} ({ours.seconds:.2f} s); adamw alone "
           f"{adamw.fusions} / {adamw.passes:.4f}; limit {limit:.4f}")
  if name == "clip":
    optax_clip = step_program("optax clip", target)
    shown += f"; optax clip + adamw {optax_clip.fusions} / {optax_clip.passes:.4f}"
  print(shown)
  assert ours.conditionals == 0, shown
  known = KNOWN_STEPS.get((name, target))
  if known is None:
    assert max(ours.readers) <= 2, f"readers per leaf {ours.readers}: {shown}"
    assert ours.passes <= limit, shown
    return
  # A known miss: no worse than measured, and taken off the list once met.
  assert not (max(ours.readers) <= 2 and ours.passes <= limit), (
      f"meets the limit now: take it off KNOWN_STEPS ({shown})")
  assert max(ours.readers) <= known.readers, f"more readers than {known}: {shown}"
  assert ours.passes <= known.passes * (1 + TOLERANCE / 10), f"worse than {known}: {shown}"
  pytest.xfail(f"{known.why}: {shown}")


# --------------------------------------------------------------------------
# Sharded: one all-reduce in the whole program (8 TPU v5e chips)

# FSDP-style: every leaf split over the 8 chips along its last axis where it
# divides (the router's 4 experts do not: replicated).
FSDP = jax.tree.map(lambda pair: P(*[None] * (len(pair[0]) - 1), "x") if pair[0][-1] % 8 == 0
                    else P(), model(), is_leaf=lambda x: isinstance(x, tuple))


def _experts() -> tuple[dict, dict, optax.GradientTransformation, object]:
  """docs/experts.md's expert-parallel tree, tree and transform: 8 experts
  split over the mesh, the router replicated."""
  d, h, experts = 256, 512, 8
  tree = {"router": ((d, experts), jnp.float32), "w_in": ((experts, d, h), jnp.float32)}
  specs = {"router": P(), "w_in": P("expert")}
  tx = oc.clip_grad_norm(1.0, axis_name="expert", specs=specs, leaf_norms=True,
                         expert_axis={"router": None, "w_in": 0})
  state_specs = oc.ClipState(*[P()] * 7, leaf_norms={"router": P(), "w_in": P("expert")},
                             stack_norms={"router": None, "w_in": P()})
  return tree, specs, tx, state_specs


@pytest.mark.parametrize("case", ["global norm, FSDP", "clip_grad_norm, experts split"])
def test_sharded_norm_costs_one_all_reduce(case):
  target = "tpu_v5e_8"
  if case == "global norm, FSDP":
    grads, specs = model(), FSDP
    fn = lambda g: F.global_norm(g, axis_name="x", specs=FSDP)
    out_specs = P()
  else:
    grads, specs, tx, state_specs = _experts()
    fn = lambda g: tx.update(g, tx.init(g))
    out_specs = (specs, state_specs)
  args = (dl.specs(grads, target, specs),)
  mesh = dl.mesh(target, tuple(dict.fromkeys(
      a for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)) for a in s if a)))
  program = dl.compile(jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=out_specs),
                       args)
  shown = (f"{case} on {target}: {program.all_reduces} all-reduces, {program.fusions} fusions, "
           f"{program.passes:.4f} passes ({program.seconds:.2f} s)")
  print(shown)
  assert program.conditionals == 0, shown
  assert program.all_reduces == 1, shown


# --------------------------------------------------------------------------
# Small leaves: a handful of kernels (issue 34 item 2)

SMALL_SHAPES = ((64,), (256,), (64, 64), (128, 32), (16, 16, 4))


def small_leaves(count: int = 150) -> dict:
  """`count` small float32 leaves (64 to 4096 entries: norms, biases, heads)."""
  return {f"p{i:04d}": (SMALL_SHAPES[i % len(SMALL_SHAPES)], jnp.float32)
          for i in range(count)}


def lora(layers: int = 10, d: int = 4096, f: int = 11008, rank: int = 16) -> dict:
  """Rank-16 LoRA adapters on the 4 attention and 3 MLP weights of each layer:
  14 leaves a layer (A: [in, rank], B: [rank, out])."""
  weights = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d),
             "gate": (d, f), "up": (d, f), "down": (f, d)}
  return {f"l{i:02d}": {w: {"A": ((n_in, rank), jnp.float32), "B": ((rank, n_out), jnp.float32)}
                        for w, (n_in, n_out) in weights.items()}
          for i in range(layers)}


# A LoRA tree (the has 48 layers, 672 leaves: the benchmark's; 24
# here, 336, for the suite's time) and a tree of small leaves, whose fusions
# the platform's layout decides (``_batching.GPU``: merged, ``TPU``:
# summed); on the TPU only the small tree (its LoRA programs compile for a
# minute).
SMALL_TREES = {"150 small leaves": small_leaves, "LoRA, 24 layers": lambda: lora(24)}
SMALL_NORMS = [("150 small leaves", "h100", "norm"), ("LoRA, 24 layers", "h100", "norm"),
               ("150 small leaves", "tpu_v5e", "norm"),
               # a maximum (the plain one) and the finiteness check of
               # dynamic_loss_scale: over the platform's groups too
               *[("150 small leaves", target, what) for target in ("h100", "tpu_v5e")
                 for what in ("inf norm", "all_finite")]]
SMALL_STEPS = [("LoRA, 24 layers", "h100"), ("150 small leaves", "tpu_v5e")]
LEAVES_PER_FUSION = 30
SMALL_PASSES = 1.05


# The small-leaf programs of the library, and optax's.
SMALL_FNS = {"norm": F.global_norm, "optax norm": optax.tree.norm,
             "inf norm": functools.partial(F.global_norm, ord=INF),
             "optax inf norm": functools.partial(optax.tree.norm, ord=INF),
             "all_finite": F.all_finite}


@functools.cache
def small_programs(tree: str, target: str) -> dict[str, dl.Program]:
  grads = SMALL_TREES[tree]()
  g = dl.specs(grads, target)
  names = ["norm", "optax norm"]
  if (tree, target, "inf norm") in SMALL_NORMS:
    names += ["inf norm", "optax inf norm", "all_finite"]
  programs = {name: dl.compile(SMALL_FNS[name], (g,)) for name in names}
  if (tree, target) in SMALL_STEPS:
    programs.update({"clip + adamw": _step_program(_clipped(), target, grads),
                     "adamw": _step_program(_adamw(), target, grads)})
  return programs


@pytest.mark.parametrize("tree, target, what", [
    pytest.param(*case, marks=shares(case[1])) for case in SMALL_NORMS])
def test_small_leaves_norm_in_a_handful_of_kernels(tree, target, what):
  programs = small_programs(tree, target)
  ours = programs[what]
  theirs = programs["optax norm" if what == "norm" else "optax inf norm"]
  leaves = len(ours.readers)
  shown = _show(f"{what} of {tree} ({leaves} leaves)", target, ours, theirs)
  print(shown)
  # A maximum: each group of 64 merged leaves one reduction, which XLA:GPU
  # splits in two kernels (the 2-norm's rows are its own: _exponent_sums).
  most = (math.ceil(leaves / LEAVES_PER_FUSION) if what == "norm"
          else 2 * math.ceil(leaves / 64) + 1)
  assert ours.conditionals == 0, shown
  assert ours.fusions <= most, shown
  assert set(ours.readers) == {1}, shown
  # (a TPU's prefetch copies count in both: one read is optax's norm there)
  assert ours.passes <= SMALL_PASSES * max(1.0, theirs.passes), shown
  if tree == "150 small leaves":  # its numbers, as the accelerator computes them
    _check_small_numbers(ours, what, target)


def _check_small_numbers(program: dl.Program, what: str, target: str):
  """`program` run here on the small leaves, each of its own magnitude
  (2**-100 to 2**100: every band of the one-pass kernel, groups that mix
  them), against float64; `all_finite` also with one NaN."""
  rng = np.random.default_rng(7)
  values = {name: (rng.standard_normal(shape) * 2.0 ** rng.integers(-100, 100)).astype(np.float32)
            for name, (shape, _) in small_leaves().items()}
  args = (dl.specs(small_leaves(), target),)
  run = dl.on_cpu(program, SMALL_FNS[what], args)
  entries = np.concatenate([np.abs(x.astype(np.float64)).ravel() for x in values.values()])
  if what == "all_finite":
    assert bool(run(values)), target
    values["p0077"].flat[5] = np.nan
    assert not bool(run(values)), target
    return
  want = entries.max() if what == "inf norm" else np.sqrt(np.sum(entries ** 2))
  assert close(np.asarray(run(values))[None], np.asarray([want]), np.float32).all(), (
      f"{what} on {target}: {float(run(values))!r}, exact {want!r}")


@pytest.mark.parametrize("tree, target", [
    pytest.param(*case, marks=shares(case[1])) for case in SMALL_STEPS])
def test_small_leaves_clip_adds_a_handful_of_kernels_to_adamw(tree, target):
  # The clip's own kernels (the norm's, and a few of scalars: the factor,
  # the state), AdamW's kernels each scaling its leaf.
  programs = small_programs(tree, target)
  ours, adamw = programs["clip + adamw"], programs["adamw"]
  one_read = max(1.0, programs["optax norm"].passes)
  leaves = len(ours.readers)
  shown = (f"clip + adamw of {tree} ({leaves} leaves) on {target}: {ours.fusions} "
           f"fusions / {ours.passes:.4f} passes ({ours.seconds:.2f} s); adamw alone "
           f"{adamw.fusions} / {adamw.passes:.4f} ({adamw.seconds:.2f} s)")
  print(shown)
  assert ours.conditionals == 0, shown
  assert max(ours.readers) <= 2, shown
  assert ours.fusions - adamw.fusions <= math.ceil(leaves / LEAVES_PER_FUSION), shown
  assert ours.passes - adamw.passes <= SMALL_PASSES * one_read, shown


# --------------------------------------------------------------------------
# Numbers: the accelerators' programs, run here

# Every order the one-pass kernel serves: its own sums (1, 2), its pairs
# (0.5, 2.5, 3), one above their limit (130), the maximum.
THRESHOLD_ORDERS = (1.0, 2.0, 0.5, 2.5, 3.0, 130.0, INF)
# Zeros after each row: a leaf past the platforms' small-leaf limit
# (``_batching.GPU``/``TPU``: 2**18 entries), reduced as a large one (Blue's
# sibling sums), in batches of this many rows.
LARGE, LARGE_BATCH = 1 << 18, 128


def _threshold_norms(rows):
  """Each row of kernel_table's table, every order: its norm as a total (of
  the row, and of the row cut in three leaves of one shape: a group) and
  as a unit (the per-layer norms of the stacked rows)."""
  return {f"p={p}": norm_views(rows, p) for p in THRESHOLD_ORDERS}


def _large_norms(rows):
  """The norms of 1 and 2 (the kernel's own sums) of each row followed by
  ``LARGE`` zeros: one large leaf a row."""
  padded = jnp.pad(rows, ((0, 0), (0, LARGE)))
  return {f"p={p}": jax.vmap(lambda v: F.global_norm(v, ord=p))(padded) for p in (1.0, 2.0)}


def _run_here(fn, shape: tuple[int, ...], target: str):
  """`fn` of a float32 array of `shape`, compiled for `target` (holding no
  multiplication by a constant 0: issue 32's fold), to run on this CPU."""
  args = (dl.specs((shape, jnp.float32), target),)
  program = dl.compile(fn, args)
  assert zero_multiplies(program.text) == [], target
  return dl.on_cpu(program, fn, args)


@pytest.mark.parametrize("target", ["h100", "tpu_v5e"])
def test_accelerator_norms_are_right_at_every_threshold(target):
  # The one-pass kernel as XLA:GPU and XLA:TPU optimize and fold it (issue
  # 32's defect was a fold: x * 2**-76 * 2**-76 -> x * 0 in float32), run
  # on this CPU on the threshold table: entries of every band mix, every
  # order, small leaves and large ones, against exact references.
  rows, wide = narrow_rows(), table(jnp.float32)
  small = _run_here(_threshold_norms, rows.shape, target)(rows)
  checked = [(rows, p, view, got) for p in THRESHOLD_ORDERS
             for view, got in small[f"p={p}"].items()]
  # Large leaves: the float32 table's rows (the narrower tables' bands are
  # among them), the last batch filled up with rows again.
  large = _run_here(_large_norms, (LARGE_BATCH, WIDTH), target)
  batches = [large(np.resize(wide[i:i + LARGE_BATCH], (LARGE_BATCH, WIDTH)))
             for i in range(0, len(wide), LARGE_BATCH)]
  checked += [(wide, p, "large leaf", np.concatenate([b[f"p={p}"] for b in batches])[:len(wide)])
              for p in (1.0, 2.0)]
  for values, p, view, got in checked:
    want = reference(values, p)
    ok = close(got, want, np.float32)
    assert ok.all(), report(values, got, want, ok, f"{target}, p={p}, {view}")


@pytest.mark.parametrize("target", ["h100", "tpu_v5e"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_accelerator_clips_and_guards_are_right_at_every_threshold(dtype, target):
  # What reads the norm, in the accelerators' programs: the clip, per-expert
  # norms, skip_step(max_norm=...) and dynamic_loss_scale around a clip, as
  # tests/test_kernel_thresholds.py checks them on the CPU's.
  case = GuardCase.of(dtype)
  args = tuple(dl.specs((a.shape, a.dtype), target) for a in case.args)
  program = dl.compile(guard_views, args)
  assert zero_multiplies(program.text) == [], target
  case.check(dl.on_cpu(program, guard_views, args)(*case.args), f"{target}, {dtype}: ")


# --------------------------------------------------------------------------
# Platform branches: what GPU and TPU run instead of the CPU's conditional

def _assert_leaf_close(got, want, what: str):
  """Equal to the float32 rounding of a few operations, relative to the
  leaf's largest entry (an update subtracted from a parameter of its size
  leaves a difference of a few of its ulps), NaN where NaN."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  finite = want[np.isfinite(want)]
  scale = float(np.max(np.abs(finite))) if finite.size else 0.0
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


def _sgd_after(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  return optax.chain(tx, optax.sgd(1.0))


# Each transform with a `lax.platform_dependent` branch, and the scales of
# its gradients step by step: ZClip's warm-up median (selected every step
# on GPU/TPU, in a conditional on the CPU), over a spike and a NaN step;
# dynamic_loss_scale's window check (the sum judged every step on GPU/TPU,
# in a conditional past its bound on the CPU), over a window whose sum
# overflows float32 from finite micro-batches and one with a NaN.
BRANCHED = {
    "zclip": (lambda: _sgd_after(oc.zclip(warmup_steps=3)),
              (1.0, 2.0, 0.5, 1.5, 40.0, 1.0, float("nan"), 1.2)),
    "dynamic_loss_scale(every_k_steps)": (
        lambda: oc.dynamic_loss_scale(initial_scale=1.0, every_k_steps=2,
                                      inner=_sgd_after(oc.clip_by_global_norm(1.0))),
        (1.0, 2.0, 2e38, 2e38, 1.0, float("nan"), 0.5, 1.0)),
}


@pytest.mark.parametrize("target", ["h100", "tpu_v5e"])
@pytest.mark.parametrize("name", list(BRANCHED))
def test_platform_branches_give_the_cpus_numbers(name, target):
  build, scales = BRANCHED[name]
  tx = build()
  rng = np.random.default_rng(3)
  # One entry dominates: scaled by 2e38 a micro-batch's norm is finite,
  # the sum of two is not.
  base = {"w": 1e-3 * rng.standard_normal((8, 4)).astype(np.float32),
          "b": 1e-3 * rng.standard_normal(4).astype(np.float32)}
  base["w"][0, 0] = 1.0
  params = jax.tree.map(np.zeros_like, base)
  step = _stepper(tx)
  state = tx.init(params)
  args = (dl.specs(base, target), dl.specs(state, target), dl.specs(params, target))
  program = dl.compile(step, args, keep_unused=True)
  assert program.conditionals == 0, f"{name} on {target}: the CPU's branch"
  _assert_steps_agree(step, program, args, params, state,
                      [jax.tree.map(lambda x, k=k: x * np.float32(k), base) for k in scales],
                      f"{name} on {target}")


def _assert_steps_agree(step, program: dl.Program, args, params, state, grads: list,
                        what: str, extra: tuple = ()):
  """`step` (`_stepper`) compiled here and `program` (its accelerator's)
  run here, from `params` and `state`, one step per entry of `grads`: the
  same numbers after every step."""
  runs = {"cpu": jax.jit(step), "accelerator": dl.on_cpu(program, step, args)}
  carried = {where: (params, state) for where in runs}
  for k, g in enumerate(grads):
    for where, run in runs.items():
      p, s = carried[where]
      carried[where] = run(g, s, p, *extra)
    jax.tree.map(functools.partial(_assert_leaf_close, what=f"{what}, step {k}"),
                 carried["accelerator"], carried["cpu"])


def _model_values(seed: int) -> dict:
  """Values for `model()`'s leaves: gradients of several magnitudes (each
  leaf scaled by its own power of two, 2**-8 to 2**8: AdamW's second moment
  stays far from float32's subnormals, which XLA:CPU flushes where it
  rounds, and the threshold tests above hold the norms' extremes), or, from
  another seed, parameters."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda pair: (rng.standard_normal(pair[0]) * 2.0 ** rng.integers(-8, 8)
                                    ).astype(np.float32), model(), is_leaf=dl._is_pair)


@shares("h100")
@pytest.mark.parametrize("name", list(STEPS))
def test_step_programs_give_the_cpus_numbers(name):
  # The H100's step program of each transform, run here from a fresh state
  # for two steps, against the CPU's program of the same step.
  tx = STEPS[name]()
  grads, params = _model_values(1), _model_values(2)
  # (QK-Clip's logits: 150, over its threshold of 100, so every head is cut)
  extra = {k: np.full(shape, 150.0, dtype)
           for k, (shape, dtype) in EXTRA_ARGS.get(name, {}).items()}
  step, args = _step_args(tx, "h100", grads, extra)
  _assert_steps_agree(step, step_program(name, "h100"), args, params, tx.init(params),
                      [grads, grads], f"{name} on h100",
                      tuple(extra[n] for n in sorted(extra)))
