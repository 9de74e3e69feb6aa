"""Smoke test of the benchmark harness: `benchmarks/run.py --smoke` (tiny
trees, one round) runs every target's code and writes its report. Timings
are not checked (they depend on the machine), nor is how long the run
takes: a loaded machine is slow, not wrong. The programs the report
compares with (the minimal norm, the hand-written AdamW floor) are checked
to compute what they stand for."""

import os
import re
import sys
import tarfile
from pathlib import Path

import deviceless
import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import run_process

import optaxclip as oc

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks import _candidates, _config, _timing  # noqa: E402
from benchmarks.targets import TARGETS as ALL_TARGETS  # noqa: E402
from benchmarks.targets import large_step  # noqa: E402
from benchmarks.targets._base import process_environment, select_platform  # noqa: E402

RUN = ROOT / "benchmarks" / "run.py"
TARGETS = ("compile_step", "compile", "traffic", "guards", "scanned", "experts", "train_step",
           "standalone", "many_leaves", "large_tree", "large_step", "accuracy", "fallback",
           "qk_clip", "accelerators")


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
  # Every target, the GPU's too (`large_*`: their code on the CPU, tiny trees).
  result = run_process([sys.executable, str(RUN), "--smoke", "--only", ",".join(TARGETS),
                        "--out", str(tmp_path)], env=env)
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
              "| clip_by_norm(layer_axis) | run, clip alone", "| leaf_norms cost | traffic",
              "| adaptive_grad_clip(layer_axis) | compile, step extra (ratio)",
              "| clip_by_global_norm(leaf_norms, layer_axis) | compile, step extra (ratio)"):
    assert row in scanned, row
  experts = _section(markdown, "experts")
  for row in ("| clip_by_global_norm(leaf_norms, layer_axis, expert_axis) | "
              "clip_by_global_norm(leaf_norms) | traffic",
              "| clip_by_norm(layer_axis, expert_axis) | clip_by_norm | run"):
    assert row in experts, row
  traffic = _section(markdown, "traffic")
  for part in ("| whole tree (", "| large leaves (", "| small leaves ("):
    assert part in traffic, f"no traffic row for the {part[2:-2]}"
  guards = _section(markdown, "guards")
  assert "| hand-written AdamW + exact rollback (floor) |" in guards
  for row in ("| chain(clip, adamw) |", "| skip_step(adamw) |",
              "| skip_step(chain(clip, adamw), zscore=6, loss_zscore=6) |",
              "| dynamic_loss_scale(chain(clip, adamw)) |",
              "| dynamic_loss_scale(skip_step(chain(clip, adamw), zscore=6)) |",
              "| optax.apply_if_finite(chain(clip, adamw), 10) |",
              "| chain(optax.clip_by_global_norm(1.0), adamw) |"):
    assert guards.count(row) == 2, row  # its passes, then its compile time
  # passes, beyond the clipped step, and the same without the rescue branch
  assert re.search(r"\| skip_step\(adamw\) \| [\d.]+ \| \*\*\+[\d.]+\*\* \| \+[\d.]+ \|",
                   guards), "no passes without the rescue branch"
  assert "| bfloat16 | clip | floor: two reads and a write |" in _section(markdown,
                                                                        "large_tree")
  for row in ("| optaxclip + adamw | ", "| skip_step(optaxclip + adamw, zscore=6) | ",
              "| floor: one read | "):
    assert row in _section(markdown, "large_step"), row
  qk_clip = _section(markdown, "qk_clip")
  for row in ("| chain(adamw, qk_clip) |", "| adamw + hand-written rescale |"):
    assert row in qk_clip, row
  accelerators = _section(markdown, "accelerators")
  missing = [m for m in (deviceless.missing("cuda"), deviceless.missing("tpu")) if m]
  for reason in missing:  # (test_deviceless.py skips, or fails in CI)
    assert f"not measured: {reason}" in accelerators
  if not missing:
    for caption in ("H100, llm (12 leaves)", "H100, small (5 leaves)", "H100, lora (14 leaves)"):
      assert caption in accelerators, caption
    for row in ("| global norm | ", "| adamw alone | ", "| clip + adamw | "):
      assert row in accelerators, row
  for key, what in (("compile_step", "extra step compile time"),
                    ("compile", "extra compile time")):
    assert "Against the minimal norm" in _section(markdown, key), key
    assert f"optaxclip's {what} / the minimal norm's |" in markdown, key

  for png in ("compile_step.png", "compile_time.png", "runtime.png"):
    assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert f"]({png})" in markdown
  assert (tmp_path / "results.json").stat().st_size > 0


def test_a_gpu_run_packs_its_output_in_one_archive(tmp_path):
  # A lent GPU returns at most 8 files a command: `--platform gpu` with $OUT
  # set writes the whole output folder as one archive there.
  from benchmarks.run import archive
  out = tmp_path / "results"
  (out / "plots").mkdir(parents=True)
  for name in ("README.md", "results.json", "plots/a.png"):
    (out / name).write_text(name)
  path = archive(out, tmp_path / "OUT")
  assert list((tmp_path / "OUT").iterdir()) == [path]
  with tarfile.open(path) as tar:
    assert sorted(tar.getnames()) == ["results", "results/README.md", "results/plots",
                                      "results/plots/a.png", "results/results.json"]


def test_unknown_target_is_rejected(tmp_path):
  result = run_process([sys.executable, str(RUN), "--only", "nonsense",
                        "--out", str(tmp_path)])
  assert result.returncode == 2
  assert "unknown target" in result.stderr


def test_every_target_has_a_definition():
  definitions = (RUN.parent / "README.md").read_text()
  for key in TARGETS:
    assert f'<a id="{key}"></a>' in definitions, key


def test_benchmark_processes_compile_without_the_persistent_cache():
  # This suite sets JAX_COMPILATION_CACHE_DIR, as users may: a timed compile
  # read back from it would time the disk, not the compiler.
  assert jax.config.jax_enable_compilation_cache
  try:
    select_platform("cpu")  # what every benchmark process starts with
    assert not jax.config.jax_enable_compilation_cache
  finally:
    jax.config.update("jax_enable_compilation_cache", True)


def test_benchmark_processes_do_not_preallocate_device_memory(monkeypatch):
  # Issue 28: on a GPU the driver held 75% of the memory and each job's
  # process asked for 75% more. The driver sets the variable before any
  # backend starts, and every job's process starts with it.
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  try:
    select_platform("cpu")
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
  assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE")
  env = process_environment(ALL_TARGETS["large_step"])
  assert env["MALLOC_ARENA_MAX"] == "1"  # the target's own settings kept
  child = _timing.in_fresh_process(os.getenv, "XLA_PYTHON_CLIENT_PREALLOCATE", env=env)
  assert child == "false"
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ  # the driver's restored


def test_gpu_sizes_and_targets_only_on_a_gpu():
  for base in (_config.FULL, _config.QUICK, _config.SMOKE):
    assert _config.for_platform(base, "cpu").large_tree != _config.GPU_LARGE_TREE
  gpu = _config.for_platform(_config.FULL, "gpu")
  assert gpu.large_tree == _config.GPU_LARGE_TREE and gpu.platform == "gpu"
  assert _config.for_platform(_config.SMOKE, "gpu").large_tree == _config.SMOKE.large_tree
  on_gpu = [key for key, t in ALL_TARGETS.items() if "gpu" in t.platforms]
  assert on_gpu == ["compile_step", "many_leaves", "large_tree", "large_step", "accuracy"]
  assert not [key for key, t in ALL_TARGETS.items()
              if key.startswith("large_") and "cpu" in t.platforms]


def test_large_step_shares_only_the_large_moments():
  shapes = {"w": (300, 256), "b": (256,)}
  params = {k: jnp.ones(s, jnp.float32) for k, s in shapes.items()}
  pool = {}
  states = [large_step._shared(large_step.STEPS[name]().init(params), pool)
            for name in ("adamw", "optaxclip + adamw", "skip_step(optaxclip + adamw, zscore=6)")]
  big = [[x for x in jax.tree.leaves(s) if x.size >= large_step.SHARED_SIZE] for s in states]
  assert [len(b) for b in big] == [2, 2, 2]  # mu and nu of "w", in every state
  assert all(a is b for a, b in zip(big[0], big[1])) and big[0][0] is not big[0][1]
  small = [[x for x in jax.tree.leaves(s) if x.shape == (256,)] for s in states[:2]]
  assert not any(a is b for a, b in zip(*small))


def test_floor_programs_are_the_global_norm_and_clip():
  grads = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.array([-4.0, 3.0], jnp.bfloat16)}
  np.testing.assert_allclose(_candidates.floor_norm(grads), oc.functional.global_norm(grads),
                             rtol=1e-6)
  want, _ = oc.clip_by_global_norm(1.0).update(grads, oc.clip_by_global_norm(1.0).init(grads))
  for got, expected in zip(jax.tree.leaves(_candidates.floor_clip(grads)),
                           jax.tree.leaves(want)):
    assert got.dtype == expected.dtype
    np.testing.assert_allclose(np.float32(got), np.float32(expected), rtol=1e-2)


def test_minimal_norm_clips_as_the_global_norm_clip():
  grads = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.array([-4.0, 3.0])}
  for max_norm in (1.0, 100.0):
    tx = _candidates.minimal_norm_clip(max_norm)
    ours, _ = tx.update(grads, tx.init(grads))
    want, _ = oc.clip_by_global_norm(max_norm).update(
        grads, oc.clip_by_global_norm(max_norm).init(grads))
    for key in grads:
      np.testing.assert_allclose(ours[key], want[key], rtol=1e-6)
  zeros = jax.tree.map(jnp.zeros_like, grads)
  clipped, _ = tx.update(zeros, tx.init(zeros))
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(clipped))


def test_handwritten_adamw_is_optax_adamw_and_rolls_back_exactly():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(4), jnp.float32)}
  tx = optax.adamw(1e-3)
  state, ours = tx.init(params), _candidates.handwritten_adamw_init(params)
  want, got = params, params
  plain = jax.jit(_candidates.handwritten_adamw_step(rollback=False))
  rollback = jax.jit(_candidates.handwritten_adamw_step(rollback=True))
  for i in range(3):
    grads = jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 1)), params)
    updates, state = tx.update(grads, state, want)
    want = optax.apply_updates(want, updates)
    got, new = plain(grads, ours, got, jnp.bool_(False))
    assert rollback(grads, ours, got, jnp.bool_(False))[1][0] == new[0]
    kept_params, kept = rollback(grads, ours, got, jnp.bool_(True))
    for a, b in zip(jax.tree.leaves((kept_params, kept)), jax.tree.leaves((got, ours))):
      np.testing.assert_array_equal(a, b)  # a skipped step: bit for bit as before
    ours = new
  for key in params:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(ours[1]["w"], state[0].mu["w"], rtol=1e-6)
