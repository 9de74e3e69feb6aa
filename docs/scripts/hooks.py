"""mkdocs hook: the benchmark plots, kept in benchmarks/results/, on the site.

benchmarks/run.py writes its plots next to its results; the benchmarks page
(docs/benchmarks.md) shows them as ``benchmarks/<name>.png`` without a copy
in docs/ that could fall behind.
"""

import pathlib

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLOTS = ROOT / "benchmarks" / "results"


def on_files(files, config):
  for plot in sorted(PLOTS.glob("*.png")):
    files.append(File.generated(config, f"benchmarks/{plot.name}", abs_src_path=str(plot)))
  return files
