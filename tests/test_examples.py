"""The examples run end to end (in small configurations)."""

import pathlib
import re
import sys

from helpers import checkout_env, run_process

ROOT = pathlib.Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_ok(args):
  """Runs an example to the end (no time limit), with this checkout's
  optaxclip; it must exit with 0."""
  result = run_process(args, env=checkout_env())
  assert result.returncode == 0, result.stdout + result.stderr
  return result


def tables(stdout):
  """Each table in ``stdout``: a dict from run name to its row's cells."""
  lines = stdout.splitlines()
  found = []
  for i, line in enumerate(lines):
    if line.startswith("run ") and lines[i + 1].startswith("---"):
      rows = {}
      for row in lines[i + 2:]:
        if not row.strip() or row.startswith("("):
          break
        cells = [c.strip() for c in row.split("  ") if c.strip()]
        rows[cells[0]] = cells[1:]
      found.append(rows)
  return found


def test_demo_quick_writes_tables_and_plots(tmp_path):
  png = tmp_path / "demo.png"
  result = run_ok([sys.executable, str(ROOT / "examples" / "demo.py"), "--quick",
                   "--out", str(png)])
  rnn, spikes = tables(result.stdout)
  assert len(rnn) == 5
  assert "optaxclip.clip_by_global_norm(1)" in rnn
  assert "no clipping" in rnn
  assert list(spikes) == ["reference (no outliers)", "no clipping",
                          "clip_by_global_norm(1)", "zclip()",
                          "skip_step(zscore=6)"]
  # final loss, worst after outliers, clip/skip rate, steps skipped
  assert all(len(cells) == 4 for cells in spikes.values())
  assert spikes["reference (no outliers)"][-2:] == ["-", "-"]
  assert spikes["zclip()"][-2].endswith("%")
  assert spikes["zclip()"][-1] == "-"
  # The quick configuration has three outlier batches; skip_step drops them.
  assert spikes["skip_step(zscore=6)"][-1] == "3"
  for path in (png, tmp_path / "spikes.png"):
    assert path.stat().st_size > 10_000
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_log_stats_example_writes_csv_and_plot(tmp_path):
  run_ok([sys.executable, str(ROOT / "examples" / "log_stats.py"), "--out", str(tmp_path)])
  rows = (tmp_path / "stats.csv").read_text().splitlines()
  header = rows[0].split(",")
  assert "clip/norm" in header and "skip/skipped_count" in header, header
  assert len(rows) > 10
  assert (tmp_path / "stats.png").read_bytes()[:4] == b"\x89PNG"


def test_scanned_training_quick_logs_per_layer_norms(tmp_path):
  png = tmp_path / "layers.png"
  result = run_ok([sys.executable, str(ROOT / "examples" / "scanned_training.py"), "--quick",
                   "--out", str(png)])
  # One norm per stacked layer (2 in the quick configuration), all finite.
  norms = re.search(r"last step's layer norms: (.*)", result.stdout)
  assert norms, result.stdout
  values = [float(v) for v in norms[1].split()]
  assert len(values) == 2 and all(0.0 < v < float("inf") for v in values), values
  assert png.stat().st_size > 10_000
  assert png.read_bytes()[:8] == PNG_MAGIC


def test_qk_clip_example_bounds_the_logits(tmp_path):
  png = tmp_path / "qk_clip.png"
  result = run_ok([sys.executable, str(ROOT / "examples" / "qk_clip_logits.py"),
                   "--steps", "80", "--out", str(png)])
  plain = float(re.search(r"without qk_clip: ([\d.]+)", result.stdout)[1])
  clipped = float(re.search(r"with qk_clip\(30\): ([\d.]+)", result.stdout)[1])
  assert plain > 100 and clipped < 60, result.stdout
  assert png.read_bytes()[:8] == PNG_MAGIC


def test_guarded_training_example_skips_the_spikes(tmp_path):
  """The run docs/guards.md plots, cut before the loss scale's saw-tooth: the
  norm and loss spikes are skipped by skip_step, the NaN batch is an overflow."""
  png = tmp_path / "guards_run.png"
  result = run_ok([sys.executable, str(ROOT / "examples" / "guarded_training.py"),
                   "--steps", "260", "--out", str(png)])
  assert "1 overflows (steps [250])" in result.stdout, result.stdout
  assert "3 skipped by skip_step (steps [100, 101, 170])" in result.stdout, result.stdout
  assert png.read_bytes()[:8] == PNG_MAGIC
