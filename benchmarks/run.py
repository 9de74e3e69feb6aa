"""optaxclip benchmarks: compile time, memory traffic, run time and accuracy
against optax and PyTorch.

    python benchmarks/run.py                  # full suite
    python benchmarks/run.py --quick          # small sizes, a first look
    python benchmarks/run.py --smoke          # tiny sizes, 1 round: the test's run
    python benchmarks/run.py --only compile,traffic --out /tmp/bench
    python benchmarks/run.py --platform gpu   # JAX's GPU backend: the GPU targets

On a GPU, with `$OUT` set (a lent device's folder that comes back, at most
8 files), the whole output folder is also written to one archive there,
`$OUT/benchmarks-gpu.tar.gz`.

Writes `README.md` (each target's numbers beside its threshold), `results.json`
and PNG plots to `benchmarks/results/` (or `--out`). What each target
measures, and how: `benchmarks/README.md`.
"""

import argparse
import dataclasses
import json
import os
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmark the checkout, installed or not
  sys.path.insert(0, str(ROOT))

from benchmarks import _report, _timing  # noqa: E402
from benchmarks._config import FULL, QUICK, SMOKE, for_platform  # noqa: E402
from benchmarks.targets import TARGETS  # noqa: E402
from benchmarks.targets._base import (  # noqa: E402
  needs_own_process,
  process_environment,
  run_job,
  select_platform,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description="Benchmark optaxclip against optax and PyTorch.")
  sizes = parser.add_mutually_exclusive_group()
  sizes.add_argument("--quick", action="store_true",
                     help="small sizes and few repeats: a first look, not a result")
  sizes.add_argument("--smoke", action="store_true",
                     help="tiny sizes and 1 round: runs every target's code and "
                          "writes the report, in well under a minute of compiles")
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                      help=f"output folder (default: {DEFAULT_OUT.relative_to(ROOT)})")
  parser.add_argument("--only", default=None,
                      help=f"comma-separated targets to run: {', '.join(TARGETS)} "
                           "(default: those of the platform, benchmarks/README.md)")
  parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                      help="JAX backend to run on (default: cpu)")
  parser.add_argument("--no-skip", action="store_true",
                      help="compile optax's clip at every size, however slow")
  args = parser.parse_args(argv)
  if args.only is None:
    args.only = ",".join(key for key, t in TARGETS.items() if args.platform in t.platforms)
  args.only = [name.strip() for name in args.only.split(",") if name.strip()]
  unknown = [name for name in args.only if name not in TARGETS]
  args.only = [name for name in TARGETS if name in args.only]  # in report order
  if unknown or not args.only:
    parser.error(f"--only: unknown target(s) {', '.join(unknown) or '(none given)'}; "
                 f"choose from {', '.join(TARGETS)}")
  return args


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  select_platform(args.platform)
  base = SMOKE if args.smoke else QUICK if args.quick else FULL
  config = for_platform(base, args.platform)
  if args.no_skip:
    config = dataclasses.replace(config, compile_skip_s=None)
  args.out.mkdir(parents=True, exist_ok=True)
  env = _report.environment()
  numbers = {key: i for i, key in enumerate(args.only, start=1)}
  sections, measured = [], {}
  with _timing.Timer() as total:
    for key in args.only:
      target = TARGETS[key]
      print(f"[{numbers[key]}/{len(args.only)}] {key} ...", end=" ", flush=True)
      with _timing.Timer() as timer:
        # Every job in a fresh process (see `_timing.in_fresh_process`); in a
        # smoke run, only those that need one.
        measured[key] = [_timing.in_fresh_process(run_job, key, config, job,
                                                  env=process_environment(target))
                         if config.fresh_processes or needs_own_process(job)
                         else run_job(key, config, job)
                         for job in target.jobs(config)]
        sections.append(target.render(config, measured[key]))
      print(f"{_report.verdict(sections[-1].passed)} ({timer.seconds:.1f} s)", flush=True)
    plots = _report.write_plots(sections, args.out)
  settings = {"command": _report.command_line(), **dataclasses.asdict(config),
              "isolation": "each job of a target in a fresh Python process",
              "min_sample_ms": _timing.MIN_SAMPLE_SECONDS * 1e3}
  markdown = _report.render_markdown(sections, numbers, env, settings, plots, args.out,
                                     total.seconds)
  (args.out / "README.md").write_text(markdown)
  results = {"environment": env, "settings": settings, "measured": measured,
             "sections": [dataclasses.asdict(s) for s in sections]}
  (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
  print(f"wrote {args.out / 'README.md'}, results.json and {', '.join(plots) or 'no plots'} "
        f"in {total.seconds:.1f} s")
  if args.platform == "gpu" and os.environ.get("OUT"):
    print(f"wrote {archive(args.out, Path(os.environ['OUT']))}")


def archive(out: Path, into: Path) -> Path:
  """Everything in `out` as one archive in `into`: a lent device returns few
  files a command."""
  into.mkdir(parents=True, exist_ok=True)
  path = into / "benchmarks-gpu.tar.gz"
  with tarfile.open(path, "w:gz") as tar:
    tar.add(out, arcname=out.name)
  return path


if __name__ == "__main__":
  main()
