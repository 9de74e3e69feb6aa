"""Several processes (``jax.distributed.initialize``), each with its own devices.

Starts two local processes with 4 CPU devices each (8 in all, CPU collectives
over gloo, JAX's default) running ``_multiprocess_worker.py``: sharded
``jit`` on Explicit and Auto meshes and ``shard_map`` with ``axis_name`` and
``specs``, all checked against float64 numpy in every process. Deselect with
``pytest -k "not multiprocess"``.
"""

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

from helpers import kill_process_group

TESTS = pathlib.Path(__file__).parent
WORKER = TESTS / "_multiprocess_worker.py"
NUM_PROCESSES = 2
GRACE_S = 10  # after one worker fails, how long the others may take to end
CHECKS = ["ok gspmd Explicit", "ok gspmd Auto", "ok shard_map"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(num_processes: int):
  """Runs the workers to the end; returns [(returncode, stdout, stderr)]
  per process.

  No time limit: a loaded machine is slow, not wrong. If one worker fails,
  the others (which may wait for it in a collective) are stopped
  ``GRACE_S`` seconds later; when the test ends, no worker is left running.
  Output goes to files, so that no worker blocks on a full pipe.
  """
  env = dict(os.environ,
             XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu",
             TF_CPP_MIN_LOG_LEVEL="1",  # XLA's warnings, not its info lines
             PYTHONPATH=os.pathsep.join(
                 [str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
  port = free_port()
  with tempfile.TemporaryDirectory() as logs:
    outputs = [(open(f"{logs}/{i}.out", "w+"), open(f"{logs}/{i}.err", "w+"))
               for i in range(num_processes)]
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), str(i), str(num_processes), str(port)],
        env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        for i, (out, err) in enumerate(outputs)]
    failed_at = None
    try:
      while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
          failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + GRACE_S:
          break
        time.sleep(0.1)
    finally:
      for p in procs:
        kill_process_group(p)
    results = []
    for p, (out, err) in zip(procs, outputs):
      out.seek(0)
      err.seek(0)
      results.append((p.returncode, out.read(), err.read()))
      out.close()
      err.close()
  return results


def test_multiprocess_clip_by_global_norm():
  start = time.monotonic()
  results = run_processes(NUM_PROCESSES)
  elapsed = time.monotonic() - start
  report = "\n".join(
      f"--- process {i}: exit {rc} after {elapsed:.0f}s\n{out}\n{err[-4000:]}"
      for i, (rc, out, err) in enumerate(results))
  assert all(rc == 0 for rc, _, _ in results), report
  for _, out, err in results:
    assert [line for line in out.splitlines() if line.startswith("ok ")] == CHECKS, report
    assert "involuntary full rematerialization" not in err.lower(), report
