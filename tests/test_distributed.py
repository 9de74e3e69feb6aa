"""Distributed clipping: sharded ``jit`` (GSPMD), ``shard_map``/``pmap`` with
``axis_name``/``specs``, and the collectives the compiled step runs; per-layer
norms, per-layer clippers and norm groups on stacked layers split over a mesh.

Every result is compared with float64 numpy on the whole, unsharded tree.
The 8 host CPU devices come from ``conftest.py``; several processes are in
``test_multiprocess.py``. Compiling is what costs here, so each test compiles
one step that computes every function and transform at once.
"""

import functools
import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  AXIS_TYPES,
  checkout_env,
  f64,
  hlo_ops,
  make_mesh,
  np_factor,
  np_leaf_norm,
  np_norm,
  run_process,
  shard,
)
from jax import shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxclip as oc

F = oc.functional
ORDS = [1, 2, 3, math.inf]
MAX_NORM = 1.0        # below every global norm here: the global clippers clip
MAX_LEAF_NORM = 3.0   # some leaves above, some below: per-leaf clipping varies
# Collectives that move gradient data between devices; a norm needs none.
DATA_MOVING = ("all-gather", "all-to-all", "collective-permute")


# --------------------------------------------------------------------------
# References

def float_leaves(tree):
  return [x for x in jax.tree.leaves(tree)
          if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]


def assert_scaled(actual, original, factors):
  """Each float leaf of ``actual`` is the leaf of ``original`` times its factor."""
  leaves = float_leaves(original)
  got = float_leaves(actual)
  assert len(got) == len(leaves)
  if np.ndim(factors) == 0:
    factors = [factors] * len(leaves)
  for x, y, s in zip(leaves, got, factors):
    assert y.dtype == x.dtype and y.shape == x.shape
    rtol = 1e-6 if x.dtype == jnp.float32 else 5e-3  # bf16: one rounding
    np.testing.assert_allclose(f64(y), f64(x) * s, rtol=rtol, atol=0)


def expected_state(norm: float, factor: float) -> dict:
  return {"norm": norm, "scale": factor, "count": 1,
          "clipped_count": int(factor < 1), "nonfinite_count": 0}


def assert_state(state, norm: float, factor: float):
  """A ``ClipState`` (scalars, or one copy per device) holds these values."""
  for field, want in expected_state(norm, factor).items():
    got = np.asarray(getattr(state, field))
    if isinstance(want, int):
      np.testing.assert_array_equal(got, want, err_msg=field)
    else:
      np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=field)


# --------------------------------------------------------------------------
# HLO

def test_hlo_counter_sees_main_path_and_branches():
  mesh = jax.make_mesh((8,), ("i",))

  def f(x):
    total = jax.lax.psum(jnp.sum(x), "i")
    return jax.lax.cond(total > 0, lambda: jax.lax.psum(x, "i"), lambda: x)

  g = shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False)
  x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("i")))
  hlo = jax.jit(g).lower(x).compile().as_text()
  assert hlo_ops(hlo, "conditional") == (1, 0)
  assert hlo_ops(hlo, "all-reduce") == (1, 1)


# --------------------------------------------------------------------------
# Trees

# layout -> (mesh shape, axis names, {leaf name: (shape, spec)})
LAYOUTS = {
    # Every leaf split on its first axis (FSDP / ZeRO-3), some of equal shape.
    "fsdp": ((8,), ("data",), {
        "embed": ((64, 16), P("data")),
        "w1": ((16, 32), P("data")),
        "w2": ((32, 16), P("data")),
        "b1": ((32,), P("data")),
        "b2": ((16,), P("data")),
        "norms": [((8,), P("data")), ((8,), P("data")), ((8,), P("data"))],
    }),
    # Megatron-style tensor parallelism: column- and row-parallel matrices,
    # biases of column-parallel layers split, the rest replicated.
    "tp": ((8,), ("model",), {
        "qkv": ((16, 48), P(None, "model")),
        "qkv_b": ((48,), P("model")),
        "out": ((24, 16), P("model", None)),
        "out_b": ((16,), P()),
        "ln": ((12,), P()),
    }),
    # 2-D mesh: split on both axes, on one (replicated on the other), or none.
    "2d": ((2, 4), ("data", "model"), {
        "both": ((8, 12), P("data", "model")),
        "model_only": ((6, 16), P(None, "model")),
        "data_only": ((10, 4), P("data")),
        "flat": ((24,), P(("data", "model"))),
        "swapped": ((4, 6), P("model", "data")),
        "replicated": ((5,), P()),
    }),
    # Many small leaves of one shape and dtype, each sharded differently:
    # the norm stacks such leaves to reduce them together.
    "many_small": ((2, 4), ("data", "model"), {
        f"layer{i:02d}": ((8, 8), [P("data"), P(None, "model"), P(),
                                   P("model"), P(("data", "model")),
                                   P("data", "model"), P(None, "data"),
                                   P("model", "data")][i % 8])
        for i in range(40)
    }),
}


def _is_leaf_def(x):
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P)


def layout_specs(layout):
  return jax.tree.map(lambda d: d[1], LAYOUTS[layout][2], is_leaf=_is_leaf_def)


def host_tree(layout, dtype=jnp.float32, scale=1.0, seed=0):
  """The unsharded values, as numpy arrays of ``dtype``."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda d: np.asarray(jnp.asarray(rng.normal(size=d[0]) * scale, dtype)),
      LAYOUTS[layout][2], is_leaf=_is_leaf_def)


def layout_mesh(layout, axis_type="explicit"):
  shape, names, _ = LAYOUTS[layout]
  return make_mesh(shape, names, axis_type)


# --------------------------------------------------------------------------
# 1. GSPMD: jit over NamedSharding arrays, no axis_name

def gspmd_step(tree):
  """Every norm-based function and transform, every order: one compile.
  (``global_norm`` is what ``clip_by_global_norm`` computes and returns.)"""
  out = {}
  out["clipped"], out["clip_norm"] = F.clip_by_global_norm(tree, MAX_NORM)
  for name, tx in gspmd_transforms().items():
    out[name] = tx.update(tree, tx.init(tree))
  return out


def gspmd_transforms():
  return {"tx_global_inf": oc.clip_by_global_norm(MAX_NORM, ord="inf"),
          "tx_grad_norm1": oc.clip_grad_norm(MAX_NORM, norm_type=1),
          "tx_per_leaf": oc.clip_by_norm(MAX_LEAF_NORM, ord=3)}


@functools.cache
def compiled_gspmd(layout, axis_type, dtype_name="float32"):
  """(host tree, sharded tree, compiled step) or the exception compiling it."""
  mesh = layout_mesh(layout, axis_type)
  host = host_tree(layout, jnp.dtype(dtype_name))
  tree = shard(host, mesh, layout_specs(layout))
  try:
    compiled = jax.jit(gspmd_step).lower(tree).compile()
  except Exception as error:  # reported by each test that needs it
    return host, tree, error
  return host, tree, compiled


def get_compiled(layout, axis_type, dtype_name="float32"):
  host, tree, compiled = compiled_gspmd(layout, axis_type, dtype_name)
  if isinstance(compiled, Exception):
    raise AssertionError(
        f"sharded jit of the clippers fails on a {axis_type} mesh for the "
        f"{layout!r} tree: {type(compiled).__name__}: "
        f"{str(compiled)[:500]}") from None
  return host, tree, compiled


def check_gspmd_results(host, tree, out):
  leaves = float_leaves(host)
  norm2 = np_norm(leaves, 2)
  np.testing.assert_allclose(out["clip_norm"], norm2, rtol=1e-6)
  assert_scaled(out["clipped"], host, np_factor(norm2, MAX_NORM))

  norm_inf = np_norm(leaves, math.inf)
  updates, state = out["tx_global_inf"]
  assert_scaled(updates, host, np_factor(norm_inf, MAX_NORM))
  assert_state(state, norm_inf, np_factor(norm_inf, MAX_NORM))

  norm1 = np_norm(leaves, 1)
  updates, state = out["tx_grad_norm1"]
  assert_scaled(updates, host, np_factor(norm1, MAX_NORM, 1e-6))
  assert_state(state, norm1, np_factor(norm1, MAX_NORM, 1e-6))

  leaf_norms = [np_norm([x], 3) for x in leaves]
  factors = [np_factor(n, MAX_LEAF_NORM) for n in leaf_norms]
  updates, state = out["tx_per_leaf"]
  assert_scaled(updates, host, factors)
  assert_state(state, max(leaf_norms), min(factors))


GSPMD_CASES = [(layout, axis_type) for layout in LAYOUTS for axis_type in AXIS_TYPES]


@pytest.mark.parametrize("layout,axis_type", GSPMD_CASES)
def test_gspmd_gives_the_global_result(layout, axis_type):
  host, tree, compiled = get_compiled(layout, axis_type)
  check_gspmd_results(host, tree, compiled(tree))


def test_gspmd_bfloat16():
  host, tree, compiled = get_compiled("2d", "explicit", "bfloat16")
  check_gspmd_results(host, tree, compiled(tree))


@pytest.mark.parametrize("layout,axis_type", GSPMD_CASES)
def test_gspmd_outputs_keep_the_input_sharding(layout, axis_type):
  _, tree, compiled = get_compiled(layout, axis_type)
  out = compiled(tree)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(tree),
                          jax.tree.leaves(out["clipped"])):
    assert y.sharding.is_equivalent_to(x.sharding, x.ndim), (
        f"{jax.tree_util.keystr(path)}: input {x.sharding.spec}, "
        f"output {y.sharding.spec}")
  for name in gspmd_transforms():
    updates, state = out[name]
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(updates)):
      assert y.sharding.is_equivalent_to(x.sharding, x.ndim), name
    assert all(s.sharding.is_fully_replicated for s in jax.tree.leaves(state)), name
  assert out["clip_norm"].sharding.is_fully_replicated


@pytest.mark.parametrize("layout,axis_type", GSPMD_CASES)
def test_gspmd_moves_no_gradient_data(layout, axis_type):
  _, _, compiled = get_compiled(layout, axis_type)
  hlo = compiled.as_text()
  moved = {op: hlo_ops(hlo, op) for op in DATA_MOVING}
  assert all(n == (0, 0) for n in moved.values()), (
      f"the compiled step moves gradient data between devices "
      f"((main path, inside conditional branches) per op): {moved}")


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_gspmd_overflow_safe(axis_type):
  # ~1e20: squares overflow float32, the rescaling branch runs, sharded.
  host = host_tree("2d", scale=1e20, seed=3)
  mesh = layout_mesh("2d", axis_type)
  tree = shard(host, mesh, layout_specs("2d"))
  tx = oc.clip_by_global_norm(MAX_NORM)

  @jax.jit
  def step(tree):
    return (F.global_norm(tree), F.clip_by_norm(tree, MAX_NORM),
            tx.update(tree, tx.init(tree)))

  norm, per_leaf, (updates, state) = step(tree)
  leaves = float_leaves(host)
  want = np_norm(leaves, 2)
  assert np.isfinite(want) and want > 1e20
  np.testing.assert_allclose(norm, want, rtol=1e-6)
  assert_scaled(updates, host, np_factor(want, MAX_NORM))
  assert_state(state, want, np_factor(want, MAX_NORM))
  assert_scaled(per_leaf, host, [np_factor(np_norm([x], 2), MAX_NORM)
                                 for x in leaves])


_REMAT_PROBE = """
import sys
sys.path.insert(0, {tests!r})
import test_distributed
test_distributed.remat_probe()
"""
REMAT_WARNING = "involuntary full rematerialization"


def remat_probe():
  """Run in a subprocess with XLA's warnings on: compiles a step that makes
  XLA warn (the control), then the global clipper for every layout with
  differently sharded leaves."""
  mesh = make_mesh((4, 2), ("x", "y"), "auto")
  s1, s2 = NamedSharding(mesh, P("y", None, "x")), NamedSharding(mesh, P(None, ("x", "y")))
  x = jax.ShapeDtypeStruct((16, 16, 16), jnp.float32)
  jax.jit(lambda a, b: jax.lax.with_sharding_constraint(a + b, s2),
          in_shardings=(s1, s1)).lower(x, x).compile()
  print("control done", file=sys.stderr, flush=True)
  for layout, axis_type in GSPMD_CASES:
    if layout == "fsdp":
      continue
    tree = shard(host_tree(layout), layout_mesh(layout, axis_type),
                 layout_specs(layout))
    try:
      jax.jit(lambda t: F.clip_by_global_norm(t, MAX_NORM)).lower(tree).compile()
    except Exception as error:  # the type error is another test's business
      print(f"{layout} {axis_type} failed: {type(error).__name__}", flush=True)
    print(f"{layout} {axis_type} done", file=sys.stderr, flush=True)


def test_gspmd_no_involuntary_rematerialization():
  # XLA logs the warning from C++; conftest silences that log in this process.
  env = checkout_env(TF_CPP_MIN_LOG_LEVEL="1",
                     XLA_FLAGS="--xla_force_host_platform_device_count=8")
  # XLA warns while it compiles: a program read back from the run's
  # compilation cache (conftest) would compile nothing, and warn nothing.
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  code = _REMAT_PROBE.format(tests=str(pathlib.Path(__file__).parent))
  run = run_process([sys.executable, "-c", code], env=env)
  assert run.returncode == 0, run.stderr[-3000:]
  stages = re.split(r"^(.*) done$", run.stderr, flags=re.M)
  # stages: [log before control, "control", log, layout, log, ...]
  assert stages[1] == "control" and REMAT_WARNING in stages[0].lower(), (
      "the control did not warn: the probe cannot see XLA's warnings\n" +
      run.stderr[-2000:])
  warned = [name for log, name in zip(stages[2::2], stages[3::2])
            if REMAT_WARNING in log.lower()]
  assert len(stages) == 3 + 2 * (len(GSPMD_CASES) - 2), run.stderr[-2000:]
  assert not warned, f"XLA rematerializes gradients for: {warned}"


# --------------------------------------------------------------------------
# 2. shard_map / pmap with axis_name (and specs)

AXES = ("data", "model")
# A 2x4 mesh. The five "stack" leaves all have local shape (4, 4) but differ
# in how they are split: they are reduced as one stack, each with its own
# replication. The int leaf is left out of every norm.
SM_LEAVES = {
    "both": ((8, 12), P("data", "model")),
    "model_only": ((6, 16), P(None, "model")),     # replicated over data
    "data_only": ((10, 4), P("data")),             # replicated over model
    "replicated": ((5,), P()),
    "flat": ((24,), P(("data", "model"))),
    "stack": [((8, 4), P("data")), ((4, 4), P()), ((4, 16), P(None, "model")),
              ((32, 4), P(("data", "model"))), ((8, 16), P("data", "model"))],
}
SM_SPECS = jax.tree.map(lambda d: d[1], SM_LEAVES, is_leaf=_is_leaf_def)


def sm_host(dtype=jnp.float32, scale=1.0, seed=1):
  rng = np.random.default_rng(seed)
  tree = jax.tree.map(
      lambda d: np.asarray(jnp.asarray(rng.normal(size=d[0]) * scale, dtype)),
      SM_LEAVES, is_leaf=_is_leaf_def)
  tree["step"] = np.arange(8, dtype=np.int32)
  return tree


def sm_specs():
  return {**SM_SPECS, "step": P("data")}


def sm_transforms(ord, axis_name, specs):
  kw = dict(axis_name=axis_name, specs=specs)
  return {"tx_global": oc.clip_by_global_norm(MAX_NORM, ord=ord, **kw),
          "tx_per_leaf": oc.clip_by_norm(MAX_LEAF_NORM, ord=ord, **kw),
          "tx_grad_norm": oc.clip_grad_norm(MAX_NORM, norm_type=ord, **kw)}


def sm_step(tree, ord, axis_name, specs):
  """Every norm-based function and transform under one shard_map."""
  trees = {}
  # (global_norm is what clip_by_global_norm computes and returns.)
  scalars = {"finite": F.all_finite(tree, axis_name=axis_name)}
  trees["clipped"], scalars["clip_norm"] = F.clip_by_global_norm(
      tree, MAX_NORM, ord=ord, axis_name=axis_name, specs=specs)
  trees["per_leaf"] = F.clip_by_norm(tree, MAX_LEAF_NORM, ord=ord,
                                     axis_name=axis_name, specs=specs)
  for name, tx in sm_transforms(ord, axis_name, specs).items():
    trees[name], scalars[name] = tx.update(tree, tx.init(tree))
  # The same scalars twice: out_specs=P() (shard_map checks they are
  # replicated) and one copy per device (we check they are equal).
  per_device = jax.tree.map(lambda s: jnp.reshape(s, (1,)), scalars)
  return trees, scalars, per_device


def check_sm_results(host, ord, out):
  trees, scalars, per_device = out
  leaves = float_leaves(host)
  norm = np_norm(leaves, ord)
  factor = np_factor(norm, MAX_NORM)
  leaf_norms = [np_norm([x], ord) for x in leaves]
  leaf_factors = [np_factor(n, MAX_LEAF_NORM) for n in leaf_norms]
  for name, values in (("invariant", scalars), ("per device", per_device)):
    assert all(np.shape(v) == ((8,) if name == "per device" else ())
               for v in jax.tree.leaves(values))
    np.testing.assert_allclose(values["clip_norm"], norm, rtol=1e-6, err_msg=name)
    np.testing.assert_array_equal(values["finite"], True)
    assert_state(values["tx_global"], norm, factor)
    assert_state(values["tx_grad_norm"], norm, np_factor(norm, MAX_NORM, 1e-6))
    assert_state(values["tx_per_leaf"], max(leaf_norms), min(leaf_factors))
  assert_scaled(trees["clipped"], host, factor)
  assert_scaled(trees["tx_global"], host, factor)
  assert_scaled(trees["tx_grad_norm"], host, np_factor(norm, MAX_NORM, 1e-6))
  assert_scaled(trees["per_leaf"], host, leaf_factors)
  assert_scaled(trees["tx_per_leaf"], host, leaf_factors)
  for key in trees:
    np.testing.assert_array_equal(trees[key]["step"], host["step"])


def run_sm(host, ord, axis_type="explicit"):
  mesh = make_mesh((2, 4), AXES, axis_type)
  specs = sm_specs()
  tree = shard(host, mesh, specs)
  out_specs = ({k: specs for k in ("clipped", "per_leaf", *sm_transforms(2, None, None))},
               P(), P(AXES))
  step = jax.jit(shard_map(
      functools.partial(sm_step, ord=ord, axis_name=AXES, specs=specs),
      mesh=mesh, in_specs=(specs,), out_specs=out_specs))
  return step(tree)


@pytest.mark.parametrize("ord", ORDS)
def test_shard_map_with_specs_float32(ord):
  host = sm_host()
  check_sm_results(host, ord, run_sm(host, ord))


def test_shard_map_with_specs_bfloat16():
  host = sm_host(jnp.bfloat16)
  check_sm_results(host, 2, run_sm(host, 2))


def test_shard_map_overflow_safe_on_an_auto_mesh():
  # ~1e20: squares overflow float32 and the rescaling branch runs, with its
  # own collectives. (Axis types only matter outside shard_map.)
  host = sm_host(scale=1e20, seed=4)
  assert np.isfinite(np_norm(float_leaves(host), 2))
  check_sm_results(host, 2, run_sm(host, 2, "auto"))


@pytest.mark.parametrize("spec", [P("data"), P(None, "model"), P("model", None)],
                         ids=["data-replicated-over-model", "model-replicated-over-data",
                              "model-on-axis-0"])
def test_leaf_split_on_one_axis_replicated_on_the_other(spec):
  # On a 2x4 mesh, a leaf split over one axis and replicated over the other
  # counts once: the norm of the leaf, not 2x or 4x its square.
  mesh = make_mesh((2, 4), AXES)
  x = np.random.default_rng(5).normal(size=(8, 8)).astype(np.float32)
  specs = {"x": spec}
  f = jax.jit(shard_map(
      lambda t: F.global_norm(t, axis_name=AXES, specs=specs)[None],
      mesh=mesh, in_specs=(specs,), out_specs=P(AXES)))
  np.testing.assert_allclose(f(shard({"x": x}, mesh, specs)),
                             np.full(8, np_norm([x], 2)), rtol=1e-6)


@pytest.mark.parametrize("ord", [2, math.inf])
def test_shard_map_without_specs_treats_every_leaf_as_split(ord):
  mesh = make_mesh((2, 4), AXES)
  rng = np.random.default_rng(6)
  host = {"a": rng.normal(size=(16, 4)).astype(np.float32),
          "b": rng.normal(size=(8, 8)).astype(np.float32)}
  specs = {"a": P(AXES), "b": P("data", "model")}
  tx = oc.clip_by_global_norm(MAX_NORM, ord=ord, axis_name=AXES)

  def step(tree):
    clipped, norm = F.clip_by_global_norm(tree, MAX_NORM, ord=ord, axis_name=AXES)
    updates, state = tx.update(tree, tx.init(tree))
    return clipped, updates, norm, state

  f = jax.jit(shard_map(step, mesh=mesh, in_specs=(specs,),
                        out_specs=(specs, specs, P(), P())))
  clipped, updates, norm, state = f(shard(host, mesh, specs))
  want = np_norm(float_leaves(host), ord)
  np.testing.assert_allclose(norm, want, rtol=1e-6)
  assert_scaled(clipped, host, np_factor(want, MAX_NORM))
  assert_scaled(updates, host, np_factor(want, MAX_NORM))
  assert_state(state, want, np_factor(want, MAX_NORM))

  # A replicated leaf with specs=None is, as documented, taken as split: each
  # of the 8 copies counts (sum of squares 8x; the max is unchanged).
  g = jax.jit(shard_map(lambda x: F.global_norm(x, ord, axis_name=AXES),
                        mesh=mesh, in_specs=P(), out_specs=P()))
  x = host["b"]
  copies = 1.0 if ord == math.inf else 8 ** (1 / ord)
  np.testing.assert_allclose(g(jax.device_put(x, NamedSharding(mesh, P()))),
                             np_norm([x], ord) * copies, rtol=1e-6)


@pytest.mark.parametrize("ord", [2, math.inf])
def test_shard_map_single_axis_name(ord):
  mesh = make_mesh((8,), ("i",))
  rng = np.random.default_rng(7)
  host = {"w": rng.normal(size=(16, 3)).astype(np.float32),
          "b": rng.normal(size=(3,)).astype(np.float32)}
  specs = {"w": P("i"), "b": P()}
  tx = oc.clip_by_global_norm(MAX_NORM, ord=ord, axis_name="i", specs=specs)

  def step(tree):
    updates, state = tx.update(tree, tx.init(tree))
    return (F.global_norm(tree, ord, axis_name="i", specs=specs), updates,
            jax.tree.map(lambda s: s[None], state))

  f = jax.jit(shard_map(step, mesh=mesh, in_specs=(specs,),
                        out_specs=(P(), specs, P("i"))))
  norm, updates, state = f(shard(host, mesh, specs))
  want = np_norm(float_leaves(host), ord)
  np.testing.assert_allclose(norm, want, rtol=1e-6)
  assert_scaled(updates, host, np_factor(want, MAX_NORM))
  assert_state(state, want, np_factor(want, MAX_NORM))


@pytest.mark.parametrize("ord", [1, 2, math.inf])
def test_pmap(ord):
  # pmap: in_axes=0 leaves are split over "i" (spec P("i")), in_axes=None
  # leaves replicated (spec P()).
  rng = np.random.default_rng(8)
  split = rng.normal(size=(8, 5, 3)).astype(np.float32)
  replicated = rng.normal(size=(7,)).astype(np.float32)
  specs = {"split": P("i"), "replicated": P()}
  txs = {"tx_global": oc.clip_by_global_norm(MAX_NORM, ord=ord, axis_name="i",
                                             specs=specs),
         "tx_grad_norm": oc.clip_grad_norm(MAX_NORM, norm_type=ord, axis_name="i",
                                           specs=specs),
         "tx_per_leaf": oc.clip_by_norm(MAX_LEAF_NORM, ord=ord, axis_name="i",
                                        specs=specs)}

  def step(split, replicated):
    tree = {"split": split, "replicated": replicated}
    out = {"norm": F.global_norm(tree, ord, axis_name="i", specs=specs),
           "per_leaf": F.clip_by_norm(tree, MAX_LEAF_NORM, ord=ord, axis_name="i",
                                      specs=specs)}
    out["clipped"], _ = F.clip_by_global_norm(tree, MAX_NORM, ord=ord,
                                              axis_name="i", specs=specs)
    for name, tx in txs.items():
      out[name] = tx.update(tree, tx.init(tree))
    return out

  out = jax.pmap(step, axis_name="i", in_axes=(0, None))(split, replicated)
  # Per device outputs: the replicated leaf comes back once per device.
  whole = {"split": split, "replicated": np.broadcast_to(replicated, (8, 7))}
  leaves = float_leaves({"split": split, "replicated": replicated})  # tree order
  norm = np_norm(leaves, ord)
  np.testing.assert_allclose(out["norm"], np.full(8, norm), rtol=1e-6)
  assert_scaled(out["clipped"], whole, np_factor(norm, MAX_NORM))
  assert_scaled(out["tx_global"][0], whole, np_factor(norm, MAX_NORM))
  assert_state(out["tx_global"][1], norm, np_factor(norm, MAX_NORM))
  assert_scaled(out["tx_grad_norm"][0], whole, np_factor(norm, MAX_NORM, 1e-6))
  assert_state(out["tx_grad_norm"][1], norm, np_factor(norm, MAX_NORM, 1e-6))
  leaf_norms = [np_norm([x], ord) for x in leaves]
  factors = [np_factor(n, MAX_LEAF_NORM) for n in leaf_norms]
  assert_scaled(out["per_leaf"], whole, factors)
  assert_scaled(out["tx_per_leaf"][0], whole, factors)
  assert_state(out["tx_per_leaf"][1], max(leaf_norms), min(factors))


def test_nonfinite_zero_agrees_on_every_device():
  # A NaN on one device: the global norm is NaN everywhere, every device
  # zeroes its shard and counts the step.
  mesh = make_mesh((8,), ("i",))
  x = np.ones((16,), np.float32)
  x[3] = np.nan
  tx = oc.clip_by_global_norm(MAX_NORM, axis_name="i", specs=P("i"), nonfinite="zero")

  def step(x):
    updates, state = tx.update(x, tx.init(x))
    return updates, jax.tree.map(lambda s: s[None], state), F.all_finite(
        x, axis_name="i")[None]

  f = jax.jit(shard_map(step, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  updates, state, finite = f(jax.device_put(x, NamedSharding(mesh, P("i"))))
  np.testing.assert_array_equal(updates, np.zeros(16))
  np.testing.assert_array_equal(state.nonfinite_count, np.ones(8))
  np.testing.assert_array_equal(state.count, np.ones(8))
  np.testing.assert_array_equal(finite, np.zeros(8, bool))


# --------------------------------------------------------------------------
# specs that do not fit

def test_specs_leaves_of_the_tree_that_are_none():
  # A None gradient (a frozen or absent parameter) is an empty subtree: the
  # specs of the other leaves must still line up with their leaves.
  mesh = make_mesh((8,), ("i",))
  host = {"a": np.ones((3,), np.float32), "b": None, "c": np.ones((8,), np.float32)}
  specs = {"a": P(), "b": P(), "c": P("i")}
  tree = {"a": jax.device_put(host["a"], NamedSharding(mesh, P())), "b": None,
          "c": jax.device_put(host["c"], NamedSharding(mesh, P("i")))}
  f = jax.jit(shard_map(lambda t: F.global_norm(t, axis_name="i", specs=specs),
                        mesh=mesh, in_specs=(specs,), out_specs=P()))
  np.testing.assert_allclose(f(tree), math.sqrt(11), rtol=1e-6,
                             err_msg="specs misaligned by the None leaf 'b'")


def test_specs_and_masked_nodes():
  mesh = make_mesh((8,), ("i",))
  specs = {"a": P(), "b": P(), "c": P("i")}
  tree = {"a": jax.device_put(np.ones((3,), np.float32), NamedSharding(mesh, P())),
          "b": optax.MaskedNode(),
          "c": jax.device_put(np.ones((8,), np.float32), NamedSharding(mesh, P("i")))}
  f = jax.jit(shard_map(lambda t: F.global_norm(t, axis_name="i", specs=specs),
                        mesh=mesh, in_specs=(specs,), out_specs=P()))
  np.testing.assert_allclose(f(tree), math.sqrt(11), rtol=1e-6)


GRADS = {"w": jnp.ones((4,)), "b": jnp.ones((2,)), "layers": [jnp.ones(3), jnp.ones(3)]}


@pytest.mark.parametrize("specs,match", [
    ({"w": P("i"), "b": P()}, r"does not match(.|\n)*layers"),
    ({"w": P("i"), "b": P(), "layers": [P()]}, r"does not match(.|\n)*layers"),
    ({"w": P("i"), "b": P(), "layers": P(), "extra": P()},
     r"does not match(.|\n)*extra"),
    ([P("i"), P()], r"does not match(.|\n)*list(.|\n)*dict"),
])
@pytest.mark.parametrize("fn", ["global_norm", "clip_by_global_norm", "clip_by_norm",
                                "tx_clip_by_global_norm", "tx_clip_grad_norm"])
def test_specs_that_do_not_match_the_tree(fn, specs, match):
  calls = {
      "global_norm": lambda t: F.global_norm(t, axis_name="i", specs=specs),
      "clip_by_global_norm": lambda t: F.clip_by_global_norm(
          t, 1.0, axis_name="i", specs=specs),
      "clip_by_norm": lambda t: F.clip_by_norm(t, 1.0, axis_name="i", specs=specs),
      "tx_clip_by_global_norm": lambda t: oc.clip_by_global_norm(
          1.0, axis_name="i", specs=specs).update(t, oc.clip_by_global_norm(1.0).init(t)),
      "tx_clip_grad_norm": lambda t: oc.clip_grad_norm(
          1.0, axis_name="i", specs=specs).update(t, oc.clip_grad_norm(1.0).init(t)),
  }
  batched = jax.tree.map(lambda x: x[None], GRADS)
  name = re.escape(f"`{fn.removeprefix('tx_')}(specs=...)`")
  with pytest.raises(ValueError, match=name + r"(.|\n)*" + match):
    jax.vmap(calls[fn], axis_name="i")(batched)


def test_specs_naming_an_axis_outside_axis_name():
  # A leaf split over "model" while the norm only sums over "data": each
  # device would see a different norm. Either refuse, naming the axis, or
  # sum over it too; never give devices different answers.
  mesh = make_mesh((2, 4), AXES)
  x = np.random.default_rng(9).normal(size=(8, 8)).astype(np.float32)
  specs = P("data", "model")
  f = jax.jit(shard_map(lambda x: F.global_norm(x, axis_name="data", specs=specs)[None],
                        mesh=mesh, in_specs=specs, out_specs=P(AXES)))
  try:
    norms = f(jax.device_put(x, NamedSharding(mesh, specs)))
  except ValueError as error:
    assert "model" in str(error)
    return
  np.testing.assert_allclose(norms, np.full(8, np_norm([x], 2)), rtol=1e-6,
                             err_msg="norms differ between devices")


# --------------------------------------------------------------------------
# 3. One collective per step

N_LEAVES = 40


CLIPPERS_40 = {
    "clip_by_global_norm ord=2": lambda t, sp: F.clip_by_global_norm(
        t, 1.0, axis_name=AXES, specs=sp),
    "clip_by_global_norm ord=inf": lambda t, sp: F.clip_by_global_norm(
        t, 1.0, ord="inf", axis_name=AXES, specs=sp),
    "clip_by_norm ord=2": lambda t, sp: F.clip_by_norm(t, 1.0, axis_name=AXES,
                                                       specs=sp),
}


@functools.cache
def hlo_counts_40_leaves(name, with_specs):
  """{op: (main path, conditional branches)} for a clipper on a 40-leaf tree
  split in six ways over a 2x4 mesh, with or without specs."""
  mesh = make_mesh((2, 4), AXES)
  pool = [P("data"), P(None, "model"), P(), P("model"), P(AXES),
          P("data", "model")]
  specs = [pool[i % len(pool)] for i in range(N_LEAVES)]
  tree = [jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, sp))
          for sp in specs]
  fn, sp = CLIPPERS_40[name], (specs if with_specs else None)
  f = shard_map(lambda t: fn(t, sp), mesh=mesh, in_specs=(specs,),
                out_specs=P(), check_vma=False)
  hlo = jax.jit(f).lower(tree).compile().as_text()
  return {op: hlo_ops(hlo, op) for op in ("all-reduce", "conditional") + DATA_MOVING}


@pytest.mark.parametrize("with_specs", [False, True])
@pytest.mark.parametrize("name", list(CLIPPERS_40))
def test_one_all_reduce_on_the_main_path(name, with_specs):
  counts = hlo_counts_40_leaves(name, with_specs)
  main, in_branches = counts["all-reduce"]
  print(f"{name}, specs={with_specs}: all-reduce main path {main}, "
        f"conditional branches {in_branches}")
  assert main == 1, (f"{name} (specs: {with_specs}) on {N_LEAVES} leaves: "
                     f"{main} all-reduces on the main path, {in_branches} in "
                     f"conditional branches")
  if "inf" in name:
    assert counts["conditional"] == (0, 0)  # a max needs no overflow branch
  for op in DATA_MOVING:
    assert counts[op] == (0, 0), (op, counts[op])


# Issue 32, defect 6: the all-reduces per kernel and order that
# docs/distributed.md ("How many all-reduces") states: (every step, only in
# the CPU rescue's branch).
DOCUMENTED_ALL_REDUCES = {
    ("rescue", 2): (1, 1), ("rescue", 1): (1, 1), ("rescue", "inf"): (1, 0),
    ("rescue", 3): (1, 2), ("rescue", 130): (1, 3),
    ("one_pass", 2): (1, 0), ("one_pass", 1): (1, 0), ("one_pass", 0.5): (2, 0),
    ("one_pass", 130): (3, 0)}


@pytest.mark.parametrize("kernel,ord", list(DOCUMENTED_ALL_REDUCES))
def test_all_reduces_per_kernel_and_order_are_the_documented_ones(kernel, ord,
                                                                   monkeypatch):
  monkeypatch.setenv("OPTAXCLIP_KERNEL", kernel)
  mesh = make_mesh((8,), ("i",))
  specs = [P("i"), P(), P(None, "i")]
  tree = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, sp))
          for shape, sp in zip([(64, 8), (16,), (4, 8)], specs)]
  tx = oc.clip_by_global_norm(1.0, ord=ord, axis_name="i", specs=specs,
                              leaf_norms=True)
  step = shard_map(lambda t: tx.update(t, tx.init(t))[0], mesh=mesh,
                   in_specs=(specs,), out_specs=specs, check_vma=False)
  hlo = jax.jit(step).lower(tree).compile().as_text()
  assert hlo_ops(hlo, "all-reduce") == DOCUMENTED_ALL_REDUCES[kernel, ord]
  if kernel == "one_pass":
    assert hlo_ops(hlo, "conditional") == (0, 0)


def test_gspmd_all_reduces_40_leaves():
  # Sharded jit, FSDP-style: XLA inserts the all-reduce of the partial sums.
  mesh = make_mesh((8,), ("data",))
  tree = [jax.ShapeDtypeStruct((8, 8 * (1 + i % 3)), jnp.float32,
                               sharding=NamedSharding(mesh, P("data")))
          for i in range(N_LEAVES)]
  hlo = jax.jit(lambda t: F.clip_by_global_norm(t, 1.0)).lower(tree).compile().as_text()
  print("GSPMD clip_by_global_norm, all-reduce (main path, branches):",
        hlo_ops(hlo, "all-reduce"))
  assert hlo_ops(hlo, "all-reduce")[0] == 1
  assert all(hlo_ops(hlo, op) == (0, 0) for op in DATA_MOVING)


# --------------------------------------------------------------------------
# 4. Per-layer norms, per-layer clipping and groups, sharded (on a 2x4 mesh:
# a stacked kernel whose layer axis is split over "data", a stacked leaf
# whose layers are whole on every device, a leaf replicated over "data",
# one replicated everywhere, and an int leaf)

LAYERED_LEAVES = {"kernel": ((8, 4, 8), P("data", None, "model")),
             "stacked": ((4, 8), P(None, "model")),
             "w": ((6, 12), P(None, "model")), "b": ((5,), P())}
LAYERED_SPECS = {name: spec for name, (_, spec) in LAYERED_LEAVES.items()} | {"step": P()}
LAYERED_AXIS = {"kernel": 0, "stacked": 0, "w": None, "b": None, "step": None}
LAYERED_UNSPLIT = {**LAYERED_AXIS, "kernel": None}  # no layer axis split
LAYERED_LABELS = {"kernel": "a", "stacked": "b", "w": "a", "b": "b", "step": "a"}


def layered_host(seed=12, scale=1.0):
  rng = np.random.default_rng(seed)
  tree = {name: np.asarray(rng.normal(size=shape) * scale, np.float32)
          for name, (shape, _) in LAYERED_LEAVES.items()}
  return {**tree, "step": np.int32(3)}


# Per order, a layer limit some of the kernel's layers are above.
PER_LAYER = {1: 25.0, 2: 5.0, math.inf: 2.2}


def layered_transforms(ord=2, **dist):
  return {
      "global": oc.clip_by_global_norm(1.0, ord=ord, leaf_norms=True,
                                       layer_axis=LAYERED_AXIS, **dist),
      "per_layer": oc.clip_by_norm(PER_LAYER[ord], ord=ord, leaf_norms=True,
                                   layer_axis=LAYERED_AXIS, **dist),
      "groups": oc.clip_by_global_norm({"a": 1.0, "b": 2.0}, ord=ord, groups=LAYERED_LABELS,
                                       leaf_norms=True, layer_axis=LAYERED_UNSPLIT, **dist),
  }


def state_specs(name, state):
  """out_specs of a state: the layer norms of the split kernel along "data"."""
  specs = jax.tree.map(lambda _: P(), state)
  if name == "groups":  # its kernel has no layer axis
    return specs
  return specs._replace(leaf_norms={**specs.leaf_norms, "kernel": P("data")})


def layered_step(txs, tree):
  return {name: tx.update(tree, tx.init(tree)) for name, tx in txs.items()}


def assert_same_results(got, want, rtol=2e-6):
  for name in want:
    jax.tree.map(lambda g, w, name=name: np.testing.assert_allclose(
        np.asarray(g), np.asarray(w), rtol=rtol, err_msg=name), got[name], want[name])


@pytest.mark.parametrize("ord", [1, 2, math.inf])
def test_shard_map_layer_norms_and_clipping_equal_the_unsharded(ord):
  host = layered_host()
  want = layered_step(layered_transforms(ord), jax.tree.map(jnp.asarray, host))
  txs = layered_transforms(ord, axis_name=AXES, specs=LAYERED_SPECS)
  mesh = make_mesh((2, 4), AXES)
  out_specs = {name: (LAYERED_SPECS, state_specs(name, want[name][1])) for name in txs}
  step = jax.jit(shard_map(functools.partial(layered_step, txs), mesh=mesh,
                           in_specs=(LAYERED_SPECS,), out_specs=out_specs))
  got = step(shard(host, mesh, LAYERED_SPECS))
  assert_same_results(got, want)
  # And against numpy: each layer of the split kernel, each clipped by its own.
  np.testing.assert_allclose(got["global"][1].leaf_norms["kernel"],
                             np_leaf_norm(host["kernel"], ord, 0), rtol=2e-6)
  factors = np_factor(np_leaf_norm(host["kernel"], ord, 0), PER_LAYER[ord])
  assert 0 < factors.min() < factors.max() == 1
  np.testing.assert_allclose(got["per_layer"][0]["kernel"],
                             f64(host["kernel"]) * factors[:, None, None], rtol=2e-6)


def hlo_all_reduces(tx, host):
  mesh = make_mesh((2, 4), AXES)
  tree = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      np.shape(x), x.dtype, sharding=NamedSharding(mesh, s)), host, LAYERED_SPECS)
  f = shard_map(lambda t: tx.update(t, tx.init(t))[1], mesh=mesh,
                in_specs=(LAYERED_SPECS,), out_specs=P(), check_vma=False)
  return hlo_ops(jax.jit(f).lower(tree).compile().as_text(), "all-reduce")


@pytest.mark.parametrize("layer_axis", ["unsplit", "split"])
@pytest.mark.parametrize("name", ["leaf_norms", "clip_by_norm", "groups", "block_rms",
                                  "agc"])
def test_one_all_reduce_with_or_without_split_layer_axes(name, layer_axis):
  # A layer axis split over the mesh too: each device writes its layers at
  # their place among all devices' layers, so one all-reduce still does.
  axes = {"unsplit": LAYERED_UNSPLIT, "split": LAYERED_AXIS}[layer_axis]
  dist = dict(axis_name=AXES, specs=LAYERED_SPECS, layer_axis=axes)
  tx = {"leaf_norms": lambda: oc.clip_by_global_norm(1.0, leaf_norms=True, **dist),
        "clip_by_norm": lambda: oc.clip_by_norm(1.0, leaf_norms=True, **dist),
        "groups": lambda: oc.clip_by_global_norm(1.0, groups=LAYERED_LABELS, leaf_norms=True,
                                                 **dist),
        "block_rms": lambda: oc.clip_by_block_rms(0.1, **dist),
        "agc": lambda: with_params(oc.adaptive_grad_clip(0.01, **dist))}[name]()
  main, _ = hlo_all_reduces(tx, layered_host())
  assert main == 1, f"{name}: {main} all-reduces on the main path"


def with_params(tx):
  """``tx`` with the gradients as its params too (AGC needs params)."""
  return optax.GradientTransformation(
      tx.init, lambda updates, state, params=None: tx.update(updates, state, updates))


def test_groups_with_a_split_layer_axis_equal_the_unsharded():
  host = layered_host(seed=15)
  labels = {**LAYERED_LABELS, "kernel": "b"}  # the split kernel shares a group
  make = lambda **kw: oc.clip_by_global_norm(  # noqa: E731
      {"a": 1.0, "b": 2.0}, groups=labels, leaf_norms=True, layer_axis=LAYERED_AXIS,
      **kw)
  want = layered_step({"groups": make()}, jax.tree.map(jnp.asarray, host))
  tx = make(axis_name=AXES, specs=LAYERED_SPECS)
  mesh = make_mesh((2, 4), AXES)
  specs = state_specs("global", jax.tree.map(lambda _: P(), want["groups"][1]))
  step = jax.jit(shard_map(functools.partial(layered_step, {"groups": tx}), mesh=mesh,
                           in_specs=(LAYERED_SPECS,), out_specs={"groups": (LAYERED_SPECS, specs)}))
  got = step(shard(host, mesh, LAYERED_SPECS))
  assert_same_results(got, want)
  # Group "b" by hand: the kernel's and the others' norms together.
  members = [host[k] for k, label in labels.items() if label == "b" and k != "step"]
  norm = np.sqrt(sum(np.sum(f64(x) ** 2) for x in members))
  np.testing.assert_allclose(got["groups"][1].groups["b"].norm, norm, rtol=2e-6)


def layer_clippers():
  """Every per-layer clipper on the split-kernel tree (AGC's params: the
  gradients; its kernel units are split over both mesh axes)."""
  return {"agc": with_params(oc.adaptive_grad_clip(0.01, layer_axis=LAYERED_AXIS)),
          "block_rms": oc.clip_by_block_rms(0.1, layer_axis=LAYERED_AXIS),
          "adagc": oc.adagc(layer_axis=LAYERED_AXIS)}


@functools.cache
def sharded_jit_case():
  """(host tree, transforms, their results on the unsharded tree): the
  reference, compiled for one device, run once for both axis types."""
  host = layered_host(seed=13)
  txs = {**layered_transforms(), **layer_clippers()}
  return host, txs, jax.jit(functools.partial(layered_step, txs))(
      jax.tree.map(jnp.asarray, host))


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_sharded_jit_equals_the_unsharded(axis_type):
  host, txs, want = sharded_jit_case()
  mesh = make_mesh((2, 4), AXES, axis_type)
  tree = shard(host, mesh, LAYERED_SPECS)
  got = jax.jit(functools.partial(layered_step, txs))(tree)
  assert_same_results(got, want)
  # The updates keep their input's layout: on an Auto mesh, XLA would give
  # the unsplit `stacked` the split kernel's layout along "data" through a
  # vector of factors the two share, were each leaf's factors not whole.
  for name in txs:
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(got[name][0])):
      assert y.sharding.is_equivalent_to(x.sharding, x.ndim), name


@functools.cache
def vmap_case():
  """(host batch of trees, the batched step, its results on the unsharded
  batch): the reference, compiled for one device, run once for both axis
  types."""
  hosts = [layered_host(seed=s) for s in (16, 17, 18)]
  host = {k: np.stack([h[k] for h in hosts]) for k in hosts[0]}
  txs = {"global": oc.clip_by_global_norm(1.0), **layered_transforms(), **layer_clippers()}
  step = lambda t: {name: tx.update(t, tx.init(t), t)[0]  # noqa: E731
                    for name, tx in txs.items()}
  return host, step, jax.jit(jax.vmap(step))(jax.tree.map(jnp.asarray, host))


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_vmap_over_trees_sharded_on_a_mesh(axis_type):
  # A batch of split-kernel trees (the batch axis first, whole): each
  # tree's decision to rescue is one for the batch, so no select runs over
  # the split leaves (which an Explicit mesh refuses).
  host, step, want = vmap_case()
  mesh = make_mesh((2, 4), AXES, axis_type)
  specs = {k: P(None, *spec) for k, spec in LAYERED_SPECS.items()}
  tree = shard(host, mesh, specs)
  got = jax.jit(jax.vmap(step))(tree)
  for name in want:
    jax.tree.map(lambda g, w, name=name: np.testing.assert_allclose(
        g, w, rtol=2e-6, err_msg=name), got[name], want[name])
    for k in host:
      assert got[name][k].sharding.is_equivalent_to(tree[k].sharding, host[k].ndim), (
          name, k)


# --------------------------------------------------------------------------
# Documentation snippets

PAGE = (pathlib.Path(__file__).parent.parent / "docs" / "distributed.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE, re.S)


def test_distributed_docs_have_python_blocks():
  """The page shows sharded jit, shard_map with specs, and the pmean trap
  (its blocks run, with their asserts, on 1 and 8 devices in test_docs)."""
  assert "axis_name" in PAGE and "pmean" in PAGE
  assert len(BLOCKS) >= 3


# --------------------------------------------------------------------------
# Sharded jit: the all-reduces docs/distributed.md states (issue 20)

ALL_REDUCE_LAYOUTS = {
    # name: (specs cycled over the leaves, all-reduces the page promises)
    "fsdp over data": ([("data",)], 1),
    "every leaf over both, one dimension": ([(("data", "model"),)], 1),
    "data and model on two dimensions": ([("data", "model")], 2),
    "some over data, some over model": ([("data",), (None, "model")], 2),
    "data, model, and both": ([("data",), (None, "model"), (), ("model",),
                               (("data", "model"),), ("data", "model")], 3),
}


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ALL_REDUCE_LAYOUTS)
def test_sharded_jit_all_reduces_are_the_documented_count(layout, axis_type):
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[axis_type]
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
  pool, expected = ALL_REDUCE_LAYOUTS[layout]
  tree = [jax.ShapeDtypeStruct((8, 8), jnp.float32,
                               sharding=NamedSharding(mesh, P(*pool[i % len(pool)])))
          for i in range(12)]
  with jax.set_mesh(mesh):
    hlo = jax.jit(lambda t: F.clip_by_global_norm(t, 1.0)).lower(tree).compile().as_text()
  assert hlo_ops(hlo, "all-reduce")[0] == expected
