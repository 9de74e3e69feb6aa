"""The overflow-safe norm costs nothing when the rescue does not run
(`fallback`)."""

import statistics
from typing import Any

import jax
import jax.numpy as jnp

import optaxclip as oc
from benchmarks import _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, ms, verdict
from benchmarks._timing import interleaved_samples, median_ratio, median_time
from benchmarks.targets._base import Target, describe_tree

LIMIT = 1.05  # a tolerance for timing noise
NORM, PLAIN, TRIGGERED = ("optaxclip global_norm", "plain sqrt(sum(x*x))",
                          "optaxclip, rescue triggered (one 1e20)")


def _plain_norm(tree: Any) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(tree)))


def _with_huge_value(tree: Any) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  first = leaves[0]
  leaves[0] = first.at[(0,) * first.ndim].set(1e20)
  return treedef.unflatten(leaves)


def measure(config: Config) -> dict[str, Any]:
  grads = _trees.normal_tree(_trees.transformer_shapes(**config.transformer), seed=0)
  huge = _with_huge_value(grads)
  norm, plain = jax.jit(oc.functional.global_norm), jax.jit(_plain_norm)
  samples = interleaved_samples({NORM: lambda: norm(grads), PLAIN: lambda: plain(grads)},
                                config.repeats)
  # Timed apart: interleaved, the slow triggered call would run just before
  # (and disturb the caches of) the call it is compared with.
  triggered = median_time(lambda: norm(huge), config.repeats)
  return {"tree": describe_tree(grads), "samples": samples, "triggered": triggered,
          "huge_norm": float(norm(huge)), "plain_huge_norm": float(plain(huge))}


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  del config
  [result] = results
  samples = result["samples"]
  t = {name: statistics.median(values) for name, values in samples.items()}
  t[TRIGGERED] = result["triggered"]
  ratio = median_ratio(samples[NORM], samples[PLAIN])
  triggered = t[TRIGGERED] / t[PLAIN]
  rows = [[NORM, ms(t[NORM]), f"**{ratio:.2f}**", f"<= {LIMIT} (noise)",
           verdict(ratio <= LIMIT)],
          [PLAIN, ms(t[PLAIN]), "1", "reference", "info"],
          [TRIGGERED, ms(t[TRIGGERED]), f"{triggered:.2f}", "", "info"]]
  return Section(
      key="fallback", title="The overflow-safe norm costs nothing when not triggered",
      measured=f"The transformer tree ({result['tree']}).",
      tables=[Table(["norm", "median (ms)", "ratio to plain", "threshold", "status"],
                    rows)],
      checks=[Check("optaxclip / plain norm", f"{ratio:.2f}", f"<= {LIMIT} (noise)",
                    ratio <= LIMIT),
              Check("rescue triggered / plain norm", f"{triggered:.2f}", "", None)],
      notes=[f"With the 1e20 value optaxclip's norm is {result['huge_norm']:.4g} "
             f"(the plain norm gives {result['plain_huge_norm']:.4g})."],
      bars_ms={name: value * 1e3 for name, value in t.items()})


TARGET = Target("fallback", measure, render)
