"""Results: the data each target returns, the markdown report and the plots."""

import dataclasses
import datetime
import math
import os
import platform
import sys
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import matplotlib.ticker  # noqa: E402

METHODOLOGY = """\
- **Isolation**: every target runs in a fresh Python process, so none is
  measured in a process an earlier target left behind.
- **Run time**: one warm-up call per candidate, then {repeats} rounds in which
  every candidate takes one sample in turn, each round starting with the next
  candidate (A, B, C, then B, C, A, ...), so that each holds every position
  equally often; the table shows the median sample per candidate, in time
  per call. A sample is one call, or for calls under {min_sample_ms:.0f} ms the
  mean of enough back-to-back calls to last that long; each call is waited
  for with `jax.block_until_ready` (PyTorch on CPU is synchronous). Inputs
  are built once and reused (donated, as in a training loop, only where a
  table says so). Ratios of two candidates are the median of the
  per-round ratios (target 3: over {standalone_repeats} rounds), and target
  2's difference of step times the median of the per-round differences (over
  {train_step_repeats} rounds): samples of one round share the machine's
  state, so drift between rounds cancels.
- **Compile time**: wall time of `jax.jit(tx.update).lower(updates, state).compile()`
  for a new transform on new tree objects, after `jax.clear_caches()`. The
  transforms take turns, rotating as above; times are medians over
  {compile_repeats} rounds (optax's clip, a slow reference: at most
  {compile_reference_repeats}), and the ratio to `optax.scale` is the median of
  the per-round ratios, which cancels drift in the machine's speed.
- **Ratios** compare numbers measured in this same run; a target holds when
  the ratio is at or below it. Targets near 1 (`<= 1.05`, `<= 1.0`) sit within
  the noise of a shared machine: a small miss there is noise until it repeats
  on a quiet machine.
- **Accuracy**: relative error `|norm - ref| / ref` against a float64 numpy
  norm of exactly the values the libraries see (after rounding to bf16/fp16).
"""


def verdict(passed: bool | None) -> str:
  return {True: "PASS", False: "FAIL", None: "info"}[passed]


@dataclasses.dataclass
class Check:
  """One target outcome, repeated in the summary table at the top."""
  what: str
  measured: str
  target: str
  passed: bool | None  # None: reported for information


@dataclasses.dataclass
class Table:
  headers: list[str]
  rows: list[list[str]]
  caption: str = ""


@dataclasses.dataclass
class Section:
  """What one target returns: its tables, checks and plot data."""
  key: str  # the name `--only` takes
  title: str
  description: str
  tables: list[Table]
  checks: list[Check]
  notes: list[str] = dataclasses.field(default_factory=list)
  bars_ms: dict[str, float] | None = None  # run-time bar chart, ms
  series: dict[str, Any] | None = None  # compile-time curves

  @property
  def passed(self) -> bool | None:
    outcomes = [c.passed for c in self.checks if c.passed is not None]
    return all(outcomes) if outcomes else None


def _versions() -> dict[str, str]:
  import jax
  import jaxlib
  import numpy
  import optax
  versions = {"python": platform.python_version(), "jax": jax.__version__,
              "jaxlib": jaxlib.__version__, "optax": optax.__version__,
              "numpy": numpy.__version__}
  try:
    import torch
    versions["torch"] = torch.__version__
  except ImportError:
    versions["torch"] = "not installed"
  return versions


def environment() -> dict[str, Any]:
  """The machine and library versions, to print in the results header."""
  import jax
  load = os.getloadavg() if hasattr(os, "getloadavg") else None
  return {
      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
      "cpu_count": os.cpu_count(),
      "load_average": " ".join(f"{x:.2f}" for x in load) if load else "n/a",
      "jax_backend": jax.default_backend(),
      "jax_devices": ", ".join(str(d) for d in jax.devices()),
      **_versions(),
  }


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---" for _ in headers) + "|"]
  lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
  return "\n".join(lines)


def _summary(sections: list[Section]) -> str:
  rows = [[f"[{s.title}](#{s.key})", c.what, c.measured, c.target,
           verdict(c.passed)]
          for s in sections for c in s.checks]
  return markdown_table(["target", "check", "measured", "target value", "status"],
                        rows)


def _section(number: int, section: Section) -> str:
  parts = [f'<a id="{section.key}"></a>',
           f"## {number}. {section.title} (`{section.key}`)",
           section.description]
  for table in section.tables:
    if table.caption:
      parts.append(table.caption)
    parts.append(markdown_table(table.headers, table.rows))
  parts += [f"- {note}" for note in section.notes]
  return "\n\n".join(parts)


def render_markdown(sections: list[Section], numbers: dict[str, int],
                    env: dict[str, Any], settings: dict[str, Any],
                    plots: list[str], wall_seconds: float) -> str:
  env_rows = [[key, f"`{value}`"] for key, value in env.items()]
  head = [
      "# optaxclip benchmarks",
      f"Generated by `{' '.join(settings['command'])}` in {wall_seconds:.0f} s "
      f"({settings['mode']} mode). Timings are wall-clock medians on the "
      "machine below; compare ratios, which were measured in the same run, "
      "rather than absolute times.",
      "## Machine and versions",
      markdown_table(["", ""], env_rows),
      "## Methodology",
      METHODOLOGY.format(**settings),
      "## Summary",
      _summary(sections),
  ]
  body = [_section(numbers[s.key], s) for s in sections]
  images = ["## Plots"] + [f"![{name}]({name})" for name in plots]
  return "\n\n".join(head + body + (images if plots else [])) + "\n"


def plot_compile(section: Section, path: Path) -> None:
  series = section.series
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for name, seconds in series["seconds"].items():
    points = [(n, t) for n, t in zip(series["leaves"], seconds) if t is not None]
    if points:
      ax.plot(*zip(*points), marker="o", label=name)
  floor = series["seconds"]["optax.scale"]
  ax.plot(series["leaves"], [2 * t for t in floor], "k--", linewidth=1,
          label="target: 2 × optax.scale")
  ax.set(xscale="log", yscale="log", xlabel="leaves in the tree",
         ylabel="lower + compile time (s)",
         title="Compile time of jit(tx.update) vs leaf count")
  ax.set_xticks(series["leaves"], [str(n) for n in series["leaves"]])
  ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
  ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
  ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_runtimes(sections: list[Section], path: Path) -> None:
  columns = min(2, len(sections))
  rows = math.ceil(len(sections) / columns)
  fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 3.6 * rows),
                           squeeze=False)
  for ax, section in zip(axes.flat, sections):
    names, values = zip(*section.bars_ms.items())
    ax.barh(range(len(names)), values, color="tab:blue")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="median time per call (ms)")
    ax.set_title(textwrap.fill(section.title, 45), fontsize=10)
    for i, value in enumerate(values):
      ax.text(value, i, f" {value:.3g}", va="center", fontsize=8)
    ax.margins(x=0.2)
  for ax in list(axes.flat)[len(sections):]:
    ax.set_visible(False)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_plots(sections: list[Section], out: Path) -> list[str]:
  """Writes the PNGs the sections have data for; returns their file names."""
  written = []
  for section in sections:
    if section.series:
      plot_compile(section, out / "compile_time.png")
      written.append("compile_time.png")
  with_bars = [s for s in sections if s.bars_ms]
  if with_bars:
    plot_runtimes(with_bars, out / "runtime.png")
    written.append("runtime.png")
  return written


def command_line() -> list[str]:
  return ["python", *[arg if i else os.path.relpath(arg)
                      for i, arg in enumerate(sys.argv)]]
