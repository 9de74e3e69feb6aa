"""Smoke test of the benchmark harness: `benchmarks/run.py --smoke` (tiny
trees, one round) runs every target's code and writes its report. Timings
are not checked (they depend on the machine), nor is how long the run
takes: a loaded machine is slow, not wrong."""

import os
import re
import sys
from pathlib import Path

from helpers import run_process

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
TARGETS = ("compile_step", "compile", "traffic", "scanned", "train_step", "standalone",
           "many_leaves", "accuracy", "fallback")


def _section(markdown: str, key: str) -> str:
  """The text of target `key`'s section, up to the next section."""
  start = markdown.index(f'<a id="{key}"></a>')
  following = markdown.find('<a id="', start + 1)
  return markdown[start:following if following != -1 else len(markdown)]


def test_smoke_run_writes_every_table_and_plot(tmp_path):
  env = dict(os.environ)
  # tests/conftest.py gives this process 8 host devices; the benchmarks run
  # on the default single device.
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                            env.get("XLA_FLAGS", "")).strip()
  result = run_process([sys.executable, str(RUN), "--smoke", "--out", str(tmp_path)],
                       env=env)
  assert result.returncode == 0, result.stdout + result.stderr

  markdown = (tmp_path / "README.md").read_text()
  assert "(smoke mode)" in markdown
  for key in TARGETS:
    section = _section(markdown, key)
    assert f"(`{key}`)" in section, key
    table_header = re.search(r"^\|.*\| threshold \| status \|", section, re.MULTILINE)
    assert table_header, f"no results table for {key}"
    assert re.search(r"\| (PASS|FAIL)", section), f"no PASS/FAIL for {key}"
    assert f"README.md#{key})" in section, f"no link to the definition of {key}"
  assert "## Summary" in markdown and "## Machine and versions" in markdown
  scanned = _section(markdown, "scanned")
  for row in ("| clip_by_global_norm(leaf_norms, layer_axis) | compile, step",
              "| clip_by_norm(layer_axis) | run, clip alone", "| leaf_norms cost | traffic"):
    assert row in scanned, row
  traffic = _section(markdown, "traffic")
  for part in ("| whole tree (", "| large leaves (", "| small leaves ("):
    assert part in traffic, f"no traffic row for the {part[2:-2]}"

  for png in ("compile_step.png", "compile_time.png", "runtime.png"):
    assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert f"]({png})" in markdown
  assert (tmp_path / "results.json").stat().st_size > 0


def test_unknown_target_is_rejected(tmp_path):
  result = run_process([sys.executable, str(RUN), "--only", "nonsense",
                        "--out", str(tmp_path)])
  assert result.returncode == 2
  assert "unknown target" in result.stderr


def test_every_target_has_a_definition():
  definitions = (RUN.parent / "README.md").read_text()
  for key in TARGETS:
    assert f'<a id="{key}"></a>' in definitions, key
