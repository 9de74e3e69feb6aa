"""Memory traffic read from XLA's cost analysis: deterministic, unlike a time.

`bytes accessed` of a compiled program counts every byte its operations read
and write, both sides of a `lax.cond` included. Divided by the bytes of the
gradient tree it gives passes over the tree: an elementwise pass that writes
a new tree is 2.0, a clip alone at least 3.0 (a read for the norm, then read
and write to scale), and a clip inside AdamW's step at least 1.0 more than
AdamW alone (the norm's read; the factor fuses into AdamW's own pass).
"""

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import jax
import optax

from benchmarks import _candidates, _trees


class NoBuildWithoutRescue(RuntimeError):
  """The library changed: the build without the rescue branch cannot be made."""


_without_rescue = False  # whether this process builds norms without the rescue


def bytes_accessed(fn: Callable[..., Any], *args: Any) -> float:
  """XLA's `bytes accessed` for `jax.jit(fn)` compiled for `args`."""
  return compiled_bytes(jax.jit(fn).lower(*args).compile())


def compiled_bytes(compiled: Any) -> float:
  """XLA's `bytes accessed` of a compiled program."""
  if _without_rescue and " conditional(" in compiled.as_text():  # the HLO op
    raise NoBuildWithoutRescue(
        "benchmarks/_cost.py: a program still has a conditional with "
        "OPTAXCLIP_RESCUE=off: the rescue is built elsewhere now; "
        "update without_rescue_branch()")
  analysis = compiled.cost_analysis()
  if isinstance(analysis, list):  # older jax: one dict per computation
    analysis = analysis[0]
  return float(analysis["bytes accessed"])


def passes(fn: Callable[..., Any], *args: Any) -> float:
  """`bytes_accessed(fn, *args)` over the bytes of `args[0]`: passes over
  the gradient tree."""
  return bytes_accessed(fn, *args) / _trees.tree_bytes(args[0])


def alone(tx: optax.GradientTransformation, grads: Any) -> float:
  """Passes over `grads` of `jit(tx.update)(grads, state)`."""
  return passes(tx.update, grads, jax.eval_shape(tx.init, grads))


def step(clip: optax.GradientTransformation | None, grads: Any) -> float:
  """Passes over `grads` of a whole AdamW step after `clip` (None: no clip),
  with parameters shaped as `grads`."""
  tx, fn = _candidates.adamw_step(clip)
  return passes(fn, grads, jax.eval_shape(tx.init, grads), grads)


def traffic(clip_names: list[str], trees: dict[str, Any], *, rescue: bool = True
            ) -> dict[str, dict[str, Any]]:
  """For each of `trees` (shape/dtype structs, by name): its bytes, the passes
  over it of AdamW's step and, for each clip in `_candidates.CLIPS` named, of
  the clip alone and added to that step.

  With `rescue=False`, in a build without the norm's rescue branch: only in
  a fresh process (`_timing.in_fresh_process`), which this one patches.
  """
  if not rescue:
    without_rescue_branch()
  results = {}
  for tree_name, grads in trees.items():
    adamw = step(None, grads)
    result: dict[str, Any] = {"tree_bytes": _trees.tree_bytes(grads), "adamw step": adamw}
    for name in clip_names:
      clip = _candidates.CLIPS[name]
      result[name] = {"alone": alone(clip(), grads),
                      "step extra": step(clip(), grads) - adamw}
    results[tree_name] = result
  return results


def without_rescue_branch() -> None:
  """Builds norms without their overflow rescue, in this process.

  Cost analysis counts both sides of the norm's `lax.cond`, though the
  rescue runs only when the plain sum of squares overflows or underflows; a
  build without it measures the rescue's share of the traffic. Through the
  library's documented setting `OPTAXCLIP_RESCUE=off` (docs/design.md):
  every program compiled afterwards is checked to have no conditional left
  (`bytes_accessed` raises otherwise). Call it only in a fresh process:
  nothing else should run without the rescue: the main process refuses.
  """
  if multiprocessing.parent_process() is None:
    raise RuntimeError("benchmarks/_cost.py: the build without the rescue branch "
                       "patches the library: run it with _timing.in_fresh_process")
  os.environ["OPTAXCLIP_RESCUE"] = "off"
  jax.clear_caches()  # the norms are jit-cached: none traced before may stay
  global _without_rescue
  _without_rescue = True
