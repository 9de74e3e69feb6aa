"""per_example_clip_by_global_norm and per_example_clip_by_layer_norm
(``optaxclip.functional``): optax's numbers, per-example norms against
float64 numpy (random trees too), ``layer_axis``, jit/vmap, dtypes, an inf
threshold, shard_map and sharded jit.

Of the shared contract, the items about transform states (state types,
checkpoints, optax.chain / MultiSteps / inject_hyperparams) do not apply:
these are stateless functions. Dtypes, ShapeDtypeStruct inputs and eager ==
jit are tested here; bad arguments are rows of test_errors.py.
"""

import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FLOAT_DTYPES
from fuzzing import BF16, F16, F32, cast, fuzz_settings
from helpers import hlo_ops, np_norm
from hypothesis import given
from hypothesis import strategies as st
from jax import lax, shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import optaxclip as oc

F = oc.functional
PerExampleClip = F.PerExampleClip
per_example_clip_by_global_norm = F.per_example_clip_by_global_norm
per_example_clip_by_layer_norm = F.per_example_clip_by_layer_norm

BATCH = 16


def make_tree(name, dtype=jnp.float32):
  rng = np.random.default_rng(0)
  # Per-example magnitudes from 0 to 10: some examples clipped, some not.
  scales = np.concatenate([[0.0], np.geomspace(1e-2, 10, BATCH - 1)])
  rng.shuffle(scales)

  def leaf(*shape):
    x = rng.normal(size=(BATCH, *shape))
    return x * scales.reshape((-1,) + (1,) * len(shape))

  trees = {
      "one_leaf": lambda: [leaf(3)],
      "nested": lambda: {"dense": {"w": leaf(4, 3), "b": leaf(3)},
                         "out": [leaf(5), leaf()]},
      "tuple": lambda: (leaf(2, 2, 2), leaf(7)),
  }
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), trees[name]())


TREES = ["one_leaf", "nested", "tuple"]
CLIPS = [0.0, 0.7, math.inf]
# Jitted once for the module, with a traced threshold: one compilation per
# tree (and per `uniform`).
OURS_GLOBAL = jax.jit(per_example_clip_by_global_norm)
OURS_LAYER = jax.jit(per_example_clip_by_layer_norm, static_argnames="uniform")
OPTAX_GLOBAL = jax.jit(optax.per_example_global_norm_clip)
OPTAX_LAYER = jax.jit(optax.per_example_layer_norm_clip, static_argnames="uniform")


def assert_close(ours, theirs, rtol=1e-6):
  """Leaf by leaf within ``rtol`` (of the leaf's largest value); prints the
  largest relative difference."""
  worst = 0.0
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.maximum(np.abs(b), np.max(np.abs(b), initial=0))
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.max(scale, initial=0))
    worst = max(worst, float(np.max(np.abs(a - b) / np.maximum(scale, 1e-30), initial=0)))
  print(f" [vs optax: {worst:.1e}]", end="")


@pytest.mark.parametrize("max_norm", CLIPS)
@pytest.mark.parametrize("name", TREES)
def test_global_norm_matches_optax(name, max_norm):
  grads = make_tree(name)
  ours = OURS_GLOBAL(grads, jnp.float32(max_norm))
  assert isinstance(ours, PerExampleClip)
  summed, num_clipped = OPTAX_GLOBAL(grads, jnp.float32(max_norm))
  assert_close(ours.summed, summed)
  assert ours.num_clipped.dtype == jnp.int32 and int(ours.num_clipped) == int(num_clipped)
  # Swapping from optax: the first two fields are optax's pair.
  assert jax.tree.structure(ours[:2]) == jax.tree.structure((summed, num_clipped))


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("max_norm", CLIPS)
@pytest.mark.parametrize("name", TREES)
def test_layer_norm_matches_optax(name, max_norm, uniform):
  grads = make_tree(name)
  ours = OURS_LAYER(grads, jnp.float32(max_norm), uniform=uniform)
  summed, num_clipped = OPTAX_LAYER(grads, jnp.float32(max_norm), uniform=uniform)
  assert_close(ours.summed, summed)
  assert jax.tree.structure(ours.num_clipped) == jax.tree.structure(num_clipped)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), ours.num_clipped,
               num_clipped)


@pytest.mark.parametrize("name", TREES)
def test_per_example_norms_match_numpy_float64(name):
  grads = make_tree(name)
  host = [np.asarray(x, np.float64).reshape(BATCH, -1) for x in jax.tree.leaves(grads)]
  result = OURS_GLOBAL(grads, jnp.float32(1.0))
  expected = np.sqrt(sum((x**2).sum(1) for x in host))
  assert result.norms.dtype == jnp.float32 and result.norms.shape == (BATCH,)
  worst = np.max(np.abs(result.norms - expected) / np.maximum(expected, 1e-30))
  layer = OURS_LAYER(grads, jnp.float32(1.0))
  for ours, x in zip(jax.tree.leaves(layer.norms), host):
    leaf = np.sqrt((x**2).sum(1))
    worst = max(worst, np.max(np.abs(ours - leaf) / np.maximum(leaf, 1e-30)))
  print(f"\nper-example norms ({name}) vs numpy float64: largest relative "
        f"difference {worst:.1e}")
  assert worst < 1e-6


def test_nan_example_is_not_clipped_as_in_optax():
  grads = make_tree("tuple")
  grads = (grads[0].at[3, 0, 0, 0].set(jnp.nan), grads[1])
  ours = OURS_GLOBAL(grads, jnp.float32(0.5))
  summed, num_clipped = OPTAX_GLOBAL(grads, jnp.float32(0.5))
  assert np.isnan(ours.norms[3]) and int(ours.num_clipped) == int(num_clipped)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-6, atol=1e-6 * np.nanmax(np.abs(b)), equal_nan=True),
      ours.summed, summed)


def test_overflow_safe_norms():
  """Squares of 1e20 overflow float32: optax's norm is inf (factor 0), ours is
  right and the example is clipped to max_norm."""
  grads = {"w": jnp.zeros((2, 4)).at[0].set(1e20).at[1].set(1.0)}
  result = per_example_clip_by_global_norm(grads, 1.0)
  np.testing.assert_allclose(result.norms, [2e20, 2.0], rtol=1e-6)
  np.testing.assert_allclose(result.summed["w"], [1.0] * 4, rtol=1e-6)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_dtype_preserved_and_accumulated_in_float32(dtype):
  grads = make_tree("nested", dtype)
  exact = OURS_GLOBAL(jax.tree.map(lambda x: x.astype(jnp.float32), grads),
                      jnp.float32(2.0))
  result = OURS_GLOBAL(grads, jnp.float32(2.0))  # eager == jit: tested below
  assert all(x.dtype == dtype for x in jax.tree.leaves(result.summed))
  assert result.norms.dtype == jnp.float32
  np.testing.assert_allclose(result.norms, exact.norms, rtol=1e-6)
  # Summed in float32, rounded once into the leaf dtype.
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(dtype)),
               result.summed, exact.summed)
  layer = OURS_LAYER(grads, jnp.float32(2.0))
  assert all(x.dtype == dtype for x in jax.tree.leaves(layer.summed))


def test_finite_at_zero_and_differentiable_there():
  zeros = jax.tree.map(jnp.zeros_like, make_tree("nested"))
  for fn in (per_example_clip_by_global_norm, per_example_clip_by_layer_norm):
    grad_fn = jax.jit(jax.value_and_grad(lambda g, c: sum(
        jnp.sum(x) for x in jax.tree.leaves(fn(g, c).summed))))
    for max_norm in (0.0, 1.0):
      result = jax.jit(fn)(zeros, jnp.float32(max_norm))
      assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(result.summed))
      assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(result.num_clipped))
      _, grad = grad_fn(zeros, jnp.float32(max_norm))
      assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(grad))


def test_eager_equals_jit_and_accepts_shape_dtype_structs():
  grads = make_tree("nested")
  for fn in (per_example_clip_by_global_norm, per_example_clip_by_layer_norm):
    eager, jitted = fn(grads, 0.5), jax.jit(fn)(grads, 0.5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), eager, jitted)
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), grads)
    shapes = jax.eval_shape(fn, specs, 0.5)
    assert jax.tree.map(lambda s: s.shape, shapes.summed) == \
        jax.tree.map(lambda x: x.shape[1:], grads)


def test_under_vmap_over_microbatches():
  """vmap over a leading microbatch axis equals a loop over the microbatches,
  with a traced (per-microbatch) threshold too."""
  grads = make_tree("nested")
  stacked = jax.tree.map(lambda x: jnp.stack([x, 2 * x, -x]), grads)
  clips = jnp.array([0.5, 1.0, 2.0])
  for fn, jitted in ((per_example_clip_by_global_norm, OURS_GLOBAL),
                     (per_example_clip_by_layer_norm, OURS_LAYER)):
    batched = jax.jit(jax.vmap(fn))(stacked, clips)
    for i in range(3):
      one = jitted(jax.tree.map(lambda x: x[i], stacked), clips[i])
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a[i], b, rtol=1e-6),
                   batched, one)


def test_shard_map_with_split_features():
  """Leaves split over their feature axis on 2 devices: norms are global."""
  grads = make_tree("tuple")
  grads = (grads[0].reshape(BATCH, 8), grads[1][:, :6])
  specs = (P(None, "i"), P(None, "i"))
  mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
  fn = jax.jit(shard_map(
      lambda g: per_example_clip_by_global_norm(g, 0.5, axis_name="i", specs=specs),
      mesh=mesh, in_specs=(specs,),
      out_specs=PerExampleClip((P("i"), P("i")), P(), P())))
  result, expected = fn(grads), per_example_clip_by_global_norm(grads, 0.5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), result, expected)


# --------------------------------------------------------------------------
# layer_axis (issue 13 section 2): each example's layer slice on its own, as
# optax clips the unstacked layers.

def stacked_tree(dtype=jnp.float32):
  rng = np.random.default_rng(3)
  scales = np.concatenate([[0.0], np.geomspace(1e-2, 10, BATCH - 1)])
  rng.shuffle(scales)
  def leaf(*shape):  # one example's shape; each layer its own scale too
    x = rng.normal(size=(BATCH, *shape)) * scales.reshape((-1,) + (1,) * len(shape))
    return jnp.asarray(x, dtype)
  return {"kernel": leaf(3, 4, 5), "bias": leaf(3, 5), "mid": leaf(2, 4, 6),
          "plain": leaf(7)}


STACKED_AXES = {"kernel": 0, "bias": 0, "mid": 2, "plain": None}


def unstack(tree):
  """The layers as a flat list, in (leaf, layer) order, for optax."""
  out = []
  for k, x in tree.items():
    axis = STACKED_AXES[k]
    out.extend([x] if axis is None else
               [jnp.take(x, i, axis=1 + axis) for i in range(x.shape[1 + axis])])
  return out


def restack(tree, flat, scalars=False):
  """optax's per-layer results in ``tree``'s leaves (stacked on the layer
  axis, or for scalars into a vector)."""
  out, it = {}, iter(flat)
  for k, x in tree.items():
    axis = STACKED_AXES[k]
    out[k] = next(it) if axis is None else jnp.stack(
        [next(it) for _ in range(x.shape[1 + axis])], axis=0 if scalars else axis)
  return out


OURS_STACKED = jax.jit(per_example_clip_by_layer_norm,
                       static_argnames=("uniform", "layer_axis"))


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("max_norm", CLIPS)
def test_layer_axis_matches_optax_on_unstacked_layers(max_norm, uniform):
  grads = stacked_tree()
  layer_axis = STACKED_AXES
  ours = per_example_clip_by_layer_norm(grads, jnp.float32(max_norm), uniform=uniform,
                                        layer_axis=layer_axis)
  summed, num_clipped = OPTAX_LAYER(unstack(grads), jnp.float32(max_norm), uniform=uniform)
  assert_close(ours.summed, restack(grads, summed))
  counts = restack(grads, num_clipped, scalars=True)
  for k in grads:
    np.testing.assert_array_equal(ours.num_clipped[k], counts[k])
    assert ours.num_clipped[k].dtype == jnp.int32
  # norms: [batch, layers] per stacked leaf, numpy float64
  for k, x in grads.items():
    axis, host = STACKED_AXES[k], np.asarray(x, np.float64)
    if axis is None:
      want = np.sqrt((host.reshape(BATCH, -1) ** 2).sum(1))
    else:
      layers = np.moveaxis(host, 1 + axis, 1).reshape(BATCH, host.shape[1 + axis], -1)
      want = np.sqrt((layers ** 2).sum(2))
    np.testing.assert_allclose(ours.norms[k], want, rtol=1e-6, atol=1e-30)


def test_layer_axis_eager_jit_and_vmap():
  grads = stacked_tree()
  eager = per_example_clip_by_layer_norm(grads, 0.5, layer_axis=STACKED_AXES)
  jitted = jax.jit(lambda g: per_example_clip_by_layer_norm(
      g, 0.5, layer_axis=STACKED_AXES))(grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), eager, jitted)
  stacked = jax.tree.map(lambda x: jnp.stack([x, 3 * x]), grads)
  batched = jax.jit(jax.vmap(lambda g: per_example_clip_by_layer_norm(
      g, 0.5, layer_axis=STACKED_AXES)))(stacked)
  for i in range(2):
    one = per_example_clip_by_layer_norm(jax.tree.map(lambda x: x[i], stacked), 0.5,
                                         layer_axis=STACKED_AXES)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a[i], b, rtol=1e-6), batched, one)


@pytest.mark.parametrize("split", ["layers", "features"])
def test_layer_axis_shard_map_equals_unsharded(split):
  grads = {"k": stacked_tree()["kernel"].reshape(BATCH, 3, 20)[:, :2],  # [B, 2, 20]
           "b": stacked_tree()["plain"][:, :6]}
  specs = {"layers": {"k": P(None, "i"), "b": P(None, "i")},
           "features": {"k": P(None, None, "i"), "b": P(None, "i")}}[split]
  mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
  layer_axis = {"k": 0, "b": None}
  summed_specs = {k: P(*spec[1:]) for k, spec in specs.items()}  # no batch axis
  out_specs = PerExampleClip(summed_specs,
                             {"k": P("i") if split == "layers" else P(), "b": P()},
                             {"k": P(None, "i") if split == "layers" else P(), "b": P()})
  fn = jax.jit(shard_map(
      lambda g: per_example_clip_by_layer_norm(g, 0.5, axis_name="i", specs=specs,
                                               layer_axis=layer_axis),
      mesh=mesh, in_specs=(specs,), out_specs=out_specs))
  result = fn(grads)
  expected = per_example_clip_by_layer_norm(grads, 0.5, layer_axis=layer_axis)
  # Sums in another order across the two devices: within a few ulps.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               result, expected)


def test_layer_sizes_are_the_whole_leaves_under_shard_map():
  # uniform=False splits max_norm by each leaf's share of the parameters:
  # those of the whole leaves, not of one device's shards (a leaf split
  # over 2 devices once counted half its size against a replicated one).
  grads = {"split": make_tree("tuple")[1][:, :6], "whole": make_tree("one_leaf")[0]}
  specs = {"split": P(None, "i"), "whole": P()}
  mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
  fn = jax.jit(shard_map(
      lambda g: per_example_clip_by_layer_norm(g, 0.5, uniform=False, axis_name="i",
                                               specs=specs),
      mesh=mesh, in_specs=(specs,),
      out_specs=PerExampleClip({"split": P("i"), "whole": P()}, P(), P())))
  result = fn(grads)
  summed, num_clipped = OPTAX_LAYER(grads, jnp.float32(0.5), uniform=False)
  assert_close(result.summed, summed)
  jax.tree.map(np.testing.assert_array_equal, result.num_clipped, num_clipped)


# Data-parallel DP-SGD on a 2x4 mesh: the batch split over "data", a stacked
# kernel's 4 layers over "model". The batch is one more axis the norms keep.
DP_AXES = ("data", "model")
DP_SPECS = {"k": P("data", "model"), "b": P("data")}
DP_LAYER_AXIS = {"k": 0, "b": None}
DP_FUNCTIONS = {
    "global": lambda g, **kw: per_example_clip_by_global_norm(g, 0.5, **kw),
    "layer": lambda g, **kw: per_example_clip_by_layer_norm(g, 0.5, **kw),
    "layer_axis": lambda g, **kw: per_example_clip_by_layer_norm(
        g, 0.5, uniform=False, layer_axis=DP_LAYER_AXIS, **kw),
}


def dp_tree():
  rng = np.random.default_rng(7)
  scales = np.geomspace(1e-2, 10, BATCH)  # some examples clipped, some not
  k = rng.normal(size=(BATCH, 4, 5, 8)) * scales[:, None, None, None]
  b = rng.normal(size=(BATCH, 6)) * scales[:, None]
  return {"k": np.asarray(k, np.float32), "b": np.asarray(b, np.float32)}


def assert_same(got, want):
  # The sums over examples may run in another order: within a few ulps.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6),
               got, want)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("name", list(DP_FUNCTIONS))
def test_sharded_jit_with_the_batch_and_layers_split(name, axis_type):
  from jax.sharding import AxisType, NamedSharding
  mesh = jax.make_mesh((2, 4), DP_AXES, axis_types=(getattr(AxisType, axis_type),) * 2)
  host = dp_tree()
  tree = {k: jax.device_put(x, NamedSharding(mesh, DP_SPECS[k])) for k, x in host.items()}
  fn = DP_FUNCTIONS[name]
  got = jax.jit(fn)(tree)
  want = fn(jax.tree.map(jnp.asarray, host))
  assert_same(got, want)
  clipped = sum(int(np.sum(n)) for n in jax.tree.leaves(want.num_clipped))
  assert 0 < clipped < BATCH * 5
  # Each device sums its own part: the sums keep their leaf's layout.
  for k, spec in DP_SPECS.items():
    assert got.summed[k].sharding.is_equivalent_to(
        NamedSharding(mesh, P(*spec[1:])), host[k].ndim - 1), (k, got.summed[k].sharding)


@pytest.mark.parametrize("name", list(DP_FUNCTIONS))
def test_shard_map_with_the_batch_split(name):
  # Each device clips its own examples (their norms over "model" too) and
  # the user sums the devices' sums, as a data-parallel step does.
  from jax.sharding import NamedSharding
  mesh = jax.make_mesh((2, 4), DP_AXES)
  host = dp_tree()
  fn = DP_FUNCTIONS[name]
  want = fn(jax.tree.map(jnp.asarray, host))

  def local(g):
    summed, num_clipped, norms = fn(g, axis_name=DP_AXES, specs=DP_SPECS)
    return PerExampleClip(lax.psum(summed, "data"), lax.psum(num_clipped, "data"), norms)

  per_leaf = name != "global"
  layered = name == "layer_axis"
  out_specs = PerExampleClip({k: P(*s[1:]) for k, s in DP_SPECS.items()},
               {"k": P("model") if layered else P(), "b": P()} if per_leaf else P(),
               {"k": P("data", "model") if layered else P("data"), "b": P("data")}
               if per_leaf else P("data"))
  step = jax.jit(shard_map(local, mesh=mesh, in_specs=(DP_SPECS,), out_specs=out_specs))
  got = step({k: jax.device_put(x, NamedSharding(mesh, DP_SPECS[k]))
              for k, x in host.items()})
  assert_same(got, want)


@pytest.mark.parametrize("name", list(DP_FUNCTIONS))
def test_one_all_reduce_with_the_batch_split(name):
  # Every example's partial sums, of every leaf, travel in one vector.
  mesh = jax.make_mesh((2, 4), DP_AXES)
  fn = DP_FUNCTIONS[name]
  f = shard_map(lambda g: fn(g, axis_name=DP_AXES, specs=DP_SPECS).norms, mesh=mesh,
                in_specs=(DP_SPECS,), out_specs=P(), check_vma=False)
  from jax.sharding import NamedSharding
  structs = {k: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=NamedSharding(mesh, DP_SPECS[k]))
             for k, x in dp_tree().items()}
  main, _ = hlo_ops(jax.jit(f).lower(structs).compile().as_text(), "all-reduce")
  assert main == 1, f"{name}: {main} all-reduces on the main path"


def test_global_norms_of_many_leaves_of_two_dtypes(monkeypatch):
  # Each example's entries of all leaves side by side, per dtype and in
  # groups of leaves (made small, so that the tree compiles fast: 4 of
  # each dtype): the same norms as the whole rows in float64.
  monkeypatch.setattr(oc._core._batching, "GROUP_SIZE", 16)
  rng = np.random.default_rng(11)
  dtypes = (jnp.float32, jnp.bfloat16)
  grads = [jnp.asarray(rng.normal(size=(BATCH, 1 + i % 3)) * 10.0 ** (i % 5 - 2), dtypes[i % 2])
           for i in range(6 * 16 + 7)]
  result = jax.jit(per_example_clip_by_global_norm)(grads, 1.0)
  rows = np.concatenate([np.asarray(g, np.float64) for g in grads], axis=1)
  norms = np.linalg.norm(rows, axis=1)
  np.testing.assert_allclose(result.norms, norms, rtol=1e-6)
  factors = np.minimum(1.0, 1.0 / norms)
  for got, g in zip(result.summed, grads):  # float32 sums, rounded to the dtype
    g = np.asarray(g, np.float64)
    rtol = 1e-6 if grads[0].dtype == got.dtype else 4e-3
    np.testing.assert_allclose(got, factors @ g, rtol=rtol,
                               atol=rtol * np.max(factors @ np.abs(g)))


# --------------------------------------------------------------------------
# Subnormal entries, an inf threshold, random trees (hypothesis)

def test_subnormal_per_example_norms():
  rows = jnp.asarray([[1e-40, 1e-40], [3.0, 4.0], [0.0, 0.0]], jnp.float32)
  norms = F.per_example_clip_by_global_norm([rows], 1.0).norms
  np.testing.assert_allclose(norms, [np.sqrt(2) * np.float32(1e-40), 5, 0],
                             rtol=1e-5, atol=2.0 ** -148)


def test_per_example_inf_threshold_is_unchanged():
  # optax's per-example clip keeps an example whose factor is NaN (inf/inf):
  # its Inf reaches the sum.
  grads = [jnp.array([[3.0, 4.0], [jnp.inf, 1.0]])]
  summed, num_clipped, _ = F.per_example_clip_by_global_norm(grads, math.inf)
  reference, _ = optax.per_example_global_norm_clip(grads, math.inf)
  np.testing.assert_array_equal(summed[0], reference[0])
  assert int(num_clipped) == 0


@fuzz_settings(30)
@given(data=st.data())
def test_per_example_clipping_matches_float64(data):
  exponent = data.draw(st.sampled_from([-30, -8, 0, 5, 30]))
  shapes = [((3, 2, 2), F32), ((3, 2), BF16), ((3,), F16)]
  leaves = []
  for shape, dtype in shapes:
    unit = data.draw(hnp.arrays(np.float64, shape, elements=st.floats(-1, 1)))
    leaves.append(jnp.asarray(cast(unit * 10.0**exponent, dtype), dtype))
  tree = {"w": leaves[0], "b": leaves[1], "h": leaves[2],
          "i": jnp.arange(3), "n": None}
  max_norm = data.draw(st.one_of(st.just(0.0), st.floats(1e-3, 1e3),
                                 st.just(math.inf)))
  summed, num_clipped, norms = F.per_example_clip_by_global_norm(tree, max_norm)
  rows = [[np.asarray(x[i], np.float64) for x in leaves] for i in range(3)]
  want = np.array([np_norm(r, 2) for r in rows])
  np.testing.assert_allclose(norms, want, rtol=2e-5, atol=1e-36)
  factors = np.where(want > max_norm, max_norm / np.where(want > 0, want, 1), 1.0)
  assert int(num_clipped) == int(np.sum(factors < 1))
  for key, x in (("w", leaves[0]), ("b", leaves[1]), ("h", leaves[2])):
    info = jnp.finfo(x.dtype)
    ref = np.tensordot(factors, np.asarray(x, np.float64), axes=1)
    assert summed[key].dtype == x.dtype
    # A sum beyond the leaf dtype's range (3 x 65504 in float16) is Inf.
    representable = np.abs(ref) < float(info.max)
    got = np.asarray(summed[key], np.float64)
    assert np.all(np.isfinite(got[representable]))
    bound = np.tensordot(factors, np.abs(np.asarray(x, np.float64)), axes=1)
    np.testing.assert_allclose(
        got[representable], ref[representable],
        rtol=0, atol=float(np.max(bound, initial=0)) * 1e-2 + float(info.tiny))
  np.testing.assert_array_equal(summed["i"], tree["i"])
  layer = F.per_example_clip_by_layer_norm(tree, max_norm)
  for key, x in (("w", leaves[0]), ("b", leaves[1]), ("h", leaves[2])):
    got = np.asarray(layer.summed[key], np.float64)
    # Factors <= 1: a sum is at most the sum of |x|, and Inf only where that
    # is beyond the leaf dtype's range (3 x 65504 in float16); never NaN.
    within = np.sum(np.abs(np.asarray(x, np.float64)), axis=0) < float(jnp.finfo(x.dtype).max)
    assert not np.any(np.isnan(got)) and np.all(np.isfinite(got[within])), (key, got)


def test_per_example_norms_are_float32_or_float64_for_float64_leaves():
  grads = [jnp.ones((2, 3), jnp.bfloat16)]
  assert F.per_example_clip_by_global_norm(grads, 1.0).norms.dtype == jnp.float32
  with jax.enable_x64(True):
    grads = [jnp.ones((2, 3), jnp.float64)]
    assert F.per_example_clip_by_global_norm(grads, 1.0).norms.dtype == jnp.float64
    assert F.per_example_clip_by_layer_norm(grads, 1.0).norms[0].dtype == jnp.float64
    grads = [jnp.ones((2, 3), jnp.float32)]
    assert F.per_example_clip_by_global_norm(grads, 1.0).norms.dtype == jnp.float32
