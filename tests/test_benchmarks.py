"""Smoke test of the benchmark harness: `benchmarks/run.py --quick` writes its
report. Timings are not checked (they depend on the machine)."""

import os
import re
import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
TARGETS = ("compile_step", "compile", "traffic", "scanned", "train_step", "standalone",
           "many_leaves", "accuracy", "fallback")


def _section(markdown: str, key: str) -> str:
  """The text of target `key`'s section, up to the next section."""
  start = markdown.index(f'<a id="{key}"></a>')
  following = markdown.find('<a id="', start + 1)
  return markdown[start:following if following != -1 else len(markdown)]


def test_quick_run_writes_every_table_and_plot(tmp_path):
  env = dict(os.environ)
  # tests/conftest.py gives this process 8 host devices; the benchmarks run
  # on the default single device.
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                            env.get("XLA_FLAGS", "")).strip()
  result = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr

  markdown = (tmp_path / "README.md").read_text()
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

  for png in ("compile_step.png", "compile_time.png", "runtime.png"):
    assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert f"]({png})" in markdown
  assert (tmp_path / "results.json").stat().st_size > 0


def test_unknown_target_is_rejected(tmp_path):
  result = subprocess.run([sys.executable, str(RUN), "--only", "nonsense",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2
  assert "unknown target" in result.stderr


def test_every_target_has_a_definition():
  definitions = (RUN.parent / "README.md").read_text()
  for key in TARGETS:
    assert f'<a id="{key}"></a>' in definitions, key
