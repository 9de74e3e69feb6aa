"""QK-Clip against a hand-written rescale (`qk_clip`): the run time and
compile time of `chain(adamw, qk_clip)` beside AdamW followed by the few
lines of jnp a user would write to rescale the same heads."""

import functools
import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxclip as oc
from benchmarks import _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, ms, verdict
from benchmarks._timing import interleaved_samples, median_ratio, rotated, timed_compile
from benchmarks.targets._base import Target, describe_tree

TITLE = "QK-Clip against a hand-written rescale"
LIMIT = 1.25  # run time / the hand-written rescale's step
TAU = 100.0
JUDGED, BY_HAND, ADAMW = ("chain(adamw, qk_clip)", "adamw + hand-written rescale",
                          "adamw alone")
STEPS = (JUDGED, BY_HAND, ADAMW)
HEADS = oc.AttentionHeads(query="layers/attn/query", key="layers/attn/key", layer_axis=0)


def attention_shapes(vocab: int, d_model: int, layers: int) -> dict[str, Any]:
  """A decoder's parameters, layers stacked (`nn.scan`), flax-style attention:
  kernels `[layers, in, heads, head_dim]`, biases `[layers, heads, head_dim]`."""
  d, heads = d_model, max(2, d_model // 64)
  head_dim = d // heads
  projection = {"kernel": (layers, d, heads, head_dim), "bias": (layers, heads, head_dim)}
  return {
      "embed": (vocab, d),
      "layers": {"attn": {"query": projection, "key": projection, "value": projection,
                          "out": {"kernel": (layers, heads, head_dim, d)}},
                 "mlp": {"up": (layers, d, 4 * d), "down": (layers, 4 * d, d)},
                 "norm": (layers, 2, d)},
  }


def _heads(shapes: Any) -> int:
  return shapes["layers"]["attn"]["query"]["bias"][1]


def _rescale_by_hand(params: Any, max_logits: jax.Array) -> Any:
  """What a user writes after `apply_updates`: sqrt(tau / S) on both sides."""
  root = jnp.sqrt(jnp.where(max_logits > TAU, TAU / max_logits, 1.0))  # [layers, heads]
  attn = dict(params["layers"]["attn"])
  for side in ("query", "key"):
    attn[side] = {"kernel": attn[side]["kernel"] * root[:, None, :, None],
                  "bias": attn[side]["bias"] * root[:, :, None]}
  return {**params, "layers": {**params["layers"], "attn": attn}}


def _step(name: str) -> tuple[optax.GradientTransformation, Callable[..., Any]]:
  """`(tx, step)`: `step(grads, state, params, max_logits)` -> new params, state."""
  if name == JUDGED:
    tx = optax.chain(optax.adamw(1e-3), oc.qk_clip(TAU, heads=HEADS))
  else:
    tx = optax.adamw(1e-3)

  def step(grads, state, params, max_logits):
    if name == JUDGED:
      updates, state = tx.update(grads, state, params, max_logits=max_logits)
      return optax.apply_updates(params, updates), state
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return (_rescale_by_hand(params, max_logits) if name == BY_HAND else params), state

  return tx, step


def _program(name: str, shapes: Any, logits: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  """A fresh transform and fresh shape/dtype structs: what a timed compile takes."""
  tx, step = _step(name)
  params = _trees.structs(shapes)
  return step, (params, jax.eval_shape(tx.init, params), params, logits)


def _compiles(shapes: Any, logits: Any, config: Config
              ) -> tuple[dict[str, list[float]], dict[str, Any]]:
  """Fresh compiles of every step in rotated rounds: their seconds, and each
  step's first executable (timed at run time: no compile beyond these)."""
  builds = {name: functools.partial(_program, name, shapes, logits) for name in STEPS}
  samples: dict[str, list[float]] = {name: [] for name in STEPS}
  executables: dict[str, Any] = {}

  def compile_(name):
    seconds, compiled = timed_compile(builds[name])
    executables.setdefault(name, compiled)
    return seconds

  for name in STEPS if config.discard_first_compiles else ():
    compile_(name)  # the first compiles also set up XLA: discarded
  for round_ in range(config.guard_compile_repeats):
    for name in rotated(list(STEPS), round_):
      samples[name].append(compile_(name))
  return samples, executables


def measure(config: Config) -> dict[str, Any]:
  layers = config.scanned_layers[0]
  shapes = attention_shapes(config.scanned["vocab"], config.scanned["d_model"], layers)
  grads, params = _trees.normal_tree(shapes, seed=0), _trees.normal_tree(shapes, seed=1)
  # Half the heads a little past the threshold, as in training with QK-Clip on.
  logits = jnp.asarray(np.linspace(50.0, 150.0, layers * _heads(shapes), dtype=np.float32)
                       .reshape(layers, -1))
  compile_samples, executables = _compiles(
      shapes, jax.ShapeDtypeStruct(logits.shape, logits.dtype), config)
  calls, attn = {}, {}
  for name in STEPS:
    state = _step(name)[0].init(params)
    calls[name] = functools.partial(executables[name], grads, state, params, logits)
    attn[name] = calls[name]()[0]["layers"]["attn"]
  same = [np.mean(np.asarray(a) == np.asarray(b)) for a, b in
          zip(*(jax.tree.leaves({side: attn[name][side] for side in ("query", "key")})
                for name in (JUDGED, BY_HAND)))]
  return {"tree": describe_tree(grads), "layers": layers, "heads": _heads(shapes),
          "samples": interleaved_samples(calls, config.repeats),
          "compile": compile_samples, "same": float(np.mean(same))}


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  [result] = results
  run, compile_ = result["samples"], result["compile"]
  ratio = median_ratio(run[JUDGED], run[BY_HAND])
  compile_ratio = median_ratio(compile_[JUDGED], compile_[BY_HAND])
  rows = []
  for name in STEPS:
    judged = name == JUDGED
    run_ratio = median_ratio(run[name], run[BY_HAND])
    rows.append([name, ms(statistics.median(run[name])),
                 f"**{run_ratio:.2f}**" if judged else f"{run_ratio:.2f}",
                 f"{statistics.median(compile_[name]):.2f}",
                 f"{median_ratio(compile_[name], compile_[BY_HAND]):.2f}",
                 f"<= {LIMIT}" if judged else "reference" if name == BY_HAND else "",
                 verdict(ratio <= LIMIT) if judged else "info"])
  return Section(
      key="qk_clip", title=TITLE,
      measured=(f"`jit(step)` (the update, `apply_updates` and, by hand, the rescale) "
                f"on an attention tree of {result['layers']} stacked layers of "
                f"{result['heads']} heads ({result['tree']}), half the heads past the "
                f"threshold; run times over {config.repeats} rounds, compile times "
                f"medians of {config.guard_compile_repeats} fresh compiles per step, "
                f"ratios medians of the per-round ratios."),
      tables=[Table(["step", "run (ms)", f"run / {BY_HAND}", "compile (s)",
                     f"compile / {BY_HAND}", "threshold", "status"], rows)],
      checks=[Check(f"{JUDGED} run time / {BY_HAND}", f"{ratio:.2f}", f"<= {LIMIT}",
                    ratio <= LIMIT),
              Check(f"{JUDGED} compile time / {BY_HAND}", f"{compile_ratio:.2f}",
                    "for information", None)],
      notes=[f"Query and key entries equal bit for bit in both steps' new weights: "
             f"{result['same']:.2%}. The rest differ mostly where XLA fuses AdamW's "
             f"last multiply into `apply_updates`' add in the hand-written step, so "
             f"that its `p + u` is not rounded as written (AdamW alone differs from a "
             f"float32 `p + u` as often); `qk_clip` lands on the rounded `(p + u) * f` "
             f"(docs/qk_clip.md, Exactness)."],
      bars_ms={name: statistics.median(run[name]) * 1e3 for name in STEPS})


TARGET = Target("qk_clip", measure, render)
