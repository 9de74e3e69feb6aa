"""Numerical parity of optaxclip with PyTorch, TensorFlow and Optax.

Two kinds of checks:

* golden: ``tests/golden/{torch,tensorflow,optax}.json`` hold inputs and
  outputs produced by the real reference libraries (see
  ``tests/golden/generate.py``).  These always run.
* live: fresh random trees compared against the reference library imported in
  the test.  The torch / tensorflow ones skip when the library is not
  installed; optax is a dependency, so its live tests always run.

Tolerance: a number of float32 ulps (units in the last place; see ``ULPS``),
per element. The references compute in float32 as optaxclip does, but round
in other places, so norms and clipped values agree to a few ulps, not bit for
bit; clipping by value rounds nothing and matches exactly. The migration pages
(``docs/migration/*.md``) quote these tolerances and say where each library
rounds.

``python tests/test_parity.py`` runs this file and prints the largest
difference, in ulps, seen per reference library and check.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip as oc

F = oc.functional

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
TORCH_EPS = 1e-6  # the epsilon torch adds to the norm in clip_grad_norm_

# Largest difference allowed, in float32 ulps, per reference and kind of
# result. PyTorch takes the norm of the per-tensor norms (one more rounded
# root per tensor, whose error grows with the order p) and computes its factor
# as ``(norm + 1e-6).reciprocal() * max_norm``; TensorFlow multiplies by
# ``clip_norm * min(1 / norm, 1 / clip_norm)``; Optax divides the leaves by the
# norm, then multiplies by ``max_norm``; optaxclip multiplies by
# ``max_norm / (norm + eps)``. Sums of tens of elements run in another order.
# The largest seen on these trees (PyTorch 2.13, TensorFlow 2.21, Optax 0.2.8)
# is half of each: 2, 4, 3 and 2.
ULPS = {
    "torch": 4,  # norm_type 2 and inf
    "torch, other orders": 8,  # norm_type 1 and 3
    "tensorflow": 4,
    "optax": 4,
    "value": 0,  # clip_grad_value_, tf.clip_by_value, optax.clip: exact
    # optax.transforms.unitwise_clip: the same formula, rounded in the same
    # places: exact.
    "unitwise_clip": 0,
}

# Largest difference seen, in ulps, per ULPS key (filled in by _check).
MAX_ULPS: dict[str, int] = defaultdict(int)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _load(lib: str) -> dict:
  with open(GOLDEN_DIR / f"{lib}.json") as fh:
    return json.load(fh)


TORCH = _load("torch")
TF = _load("tensorflow")
OPTAX = _load("optax")


def _norm_type(v) -> float:
  return math.inf if v == "inf" else float(v)


def _np_leaves(data: dict, tree: str) -> list[np.ndarray]:
  return [np.asarray(x, np.float32) for x in data["trees"][tree]["leaves"]]


def _expected(case: dict) -> list[np.ndarray]:
  return [np.asarray(x, np.float32) for x in case["clipped"]]


def _as_tree(leaves, kind: str = "list"):
  """Leaves -> optaxclip input tree of jnp float32 arrays (list or dict)."""
  arrs = [jnp.asarray(x, dtype=jnp.float32) for x in leaves]
  if kind == "dict":
    return {f"w{i}": a for i, a in enumerate(arrs)}
  return arrs


def _tree_leaves(tree) -> list[np.ndarray]:
  if isinstance(tree, dict):
    return [np.asarray(tree[f"w{i}"]) for i in range(len(tree))]
  return [np.asarray(x) for x in tree]


def _state_norm(state):
  """Norm recorded by a clipping transform's state."""
  stats = oc.stats(state)
  norms = [v for k, v in stats.items() if k.endswith("/norm")]
  if norms:
    return norms[0]
  return state.norm


def _torch_tolerance(norm_type: float) -> str:
  return "torch" if norm_type in (2.0, math.inf) else "torch, other orders"


def _ordered(x) -> np.ndarray:
  """float32 bits as integers that count the float32 values in order."""
  bits = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
  return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # -0.0 is 0.0


def _ulps(got, expected) -> np.ndarray:
  """Per element, how many float32 steps apart ``got`` and ``expected`` are.

  Values both below the smallest normal float count as equal: XLA:CPU
  flushes subnormal results to zero, the references may not.
  """
  got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
  tiny = np.finfo(np.float32).tiny
  steps = np.abs(_ordered(got) - _ordered(expected))
  return np.where((np.abs(got) < tiny) & (np.abs(expected) < tiny), 0, steps)


def _check(tolerance: str, got, expected, what: str):
  """``got`` is within ``ULPS[tolerance]`` float32 ulps of ``expected``."""
  got = np.asarray(got)
  expected = np.asarray(expected, np.float32)
  assert got.dtype == np.float32, f"{what}: dtype {got.dtype}"
  assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
  assert np.all(np.isfinite(got)), f"{what}: non-finite values {got}"
  if not got.size:
    return
  steps = _ulps(got, expected)
  worst = np.unravel_index(np.argmax(steps), steps.shape)
  assert np.max(steps) <= ULPS[tolerance], (
      f"{what}: {np.max(steps)} float32 ulps apart (allowed: {ULPS[tolerance]} "
      f"for {tolerance}): got {got[worst]!r}, expected {expected[worst]!r} "
      f"at index {worst}")
  MAX_ULPS[tolerance] = max(MAX_ULPS[tolerance], int(np.max(steps)))


def _check_tree(tolerance: str, got_tree, expected: list[np.ndarray], what: str, like):
  """Compares a returned tree leaf by leaf; ``like`` is the input tree."""
  assert jax.tree.structure(got_tree) == jax.tree.structure(like), (
      f"{what}: tree structure {jax.tree.structure(got_tree)} != "
      f"{jax.tree.structure(like)}")
  got = _tree_leaves(got_tree)
  assert len(got) == len(expected), f"{what}: {len(got)} leaves != {len(expected)}"
  for i, (g, e) in enumerate(zip(got, expected)):
    _check(tolerance, g, e, f"{what} leaf {i}")


def test_tolerance_counts_float32_ulps():
  """The check counts float32 steps: the relative 1e-5 this suite once
  allowed (about 100 ulps) fails, and value clipping must match exactly."""
  x = np.float32(0.3065693)
  one_ulp = np.nextafter(x, np.float32(1))
  assert _ulps(one_ulp, x) == 1 and _ulps(-one_ulp, -x) == 1
  assert _ulps(np.float32(-0.0), np.float32(0.0)) == 0
  assert _ulps(np.float32(1e-45), np.float32(0.0)) == 0  # flushed subnormal
  _check("torch", np.float32(one_ulp), x, "one ulp apart")
  with pytest.raises(AssertionError, match="ulps apart"):
    _check("torch", np.float32(x * (1 + 1e-5)), x, "1e-5 relative")
  with pytest.raises(AssertionError, match="ulps apart"):
    _check("value", np.float32(one_ulp), x, "value clipping is exact")


# --------------------------------------------------------------------------
# golden vectors
#
# Each golden case runs its optaxclip functions through ``_run``: under
# ``jax.jit`` with the thresholds as traced float32 scalars (one compilation
# per tree structure and norm order instead of one eager ``lax.cond``
# compilation per call), and, for a representative subset (every case when
# OPTAXCLIP_PARITY_EAGER=1), also eagerly with plain Python-float thresholds,
# exactly as a user calls them.
# --------------------------------------------------------------------------

EAGER_ALL = os.environ.get("OPTAXCLIP_PARITY_EAGER", "") not in ("", "0")
# Cases also run eagerly (besides the documented examples, always included).
EAGER_NAMES = frozenset({
    "5leaves_s1-pinf-half", "2leaves_zeros-p2-tiny", "5leaves_s1-half_max",
    "mat45_vec3_s1-half_median_leaf", "5leaves_s1-asym_lo_small",
    "5leaves_s1-use_double", "2leaves_zeros-use0-tiny",
})

def _eager_subset(case) -> bool:
  return (EAGER_ALL or case["tree"].startswith("example")
          or case["name"] in EAGER_NAMES)


def _golden_params(data: dict, key: str):
  params = []
  for c in data[key]:
    params.append(pytest.param("jit", c, id=f"jit-{c['name']}"))
    if _eager_subset(c):
      params.append(pytest.param("eager", c, id=f"eager-{c['name']}"))
  return params


@functools.cache
def _jitted(fn):
  return jax.jit(fn, static_argnums=0)


def _run(mode: str, fn, static, g, *thresholds):
  """``fn(static, g, *thresholds)``, eagerly or jitted (see above)."""
  if mode == "eager":
    return fn(static, g, *(float(t) for t in thresholds))
  return _jitted(fn)(static, g, *(jnp.asarray(t, jnp.float32) for t in thresholds))


def _torch_norm_fns(norm_type, g, max_norm):
  tx = oc.clip_grad_norm(max_norm, norm_type=norm_type)
  updates, state = tx.update(g, tx.init(g))
  clipped, norm = F.clip_by_global_norm(g, max_norm, ord=norm_type, eps=TORCH_EPS)
  return updates, _state_norm(state), clipped, norm


def _value_fns(_, g, max_value, min_value=None):
  tx = oc.clip_by_value(max_value, min_value)
  updates, _ = tx.update(g, tx.init(g))
  return F.clip_by_value(g, max_value, min_value), updates


def _global_norm_fns(_, g, max_norm):
  clipped, norm = F.clip_by_global_norm(g, max_norm)
  tx = oc.clip_by_global_norm(max_norm)
  updates, state = tx.update(g, tx.init(g))
  return clipped, norm, updates, _state_norm(state), F.global_norm(g)


def _norm_fns(_, g, max_norm):
  tx = oc.clip_by_norm(max_norm)
  updates, _ = tx.update(g, tx.init(g))
  return F.clip_by_norm(g, max_norm), updates


def _use_norm_fns(eps, g, max_norm, use_norm):
  return F.clip_by_global_norm(g, max_norm, eps=eps, use_norm=use_norm)


@pytest.mark.parametrize("mode,case", _golden_params(TORCH, "clip_grad_norm_"))
def test_golden_torch_clip_grad_norm(mode, case):
  g = _as_tree(_np_leaves(TORCH, case["tree"]))
  p = _norm_type(case["norm_type"])
  updates, state_norm, clipped, norm = _run(mode, _torch_norm_fns, p, g, case["max_norm"])
  tol = _torch_tolerance(p)
  _check(tol, state_norm, case["total_norm"], "transform: total norm")
  _check_tree(tol, updates, _expected(case), "transform oc.clip_grad_norm", like=g)
  _check(tol, norm, case["total_norm"], "functional: total norm")
  _check_tree(tol, clipped, _expected(case), "functional F.clip_by_global_norm", like=g)


@pytest.mark.parametrize("mode,case", _golden_params(TORCH, "clip_grads_with_norm_"))
def test_golden_torch_clip_grads_with_norm(mode, case):
  g = _as_tree(_np_leaves(TORCH, case["tree"]))
  clipped, norm = _run(mode, _use_norm_fns, TORCH_EPS, g, case["max_norm"],
                       case["total_norm"])
  _check("torch", norm, case["total_norm"], "functional: the given norm")
  _check_tree("torch", clipped, _expected(case),
              "functional F.clip_by_global_norm(use_norm=...)", like=g)


@pytest.mark.parametrize("mode,case", _golden_params(TORCH, "clip_grad_value_"))
def test_golden_torch_clip_grad_value(mode, case):
  g = _as_tree(_np_leaves(TORCH, case["tree"]))
  clipped, updates = _run(mode, _value_fns, None, g, case["clip_value"])
  _check_tree("value", clipped, _expected(case), "functional F.clip_by_value", like=g)
  _check_tree("value", updates, _expected(case), "transform oc.clip_by_value", like=g)


@pytest.mark.parametrize("mode,case", _golden_params(TF, "clip_by_global_norm"))
def test_golden_tf_clip_by_global_norm(mode, case):
  g = _as_tree(_np_leaves(TF, case["tree"]))
  clipped, norm, updates, state_norm, _ = _run(mode, _global_norm_fns, None, g,
                                               case["clip_norm"])
  _check("tensorflow", norm, case["global_norm"], "functional: global norm")
  _check_tree("tensorflow", clipped, _expected(case), "functional F.clip_by_global_norm", like=g)
  _check("tensorflow", state_norm, case["global_norm"], "transform: state norm")
  _check_tree("tensorflow", updates, _expected(case), "transform oc.clip_by_global_norm", like=g)


@pytest.mark.parametrize("mode,case", _golden_params(TF, "clip_by_global_norm_use_norm"))
def test_golden_tf_clip_by_global_norm_use_norm(mode, case):
  g = _as_tree(_np_leaves(TF, case["tree"]))
  clipped, norm = _run(mode, _use_norm_fns, 0.0, g, case["clip_norm"],
                       case["use_norm"])
  _check("tensorflow", norm, case["use_norm"], "functional: the given norm")
  _check_tree("tensorflow", clipped, _expected(case),
              "functional F.clip_by_global_norm(use_norm=...)", like=g)


@pytest.mark.parametrize("mode,case", _golden_params(TF, "clip_by_norm"))
def test_golden_tf_clip_by_norm(mode, case):
  g = _as_tree(_np_leaves(TF, case["tree"]))
  clipped, updates = _run(mode, _norm_fns, None, g, case["clip_norm"])
  _check_tree("tensorflow", clipped, _expected(case), "functional F.clip_by_norm", like=g)
  _check_tree("tensorflow", updates, _expected(case), "transform oc.clip_by_norm", like=g)


@pytest.mark.parametrize("mode,case", _golden_params(TF, "clip_by_value"))
def test_golden_tf_clip_by_value(mode, case):
  g = _as_tree(_np_leaves(TF, case["tree"]))
  # tf.clip_by_value(t, lo, hi) == F.clip_by_value(tree, hi, lo)
  clipped, updates = _run(mode, _value_fns, None, g,
                          case["clip_value_max"], case["clip_value_min"])
  _check_tree("value", clipped, _expected(case), "functional F.clip_by_value", like=g)
  _check_tree("value", updates, _expected(case), "transform oc.clip_by_value", like=g)


@pytest.mark.parametrize("mode,case", _golden_params(OPTAX, "clip_by_global_norm"))
def test_golden_optax_clip_by_global_norm(mode, case):
  g = _as_tree(_np_leaves(OPTAX, case["tree"]))
  clipped, _, updates, _, _ = _run(mode, _global_norm_fns, None, g, case["max_norm"])
  _check_tree("optax", updates, _expected(case), "transform oc.clip_by_global_norm", like=g)
  _check_tree("optax", clipped, _expected(case), "functional F.clip_by_global_norm", like=g)


@pytest.mark.parametrize("mode,case", _golden_params(OPTAX, "clip"))
def test_golden_optax_clip(mode, case):
  g = _as_tree(_np_leaves(OPTAX, case["tree"]))
  clipped, updates = _run(mode, _value_fns, None, g, case["max_delta"])
  _check_tree("value", updates, _expected(case), "transform oc.clip_by_value", like=g)
  _check_tree("value", clipped, _expected(case), "functional F.clip_by_value", like=g)


@pytest.mark.parametrize("mode,case", _golden_params(OPTAX, "global_norm"))
def test_golden_optax_global_norm(mode, case):
  g = _as_tree(_np_leaves(OPTAX, case["tree"]))
  # F.global_norm shares one compiled program with the global-norm clippers;
  # the threshold is unused here.
  norm = _run(mode, _global_norm_fns, None, g, 1.0)[-1]
  _check("optax", norm, case["global_norm"], "F.global_norm")


# --------------------------------------------------------------------------
# sanity of the golden files themselves
# --------------------------------------------------------------------------


def test_golden_documented_examples():
  """The golden files reproduce the well-known documented numbers."""
  c = next(c for c in TORCH["clip_grad_norm_"] if c["name"] == "example_3_4__1_2-p2-max5")
  np.testing.assert_allclose(c["total_norm"], 5.4772, rtol=1e-4)
  np.testing.assert_allclose(c["clipped"][0], [2.7386, 3.6515], rtol=1e-4)
  np.testing.assert_allclose(c["clipped"][1], [0.9129, 1.8257], rtol=1e-4)
  c = next(c for c in TF["clip_by_global_norm"] if c["name"] == "example_3_4__1_2-max5")
  np.testing.assert_allclose(c["global_norm"], 5.4772, rtol=1e-4)
  np.testing.assert_allclose(c["clipped"][0], [2.7386, 3.6515], rtol=1e-4)
  np.testing.assert_allclose(c["clipped"][1], [0.9129, 1.8257], rtol=1e-4)
  c = next(c for c in TORCH["clip_grad_norm_"] if c["name"] == "example_torch_doc-p2-max0.5")
  np.testing.assert_allclose(
      c["clipped"][0],
      [[-0.0613139, -0.1532847, -0.0613139], [0.0613139, 0.1532847, 0.0613139]],
      rtol=1e-5)
  np.testing.assert_allclose(c["clipped"][1], [-0.3065693, 0.3065693], rtol=1e-5)
  c = next(c for c in TORCH["clip_grad_value_"] if c["name"] == "example_torch_doc-value0.1")
  np.testing.assert_allclose(c["clipped"][0], [[-0.1] * 3, [0.1] * 3], rtol=1e-7)
  np.testing.assert_allclose(c["clipped"][1], [-0.1, 0.1], rtol=1e-7)


def test_golden_files_metadata():
  total = 0
  for lib, data in (("torch", TORCH), ("tensorflow", TF), ("optax", OPTAX)):
    assert data["library"] == lib
    assert lib in data["versions"] and "numpy" in data["versions"]
    total += (GOLDEN_DIR / f"{lib}.json").stat().st_size
    for tree in data["trees"].values():
      for leaf in tree["leaves"]:
        flat = np.ravel(np.asarray(leaf, np.float64))
        # every stored number is an exact float32 value
        np.testing.assert_array_equal(flat.astype(np.float32).astype(np.float64), flat)
  assert total < 1.5e6


# --------------------------------------------------------------------------
# live comparisons on fresh random trees
#
# Fresh values (and scales) per seed; the leaf shapes reuse golden tree
# structures so the jitted optaxclip functions compiled for the golden cases
# are reused (seed 1 is a dict tree: a new structure, compiled anew).
# --------------------------------------------------------------------------

LIVE_SHAPES = {
    0: [(2, 3, 4), (1,), (7, 1, 3)],
    1: [(4, 5), (3,)],
    2: [(1,), (3,), (4, 5), (2, 3, 4), (7, 1, 3)],
}
SCALES = [1e-3, 1.0, 1e3]
SEEDS = sorted(LIVE_SHAPES)
SEED_IDS = [f"seed{s}" for s in SEEDS]


def _random_leaves(seed: int) -> list[np.ndarray]:
  rng = np.random.default_rng(1000 + seed)
  return [
      (rng.standard_normal(shape) * SCALES[int(rng.integers(0, 3))]).astype(np.float32)
      for shape in LIVE_SHAPES[seed]
  ]


def _kind(seed: int) -> str:
  return "dict" if seed == 1 else "list"


def _np_norm(leaves, p: float) -> float:
  flat = np.concatenate([np.ravel(x).astype(np.float64) for x in leaves])
  if math.isinf(p):
    return float(np.max(np.abs(flat)))
  return float(np.sum(np.abs(flat) ** p) ** (1.0 / p))


def _f32(x) -> float:
  return float(np.float32(x))


def _torch_params(torch, leaves):
  params = []
  for x in leaves:
    prm = torch.nn.Parameter(torch.zeros(x.shape, dtype=torch.float32))
    prm.grad = torch.tensor(x)
    params.append(prm)
  return params


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf], ids=["p1", "p2", "p3", "pinf"])
@pytest.mark.parametrize("seed", SEEDS, ids=SEED_IDS)
def test_live_torch_clip_grad_norm(seed, norm_type):
  torch = pytest.importorskip("torch")
  leaves = _random_leaves(seed)
  g = _as_tree(leaves, _kind(seed))
  for factor in (0.5, 2.0):
    max_norm = _f32(factor * _np_norm(leaves, norm_type))
    params = _torch_params(torch, leaves)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    expected = [prm.grad.numpy() for prm in params]
    updates, state_norm, clipped, norm = _run("jit", _torch_norm_fns, norm_type, g, max_norm)
    what = f"max_norm = {factor} x norm"
    tol = _torch_tolerance(norm_type)
    _check(tol, state_norm, float(total), f"{what}: transform norm")
    _check_tree(tol, updates, expected, f"{what}: transform", like=g)
    _check(tol, norm, float(total), f"{what}: functional norm")
    _check_tree(tol, clipped, expected, f"{what}: functional", like=g)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf], ids=["p1", "p2", "p3", "pinf"])
def test_large_tensor_norm_within_ulps_of_exact(norm_type):
  """On 2**20 values the norm is within 2 float32 ulps of the exact one.

  For orders other than 1, 2 and inf the root ``s ** (1 / p)`` takes a
  rounded ``1 / p``: up to about 10 ulps. PyTorch's CPU norm kernel drifts
  from the exact norm as tensors grow (docs/migration/pytorch.md quotes by
  how much): where torch is installed, optaxclip's norm is no further from
  PyTorch's than PyTorch's own error.
  """
  x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
  exact = np.float32(_np_norm([x], norm_type))
  norm = np.asarray(F.global_norm([jnp.asarray(x)], ord=norm_type))
  ulps = 2 if norm_type in (1.0, 2.0, math.inf) else 10
  assert _ulps(norm, exact) <= ulps, (norm, exact)
  if importlib.util.find_spec("torch") is None:
    return
  torch = importlib.import_module("torch")
  total = torch.nn.utils.get_total_norm([torch.tensor(x)], norm_type).numpy()
  assert _ulps(norm, total) <= _ulps(total, exact) + ulps, (norm, total, exact)


# A given norm below, at and above the true one, and 0: (factor, max_norm
# as a multiple of the true norm).
USE_NORMS = [(0.5, 1.0), (1.0, 0.5), (2.0, 1.0), (0.0, 1.0)]


@pytest.mark.parametrize("seed", SEEDS, ids=SEED_IDS)
def test_live_torch_clip_grads_with_norm(seed):
  torch = pytest.importorskip("torch")
  leaves = _random_leaves(seed)
  g = _as_tree(leaves, _kind(seed))
  norm = _np_norm(leaves, 2.0)
  for factor, of_max in USE_NORMS:
    use_norm, max_norm = _f32(factor * norm), _f32(of_max * norm)
    params = _torch_params(torch, leaves)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm,
                                         torch.tensor(use_norm))
    expected = [prm.grad.numpy() for prm in params]
    clipped, got = _run("jit", _use_norm_fns, TORCH_EPS, g, max_norm, use_norm)
    what = f"use_norm = {factor} x norm, max_norm = {of_max} x norm"
    _check("torch", got, use_norm, f"{what}: the given norm")
    _check_tree("torch", clipped, expected, what, like=g)


@pytest.mark.parametrize("seed", SEEDS, ids=SEED_IDS)
def test_live_torch_split_api_equals_clip_grad_norm(seed):
  """``get_total_norm`` + ``clip_grads_with_norm_`` (torch's split form)
  against ``F.global_norm`` + ``use_norm``."""
  torch = pytest.importorskip("torch")
  leaves = _random_leaves(seed)
  g = _as_tree(leaves, _kind(seed))
  max_norm = _f32(0.5 * _np_norm(leaves, 2.0))
  params = _torch_params(torch, leaves)
  total = torch.nn.utils.get_total_norm([prm.grad for prm in params])
  torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
  expected = [prm.grad.numpy() for prm in params]
  clipped, _ = F.clip_by_global_norm(g, max_norm, eps=TORCH_EPS,
                                     use_norm=F.global_norm(g))
  _check_tree("torch", clipped, expected, "split form", like=g)


@pytest.mark.parametrize("seed", SEEDS, ids=SEED_IDS)
def test_live_tensorflow_use_norm(seed):
  tf = pytest.importorskip("tensorflow")
  leaves = _random_leaves(seed)
  g = _as_tree(leaves, _kind(seed))
  norm = _np_norm(leaves, 2.0)
  for factor, of_max in USE_NORMS:
    use_norm, c = _f32(factor * norm), _f32(of_max * norm)
    exp_clipped, exp_norm = tf.clip_by_global_norm(
        [tf.constant(x) for x in leaves], c, use_norm=tf.constant(use_norm))
    expected = [x.numpy() for x in exp_clipped]
    clipped, got = _run("jit", _use_norm_fns, 0.0, g, c, use_norm)
    what = f"use_norm = {factor} x norm, clip_norm = {of_max} x norm"
    _check("tensorflow", got, float(exp_norm), f"{what}: the given norm")
    _check_tree("tensorflow", clipped, expected, what, like=g)


@pytest.mark.parametrize("seed", SEEDS, ids=SEED_IDS)
def test_live_torch_clip_grad_value(seed):
  torch = pytest.importorskip("torch")
  leaves = _random_leaves(seed)
  g = _as_tree(leaves, _kind(seed))
  c = _f32(0.5 * max(float(np.max(np.abs(x))) for x in leaves))
  params = _torch_params(torch, leaves)
  torch.nn.utils.clip_grad_value_(params, c)
  expected = [prm.grad.numpy() for prm in params]
  clipped, updates = _run("jit", _value_fns, None, g, c)
  _check_tree("value", clipped, expected, "functional", like=g)
  _check_tree("value", updates, expected, "transform", like=g)


@pytest.mark.parametrize("seed", SEEDS, ids=SEED_IDS)
def test_live_tensorflow(seed):
  tf = pytest.importorskip("tensorflow")
  leaves = _random_leaves(seed)
  g = _as_tree(leaves, _kind(seed))
  tleaves = [tf.constant(x) for x in leaves]

  for factor in (0.5, 2.0):
    c = _f32(factor * _np_norm(leaves, 2.0))
    exp_clipped, exp_norm = tf.clip_by_global_norm(tleaves, c)
    expected = [x.numpy() for x in exp_clipped]
    clipped, norm, updates, state_norm, _ = _run("jit", _global_norm_fns, None, g, c)
    what = f"clip_norm = {factor} x norm"
    _check("tensorflow", norm, float(exp_norm), f"{what}: functional norm")
    _check_tree("tensorflow", clipped, expected, f"{what}: functional", like=g)
    _check("tensorflow", state_norm, float(exp_norm), f"{what}: state norm")
    _check_tree("tensorflow", updates, expected, f"{what}: transform", like=g)

  leaf_norms = sorted(float(np.linalg.norm(x.astype(np.float64))) for x in leaves)
  c = _f32(leaf_norms[len(leaf_norms) // 2])  # clips some leaves, not all
  expected = [tf.clip_by_norm(x, c).numpy() for x in tleaves]
  clipped, updates = _run("jit", _norm_fns, None, g, c)
  _check_tree("tensorflow", clipped, expected, "clip_by_norm functional", like=g)
  _check_tree("tensorflow", updates, expected, "clip_by_norm transform", like=g)

  m = max(float(np.max(np.abs(x))) for x in leaves)
  lo, hi = _f32(-0.3 * m), _f32(0.6 * m)
  expected = [tf.clip_by_value(x, lo, hi).numpy() for x in tleaves]
  clipped, updates = _run("jit", _value_fns, None, g, hi, lo)
  _check_tree("value", clipped, expected, "clip_by_value functional", like=g)
  _check_tree("value", updates, expected, "clip_by_value transform", like=g)


@pytest.mark.parametrize("seed", SEEDS, ids=SEED_IDS)
def test_live_optax(seed):
  leaves = _random_leaves(seed)
  g = _as_tree(leaves, _kind(seed))
  with warnings.catch_warnings():  # optax.global_norm is deprecated upstream
    warnings.simplefilter("ignore", DeprecationWarning)
    ref_norm = float(optax.global_norm(g))
  _check("optax", _run("jit", _global_norm_fns, None, g, 1.0)[-1], ref_norm, "global_norm")
  for factor in (0.5, 2.0):
    c = _f32(factor * _np_norm(leaves, 2.0))
    ref = optax.clip_by_global_norm(c)
    expected, _ = ref.update(g, ref.init(g))
    _, _, updates, _, _ = _run("jit", _global_norm_fns, None, g, c)
    _check_tree("optax", updates, _tree_leaves(expected),
                f"clip_by_global_norm, max_norm = {factor} x norm", like=g)
  d = _f32(0.4 * max(float(np.max(np.abs(x))) for x in leaves))
  ref = optax.clip(d)
  expected, _ = ref.update(g, ref.init(g))
  _, updates = _run("jit", _value_fns, None, g, d)
  _check_tree("value", updates, _tree_leaves(expected), "clip", like=g)


def _optax_agc_pieces(_, g, p, clipping):
  """optaxclip's AGC (functional and transform) and optax's unitwise pieces
  put together by hand from optaxclip's unitwise_norm/unitwise_clip."""
  tx = oc.adaptive_grad_clip(clipping)
  updates, _ = tx.update(g, tx.init(p), p)
  by_hand = jax.tree.map(
      lambda x, w: F.unitwise_clip(F.unitwise_norm(x),
                                   clipping * jnp.maximum(F.unitwise_norm(w), 1e-3), x),
      g, p)
  return F.adaptive_grad_clip(g, p, clipping), updates, by_hand


def _block_rms_fns(_, g, threshold):
  tx = oc.clip_by_block_rms(threshold)
  updates, _ = tx.update(g, tx.init(g))
  return F.clip_by_block_rms(g, threshold), updates


@pytest.mark.parametrize("seed", SEEDS, ids=SEED_IDS)
def test_live_optax_unitwise(seed):
  """functional.unitwise_norm / unitwise_clip against
  optax.transforms.unitwise_norm / unitwise_clip, leaf by leaf."""
  leaves = _random_leaves(seed)
  rng = np.random.default_rng(2000 + seed)
  for i, x in enumerate(leaves):
    ref_norm = optax.transforms.unitwise_norm(x)
    _check("optax", F.unitwise_norm(x), ref_norm, f"unitwise_norm leaf {i}")
    max_norm = (np.asarray(ref_norm) * rng.uniform(0.5, 1.5, x.shape)).astype(np.float32)
    _check("unitwise_clip", F.unitwise_clip(ref_norm, max_norm, x),
           optax.transforms.unitwise_clip(ref_norm, max_norm, x), f"unitwise_clip leaf {i}")


@pytest.mark.parametrize("seed", SEEDS, ids=SEED_IDS)
def test_live_optax_adaptive_grad_clip_and_block_rms(seed):
  leaves = _random_leaves(seed)
  g = _as_tree(leaves, _kind(seed))
  params = _as_tree([np.random.default_rng(3000 + seed).standard_normal(x.shape)
                     .astype(np.float32) for x in leaves], _kind(seed))
  for clipping in (0.01, 0.3):
    ref = optax.adaptive_grad_clip(clipping)
    expected, _ = ref.update(g, ref.init(params), params)
    pieces = _jitted(_optax_agc_pieces)(None, g, params, jnp.float32(clipping))
    for got, what in zip(pieces,
                         ("functional", "transform", "unitwise pieces")):
      _check_tree("optax", got, _tree_leaves(expected),
                  f"adaptive_grad_clip({clipping}) {what}", like=g)
  for threshold in (1e-3, 0.5):
    ref = optax.clip_by_block_rms(threshold)
    expected, _ = ref.update(g, ref.init(g))
    for got, what in zip(_run("jit", _block_rms_fns, None, g, threshold),
                         ("functional", "transform")):
      _check_tree("optax", got, _tree_leaves(expected),
                  f"clip_by_block_rms({threshold}) {what}", like=g)


if __name__ == "__main__":
  rc = pytest.main([__file__, "-q", "-p", "no:cacheprovider"])
  mod = sys.modules.get("test_parity") or sys.modules.get("tests.test_parity")
  if mod is not None:
    for tolerance, steps in sorted(mod.MAX_ULPS.items()):
      print(f"largest difference, {tolerance}: {steps} float32 ulps "
            f"(allowed: {mod.ULPS[tolerance]})")
  sys.exit(rc)
