"""The README's demo runs end to end (in its tiny configuration)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_demo_quick_writes_table_and_plot(tmp_path):
  png = tmp_path / "demo.png"
  result = subprocess.run(
      [sys.executable, str(ROOT / "examples" / "demo.py"), "--quick", "--out", str(png)],
      capture_output=True, text=True, timeout=600, check=True)
  lines = result.stdout.splitlines()
  header = next(i for i, line in enumerate(lines) if line.startswith("run "))
  rows = {line.split("  ")[0]: line for line in lines[header + 2:header + 7]}
  assert "optaxclip.clip_by_global_norm(1)" in rows
  assert "no clipping" in rows
  assert png.stat().st_size > 10_000
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
