"""The programs an H100 and a TPU v5e run, compiled here without a device
(`accelerators`): kernels, reads of each gradient, passes and compile time,
beside optax's."""

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optaxclip as oc
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, verdict
from benchmarks.targets._base import Target

TITLE = "The accelerators' programs, compiled without a device"
PLATFORMS = {"h100": "H100", "tpu_v5e": "TPU v5e"}
TREES = ("llm", "small", "lora")
LEAVES_PER_FUSION, SMALL_PASSES = 30, 1.05  # issue 34, item 2
TOLERANCE = 0.01  # of optax's bytes (the norm), of AdamW's + one pass (a step)
COMPILE_RATIO = 1.5  # the compile against optax's counterpart
SMALL_SHAPES = ((64,), (256,), (64, 64), (128, 32), (16, 16, 4))
# A step whose program the chip's memory cannot hold (XLA:TPU refuses to
# compile it: the 0.74B tree's window accumulator on a 16 GB v5e): why.
UNFIT = "unfit"


def deviceless() -> Any:
  """tests/deviceless.py, the one module that touches jax's private
  deviceless APIs (shared with the tests)."""
  if "deviceless" not in sys.modules:
    path = Path(__file__).resolve().parents[2] / "tests" / "deviceless.py"
    spec = importlib.util.spec_from_file_location("deviceless", path)
    assert spec is not None and spec.loader is not None, path
    sys.modules["deviceless"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  return sys.modules["deviceless"]


def llm_tree(vocab: int, d: int, layers: int, f: int, heads: int, experts: int) -> dict:
  """A decoder of stacked layers, its MLP split into `experts` experts, as
  (shape, dtype) pairs: 0.74B float32 parameters at the full run's sizes."""
  pair = lambda *shape: (shape, jnp.float32)
  attn = {n: pair(layers, d, heads, d // heads) for n in ("query", "key", "value")}
  return {"embed": pair(vocab, d), "head": pair(d, vocab), "ln_f": pair(d),
          "layers": {"attn": {**attn, "out": pair(layers, d, d)},
                     "ln1": pair(layers, d), "ln2": pair(layers, d),
                     "router": pair(layers, d, experts),
                     "w1": pair(layers, experts, d, f // experts),
                     "w2": pair(layers, experts, f // experts, d)}}


def small_tree(count: int) -> dict:
  """`count` small float32 leaves of 64 to 4096 entries."""
  return {f"p{i:04d}": (SMALL_SHAPES[i % len(SMALL_SHAPES)], jnp.float32)
          for i in range(count)}


def lora_tree(layers: int, d: int = 4096, f: int = 11008, rank: int = 16) -> dict:
  """Rank-`rank` LoRA adapters (A, B) on the 4 attention and 3 MLP weights of
  each layer: 14 leaves a layer, 672 for 48 layers."""
  weights = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d),
             "gate": (d, f), "up": (d, f), "down": (f, d)}
  return {f"l{i:02d}_{w}_{m}": (shape, jnp.float32) for i in range(layers)
          for w, (n_in, n_out) in weights.items()
          for m, shape in (("A", (n_in, rank)), ("B", (rank, n_out)))}


def _llm_steps() -> dict[str, Any]:
  """Every transform, in AdamW's step, for `llm_tree`: its builder and optax's
  counterpart's (None: optax has none)."""
  layer_axis = {"embed": None, "head": None, "ln_f": None, "layers": 0}
  experts = {"embed": None, "head": None, "ln_f": None,
             "layers": {"attn": None, "ln1": None, "ln2": None, "router": None,
                        "w1": 1, "w2": 1}}
  frozen = lambda g: jax.tree_util.tree_map_with_path(
      lambda path, _: "router" not in jax.tree_util.keystr(path), g)
  heads = oc.AttentionHeads(query="layers/attn/query", key="layers/attn/key", layer_axis=0)
  adamw = lambda: optax.adamw(1e-3)
  clip = lambda **kw: optax.chain(oc.clip_by_global_norm(1.0, **kw), adamw())
  optax_clip = lambda: optax.chain(optax.clip_by_global_norm(1.0), adamw())
  return {
      "clip": (clip, optax_clip),
      "clip(leaf_norms, layer_axis)": (lambda: clip(leaf_norms=True, layer_axis=layer_axis),
                                       optax_clip),
      "clip(leaf_norms, layer_axis, expert_axis)": (
          lambda: clip(leaf_norms=True, layer_axis=layer_axis, expert_axis=experts), None),
      "clip(mask)": (lambda: clip(mask=frozen), None),
      "clip(scale_only)": (lambda: clip(scale_only={"embed": True, "head": True, "ln_f": True,
                                                    "layers": False}), None),
      "clip(groups)": (lambda: clip(groups={"embed": "e", "head": "h", "ln_f": "b",
                                            "layers": "b"}), None),
      "adaptive_grad_clip": (lambda: optax.chain(oc.adaptive_grad_clip(0.01), adamw()),
                             lambda: optax.chain(optax.adaptive_grad_clip(0.01), adamw())),
      "clip_by_block_rms": (lambda: optax.chain(oc.clip_by_block_rms(0.01), adamw()),
                            lambda: optax.chain(optax.clip_by_block_rms(0.01), adamw())),
      "zclip": (lambda: optax.chain(oc.zclip(), adamw()), None),
      "adagc": (lambda: optax.chain(oc.adagc(), adamw()), None),
      "adamw, qk_clip": (lambda: optax.chain(adamw(), oc.qk_clip(100.0, heads=heads)), None),
      "skip_step(clip, zscore)": (lambda: oc.skip_step(clip(), zscore=6.0), None),
      "skip_step(clip, zscore, window)": (lambda: oc.skip_step(clip(), zscore=6.0, window=16),
                                          None),
      "dynamic_loss_scale(clip)": (lambda: oc.dynamic_loss_scale(clip()), None),
      "dynamic_loss_scale(clip, every_k_steps)": (
          lambda: oc.dynamic_loss_scale(clip(), every_k_steps=4), None),
  }


def _tree(config: Config, name: str) -> dict:
  if name == "llm":
    return llm_tree(**config.accelerator_llm)
  if name == "small":
    return small_tree(config.accelerator_small_leaves)
  return lora_tree(config.accelerator_lora_layers)


def _numbers(program: Any) -> dict[str, Any]:
  readers = program.readers
  return {"fusions": program.fusions, "passes": program.passes, "seconds": program.seconds,
          "readers_max": max(readers), "readers_mean": sum(readers) / len(readers),
          "conditionals": program.conditionals, "leaves": len(readers)}


def _step(dl: Any, tx: optax.GradientTransformation, target: str, grads: dict,
          heads: tuple[int, int] | None, keep_state: bool) -> dict[str, Any]:
  """The compiled step (the update and optax.apply_updates), read: returning
  the parameters and the state, both donated as a training step's are; or
  (`keep_state` False) the parameters only, not donated: a TPU v5e chip's
  16 GB holds the 0.74B tree's gradients, parameters and moments and the new
  parameters, not the new moments too (the moments are still computed)."""
  g = dl.specs(grads, target)
  state = dl.specs(jax.eval_shape(tx.init, g), target)
  args = (g, state, g)
  if heads is not None:
    args += (dl.specs(jax.ShapeDtypeStruct(heads, jnp.float32), target),)

  def step(u, s, p, *logits):
    updates, s = tx.update(u, s, p, **({"max_logits": logits[0]} if logits else {}))
    p = optax.apply_updates(p, updates)
    return (p, s) if keep_state else p

  return _numbers(dl.compile(step, args, donate=(1, 2) if keep_state else ()))


def measure(config: Config, *, target: str, tree: str) -> dict[str, Any]:
  dl = deviceless()
  reason = dl.missing(dl.TARGETS[target][0])
  if reason:
    return {"missing": reason}
  grads = _tree(config, tree)
  g = dl.specs(grads, target)
  out: dict[str, Any] = {}
  for name, fn in (("global norm", oc.functional.global_norm),
                   ("optax global norm", optax.tree.norm)):
    jax.clear_caches()
    out[name] = _numbers(dl.compile(fn, (g,)))
  steps = _llm_steps() if tree == "llm" else {"clip": _llm_steps()["clip"]}
  names = [n for n in steps if config.accelerator_steps is None or n == "clip"
           or n in config.accelerator_steps]  # the clip always: the thresholds need it
  heads = (config.accelerator_llm["layers"], config.accelerator_llm["heads"])
  for name in ["adamw", *names]:
    ours, theirs = (lambda: optax.adamw(1e-3), None) if name == "adamw" else steps[name]
    for label, build in ((name, ours), (f"optax {name}", theirs)):
      if build is not None:
        jax.clear_caches()
        try:
          out[label] = _step(dl, build(), target, grads,
                             heads if "qk_clip" in name else None, keep_state=tree != "llm")
        except jax.errors.JaxRuntimeError as error:  # a program the chip cannot hold
          if "RESOURCE_EXHAUSTED" not in str(error):
            raise
          out[label] = {UNFIT: str(error).split("RESOURCE_EXHAUSTED: ")[-1].strip()}
  return out


def jobs(config: Config) -> list[dict[str, Any]]:
  return [{"target": target, "tree": tree} for target in config.accelerator_targets
          for tree in TREES]


def _floor(result: dict[str, Any]) -> float:
  """One read of the tree: 1.0, or optax's norm where XLA:TPU's prefetch
  copies (HBM to VMEM) count in the bytes accessed too."""
  return max(1.0, result["optax global norm"]["passes"])


def _checks(tree: str, result: dict[str, Any]) -> dict[str, tuple[str, bool]]:
  """Per program: its threshold and whether it holds."""
  norm, adamw, floor = result["global norm"], result["adamw"], _floor(result)
  out = {}
  if tree == "llm":
    limit = result["optax global norm"]["passes"] * (1 + TOLERANCE)
    out["global norm"] = (f"1 read/leaf, <= {limit:.4f} passes",
                          norm["readers_max"] == 1 and norm["passes"] <= limit)
    limit = (adamw["passes"] + floor) * (1 + TOLERANCE)
    for name, step in result.items():
      if name not in ("global norm", "adamw") and not name.startswith("optax") \
          and UNFIT not in step:
        out[name] = (f"<= 2 reads/leaf, <= {limit:.4f} passes",
                     step["readers_max"] <= 2 and step["passes"] <= limit)
  else:
    most = math.ceil(norm["leaves"] / LEAVES_PER_FUSION)  # 67 for 2000, 23 for 672
    out["global norm"] = (f"<= {most:.0f} fusions, <= {SMALL_PASSES * floor:.4f} passes",
                          norm["fusions"] <= most and norm["passes"] <= SMALL_PASSES * floor)
    step = result["clip"]
    out["clip"] = (f"<= adamw + {most:.0f} fusions, + {SMALL_PASSES * floor:.4f} passes",
                   step["fusions"] - adamw["fusions"] <= most
                   and step["passes"] - adamw["passes"] <= SMALL_PASSES * floor)
  return {name: (text, ok and result[name]["conditionals"] == 0)
          for name, (text, ok) in out.items()}


def _row(name: str, ours: dict[str, Any], theirs: dict[str, Any] | None,
         check: tuple[str, bool] | None) -> list[str]:
  if UNFIT in ours:
    return [name, "–", "–", "–", "–", f"not compiled: {ours[UNFIT]}", verdict(None)]
  theirs = None if theirs is None or UNFIT in theirs else theirs
  pair = lambda key, fmt: (f"{ours[key]:{fmt}} / {theirs[key]:{fmt}}" if theirs
                           else f"{ours[key]:{fmt}} / –")
  ratio = f" ({ours['seconds'] / theirs['seconds']:.1f}x)" if theirs else ""
  return [name, pair("fusions", "d"), f"{ours['readers_max']} / {ours['readers_mean']:.2f}",
          pair("passes", ".4f"), pair("seconds", ".2f") + ratio,
          check[0] if check else "", verdict(check[1] if check else None)]


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  tables, checks, notes = [], [], []
  for job, result in zip(jobs(config), results):
    target, tree = job["target"], job["tree"]
    if "missing" in result:
      notes.append(f"{PLATFORMS[target]}, {tree}: not measured: {result['missing']}")
      continue
    verdicts = _checks(tree, result)
    rows = [_row("global norm", result["global norm"], result["optax global norm"],
                 verdicts["global norm"]),
            _row("adamw alone", result["adamw"], None, None)]
    for name in result:
      if name not in ("global norm", "optax global norm", "adamw") and \
          not name.startswith("optax "):
        rows.append(_row(f"{name} + adamw" if "adamw" not in name else name, result[name],
                         result.get(f"optax {name}"), verdicts.get(name)))
    leaves = result["global norm"]["leaves"]
    where = f"{PLATFORMS[target]}, {tree} ({leaves} leaves)"
    tables.append(Table(["program", "fusions (optaxclip / optax)",
                         "reads per leaf (max / mean)", "passes (optaxclip / optax)",
                         "compile s (optaxclip / optax)", "threshold", "status"], rows,
                        caption=f"{where}:"))
    checks += [Check(f"{where}: {name}", f"{result[name]['fusions']} fusions, "
                     f"{result[name]['passes']:.4f} passes", text, ok)
               for name, (text, ok) in verdicts.items()]
    if tree != "lora":
      for name in ("global norm", "clip"):
        reference = result.get(f"optax {name}") or result["optax global norm"]
        ratio = result[name]["seconds"] / reference["seconds"]
        checks.append(Check(f"{where}: {name} compile / optax's", f"{ratio:.2f}x",
                            f"<= {COMPILE_RATIO}x", ratio <= COMPILE_RATIO))
  llm = config.accelerator_llm
  return Section(
      key="accelerators", title=TITLE,
      measured=(f"Deviceless compiles (tests/deviceless.py) for an {PLATFORMS['h100']} and a "
                f"{PLATFORMS['tpu_v5e']}, each target and tree in a process of its own: the "
                f"decoder of {llm['layers']} stacked layers (d_model {llm['d']}, "
                f"{llm['experts']} experts), {config.accelerator_small_leaves} small leaves, "
                f"and LoRA adapters on {config.accelerator_lora_layers} layers."),
      tables=tables or [Table(["program", "threshold", "status"], [])], checks=checks,
      notes=[*notes, "Passes: XLA's cost analysis of bytes accessed over the gradients' bytes; "
             "XLA:TPU's prefetch copies count in it, so on a TPU one read is optax's norm's "
             "passes (the floor the small-leaf thresholds scale by). A step returns the "
             "parameters (the 0.74B tree: AdamW alone reads the gradients, parameters and "
             "moments and writes the parameters, 5.0 passes) or, donated, the parameters and "
             "the state (the other trees: XLA then copies the donated moments too, 11.0)."])


TARGET = Target("accelerators", measure, render, jobs, env={"JAX_PLATFORMS": "cpu"})
