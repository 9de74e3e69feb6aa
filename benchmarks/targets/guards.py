"""Guarded compositions (`guards`): the passes over the gradient tree that
`skip_step` and `dynamic_loss_scale` add to a clipped AdamW step, beside
Optax's nearest equivalents and a hand-written floor; their compile times."""

import functools
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optaxclip as oc
from benchmarks import _candidates, _cost, _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, verdict
from benchmarks._timing import median_ratio, rotated, timed_compile
from benchmarks.targets._base import Target, describe_tree

TITLE = "Guarded compositions: what skip_step and dynamic_loss_scale add"
LIMIT = 0.25  # passes beyond the clipped step, over what the floor's rollback adds
BASE = "chain(clip, adamw)"
FLOOR = "hand-written AdamW + exact rollback (floor)"


def _clip() -> optax.GradientTransformation:
  return optax.chain(oc.clip_by_global_norm(1.0), optax.adamw(1e-3))


# Every composition: (a fresh transform, whether `update` takes `loss=`).
# optaxclip's are judged; optax's are the references.
JUDGED: dict[str, tuple[Callable[[], optax.GradientTransformation], bool]] = {
    "skip_step(adamw)": (lambda: oc.skip_step(optax.adamw(1e-3)), False),
    "skip_step(chain(clip, adamw), zscore=6, loss_zscore=6)": (
        lambda: oc.skip_step(_clip(), zscore=6.0, loss_zscore=6.0), True),
    "dynamic_loss_scale(chain(clip, adamw))": (
        lambda: oc.dynamic_loss_scale(_clip()), False),
    "dynamic_loss_scale(skip_step(chain(clip, adamw), zscore=6))": (
        lambda: oc.dynamic_loss_scale(oc.skip_step(_clip(), zscore=6.0)), False),
}
REFERENCES: dict[str, tuple[Callable[[], optax.GradientTransformation], bool]] = {
    "optax.apply_if_finite(chain(clip, adamw), 10)": (
        lambda: optax.apply_if_finite(_clip(), 10), False),
    "chain(optax.clip_by_global_norm(1.0), adamw)": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), False),
}
COMPOSITIONS = {BASE: (_clip, False), **JUDGED, **REFERENCES}
SCALAR = jax.ShapeDtypeStruct((), jnp.float32)


def _program(name: str, grads: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """`(step, args)`: composition `name`'s update and `apply_updates`, for
  `grads` (shape/dtype structs; the parameters shaped alike). A loss, when
  taken, is an argument: a constant could be folded away."""
  build, takes_loss = COMPOSITIONS[name]
  tx = build()
  state = jax.eval_shape(tx.init, grads)

  def step(grads, state, params, *loss):
    updates, state = tx.update(grads, state, params, **({"loss": loss[0]} if loss else {}))
    return optax.apply_updates(params, updates), state

  return step, (grads, state, grads, *((SCALAR,) if takes_loss else ()))


def _passes(name: str, grads: Any) -> float:
  fn, args = _program(name, grads)
  return _cost.passes(fn, *args)


def _floor(grads: Any) -> dict[str, float]:
  """Passes of the hand-written AdamW step, plain and with its exact rollback."""
  state = jax.eval_shape(_candidates.handwritten_adamw_init, grads)
  skip = jax.ShapeDtypeStruct((), jnp.bool_)
  return {key: _cost.passes(_candidates.handwritten_adamw_step(rollback), grads, state,
                            grads, skip)
          for key, rollback in (("plain", False), ("rollback", True))}


def _compiles(grads: Any, config: Config) -> tuple[dict[str, list[float]], dict[str, float]]:
  """Fresh compiles of every composition's step, in rotated rounds: their
  seconds, and the passes of each program (its first compile's)."""
  builds = {name: functools.partial(_program, name, grads) for name in COMPOSITIONS}
  samples: dict[str, list[float]] = {name: [] for name in builds}
  passes: dict[str, float] = {}

  def compile_(name):
    seconds, compiled = timed_compile(builds[name])
    passes.setdefault(name, _cost.compiled_bytes(compiled) / _trees.tree_bytes(grads))
    return seconds

  for name in builds if config.discard_first_compiles else ():
    compile_(name)  # the first compiles also set up XLA: discarded
  for round_ in range(config.guard_compile_repeats):
    for name in rotated(list(builds), round_):
      samples[name].append(compile_(name))
  return samples, passes


def measure(config: Config, *, rescue: bool) -> dict[str, Any]:
  grads = _trees.structs(_trees.transformer_shapes(**config.transformer))
  if not rescue:  # optaxclip's only: optax has no rescue branch
    try:
      _cost.without_rescue_branch()
      return {"passes": {name: _passes(name, grads) for name in (BASE, *JUDGED)}}
    except _cost.NoBuildWithoutRescue as error:  # a note in the report, not a crash
      print(f"\nguards: {error}", file=sys.stderr, flush=True)
      return {"error": str(error)}
  samples, passes = _compiles(grads, config)
  return {"tree": describe_tree(grads), "passes": passes, "floor": _floor(grads),
          "compile": samples}


def jobs(config: Config) -> list[dict[str, Any]]:
  del config
  return [{"rescue": True}, {"rescue": False}]


def _traffic_rows(result: dict[str, Any], without: dict[str, Any]
                  ) -> tuple[list[list[str]], list[Check]]:
  passes, plain = result["passes"], without.get("passes")
  base = passes[BASE]
  floor = result["floor"]["rollback"] - result["floor"]["plain"]
  rows = [[BASE, f"{base:.3f}", "—",
           "—" if plain is None else f"— ({plain[BASE]:.3f} passes)", "", "baseline"],
          [FLOOR, f"{result['floor']['rollback']:.3f}",
           f"{floor:+.3f} (over its plain step, {result['floor']['plain']:.3f})", "—", "",
           "floor"]]
  checks = [Check(f"{FLOOR}: passes beyond the same step without rollback", f"{floor:+.3f}",
                  "for information", None)]
  for name in COMPOSITIONS:
    if name == BASE:
      continue
    extra = passes[name] - base
    judged = name in JUDGED
    passed = extra <= floor + LIMIT if judged else None
    threshold = f"<= floor {floor:+.3f} + {LIMIT}"
    without_rescue = ("—" if plain is None or name not in plain
                      else f"{plain[name] - plain[BASE]:+.3f}")
    rows.append([name, f"{passes[name]:.3f}", f"**{extra:+.3f}**" if judged else
                 f"{extra:+.3f}", without_rescue, threshold if judged else "reference",
                 verdict(passed)])
    if judged:
      checks.append(Check(f"{name}: passes beyond {BASE}", f"{extra:+.3f}", threshold,
                          passed))
  return rows, checks


def _compile_rows(samples: dict[str, list[float]]) -> list[list[str]]:
  rows = []
  for name in COMPOSITIONS:
    ratio = "—" if name == BASE else f"{median_ratio(samples[name], samples[BASE]):.2f}"
    rows.append([name, f"{statistics.median(samples[name]):.2f}", ratio, "info"])
  return rows


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  result, without = results
  rows, checks = _traffic_rows(result, without)
  floor = result["floor"]["rollback"] - result["floor"]["plain"]
  notes = [f"The floor: optax.adamw's step written out by hand, its moments, count and "
           f"update kept with `jnp.where(skip, old, new)` (`skip` an input), against the "
           f"same program without them: what an exact rollback costs on "
           f"{config.platform} here, {floor:+.3f} passes; each composition may add "
           f"{LIMIT} more (a guard is a scalar decision from the clip's own read)."]
  if "error" in without:
    notes.append(f"No build without the rescue branch: {without['error']}")
  return Section(
      key="guards", title=TITLE,
      measured=(f"XLA's cost analysis of `jit(step)` (the update and `apply_updates`) "
                f"on the transformer tree ({result['tree']}), in passes over the "
                f"gradient tree; compile times are medians of "
                f"{config.guard_compile_repeats} fresh compiles per step, ratios medians "
                f"of the per-round ratios."),
      tables=[Table(["step", "passes", f"beyond {BASE}",
                     "beyond, without the rescue branch", "threshold", "status"], rows,
                    caption="Passes over the gradient tree:"),
              Table(["step", "compile (s)", f"/ {BASE}", "status"],
                    _compile_rows(result["compile"]),
                    caption="Compile time of the step (for information):")],
      checks=checks, notes=notes)


TARGET = Target("guards", measure, render, jobs)
