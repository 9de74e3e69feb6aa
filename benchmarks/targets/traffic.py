"""Memory traffic of the clip from XLA's cost analysis (`traffic`): alone and
inside AdamW's step, with the rescue branch's share measured apart."""

import math
import sys
from typing import Any

from benchmarks import _cost, _trees
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, verdict
from benchmarks.targets._base import Target

TITLE = "Memory traffic from XLA's cost analysis"
FLOORS = {"alone": 3.0, "step extra": 1.0}  # passes over the tree; see _cost
TOLERANCE = 0.01  # scalars (the norm, counters) and small state, in passes
JUDGED = ("optaxclip", "optaxclip clip_grad_norm")
CLIPS = (*JUDGED, "optax clip")
# optaxclip groups leaves up to this many elements for compile time (its
# `_grouping.GROUP_LIMIT` when this was written); the parts show each kind.
SMALL_LEAF = 1 << 15


def _parts(config: Config) -> dict[str, list[Any]]:
  """The transformer tree and (`config.traffic_parts`) its large and small leaves."""
  shapes = _trees.transformer_shapes(**config.transformer)
  parts = {"whole tree": _trees.shapes_where(shapes, lambda size: True)}
  if config.traffic_parts:
    parts["large leaves"] = _trees.shapes_where(shapes, lambda size: size > SMALL_LEAF)
    parts["small leaves"] = _trees.shapes_where(shapes, lambda size: size <= SMALL_LEAF)
  return parts


def measure(config: Config, *, rescue: bool) -> dict[str, Any]:
  # optax has no rescue branch: the build without one measures optaxclip only.
  names = list(CLIPS if rescue else JUDGED)
  trees = {part: _trees.structs(shapes) for part, shapes in _parts(config).items()}
  try:
    return _cost.traffic(names, trees, rescue=rescue)
  except _cost.NoBuildWithoutRescue as error:  # a FAIL in the report, not a crash
    print(f"\ntraffic: {error}", file=sys.stderr, flush=True)
    return {"error": str(error)}


def jobs(config: Config) -> list[dict[str, Any]]:
  del config
  return [{"rescue": True}, {"rescue": False}]


def _describe(part: str, result: dict[str, Any], shapes: list[Any]) -> str:
  return f"{part} ({len(shapes)} leaves, {result['tree_bytes'] / 2**20:.1f} MiB)"


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  with_rescue, without = results
  if "error" in without:
    return Section(
        key="traffic", title=TITLE, measured="", tables=[],
        checks=[Check("build without the rescue branch", "could not be made",
                      "made", False)],
        notes=[without["error"]])
  parts = _parts(config)
  tables, checks = [], []
  for measure_, title in (("alone", "The clip alone, `jit(tx.update)`"),
                          ("step extra", "Inside the step: passes added to AdamW's "
                                         "`jit(step)`")):
    floor = FLOORS[measure_]
    rows = []
    for part, shapes in parts.items():
      for name in CLIPS:
        value = with_rescue[part][name][measure_]
        if name not in without[part]:
          rows.append([_describe(part, with_rescue[part], shapes), name, f"{value:.3f}",
                       "(no rescue branch)", "—", "reference", "info"])
          continue
        plain = without[part][name][measure_]
        share = value - plain
        limit = floor + share + TOLERANCE
        judged = part == "whole tree"
        passed = value <= limit if judged else None
        rows.append([_describe(part, with_rescue[part], shapes), name,
                     f"**{value:.3f}**" if judged else f"{value:.3f}", f"{plain:.3f}",
                     f"{share:.3f}",
                     f"<= {floor:.1f} + {share:.3f} + {TOLERANCE}" if judged else "",
                     verdict(passed)])
        if judged:
          checks.append(Check(f"{name}: {measure_} / tree bytes", f"{value:.3f}",
                              f"<= {floor:.1f} + rescue {share:.3f} + {TOLERANCE}",
                              passed))
    tables.append(Table(["tree", "clip", "passes", "without rescue branch",
                         "rescue share", "threshold", "status"], rows,
                        caption=f"{title} (floor {floor:.1f}):"))
  whole = with_rescue["whole tree"]
  adamw = whole["adamw step"]
  notes = [f"AdamW's step alone: {adamw:.3f} passes over the tree "
           f"({adamw * whole['tree_bytes'] / 2**20:.0f} MiB accessed)."]
  if not math.isclose(adamw, without["whole tree"]["adamw step"]):
    notes.append("AdamW's step differs in the build without the rescue branch: "
                 "the patch reached more than the norm.")
  return Section(
      key="traffic", title=TITLE,
      measured=("`compiled.cost_analysis()['bytes accessed']` divided by the tree's "
                "bytes, on the transformer tree and on its large and small leaves "
                f"apart (small: at most {SMALL_LEAF} elements); the build without the "
                "rescue branch in a process of its own."),
      tables=tables, checks=checks, notes=notes)


TARGET = Target("traffic", measure, render, jobs)
