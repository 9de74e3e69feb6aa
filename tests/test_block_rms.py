"""``clip_by_block_rms``: optax's numbers, finite where optax's are not.

Compared with live ``optax.clip_by_block_rms`` on random trees in float32,
bfloat16 and float16, and with a float64 numpy reference (``u / max(1,
rms / threshold)``) where optax's squares overflow or underflow. The
contract every transform keeps is in tests/test_contract.py, bad arguments
in tests/test_errors.py.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FLOAT_DTYPES
from helpers import hlo_ops
from jax import shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxclip as oc
from optaxclip import _core

F = oc.functional
SHAPES = [(3,), (4, 5), (2, 3, 4), (1,), (7, 1, 3), (33,), ()]
THRESHOLDS = [1e-3, 0.1, 1.0, 3.0]


def random_tree(seed, dtype=jnp.float32, shapes=SHAPES):
  """Leaves of magnitudes 1e-2 to 30, one scale per leaf."""
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s) * 10.0 ** rng.uniform(-2, 1.5), dtype)
          for s in shapes]


def exact(leaf, threshold):
  """optax's formula in float64: ``u / max(1, rms / threshold)``."""
  u = np.asarray(leaf, np.float64)
  rms = np.sqrt(np.mean(u ** 2)) if u.size else 0.0
  return u / max(1.0, rms / threshold) if rms else u


def ulps(got, want, dtype):
  """Per element, how many steps of ``dtype`` apart two arrays are."""
  def ordered(x):
    x = np.asarray(np.asarray(x, np.float64).astype(np.dtype(dtype)))
    bits = x.view(np.int32 if x.itemsize == 4 else np.int16).astype(np.int64)
    magnitude = bits & (0x7FFFFFFF if x.itemsize == 4 else 0x7FFF)
    return np.where(bits < 0, -magnitude, bits)
  return np.abs(ordered(got) - ordered(want))


# Largest difference, in steps of the leaf dtype. In float32 the two
# libraries round in different places (optax: mean, root, rms / threshold,
# u / that; here: the norm's root, threshold * sqrt(n), that / norm, u *
# that), and sum in another order: up to 4 steps apart (as for optax's
# clip_by_global_norm in tests/test_parity.py), each at most 4 from the
# exact value. Half-precision leaves are rounded once here (the factor is
# float32), where optax computes the RMS and divides in the leaf's
# precision (up to 8 steps from the exact value in float16).
F32_APART, F32_FROM_EXACT, HALF_FROM_EXACT = 4, 4, 1


@jax.jit
def optax_and_ours(tree, threshold):
  """optax's result, ours (functional) and ours (transform), one compile
  per tree structure and dtype: the threshold is traced."""
  reference, _ = optax.clip_by_block_rms(threshold).update(tree, None)
  tx = oc.clip_by_block_rms(threshold)
  updates, _ = tx.update(tree, tx.init(tree))
  return reference, F.clip_by_block_rms(tree, threshold), updates


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_same_numbers_as_optax(dtype):
  for seed in range(6):
    tree = random_tree(seed, dtype)
    for threshold in THRESHOLDS:
      reference, functional, updates = optax_and_ours(tree, threshold)
      for x, ref, got, upd in zip(tree, reference, functional, updates):
        assert got.dtype == upd.dtype == x.dtype
        np.testing.assert_array_equal(got, upd)
        want = exact(x, threshold)
        if dtype == jnp.float32:
          assert ulps(got, ref, dtype).max(initial=0) <= F32_APART, (seed, threshold)
          assert ulps(got, want, dtype).max(initial=0) <= F32_FROM_EXACT
        else:  # never further from the exact value than optax, by a rounding
          assert ulps(got, want, dtype).max(initial=0) <= HALF_FROM_EXACT
          assert (ulps(got, want, dtype) <= ulps(ref, want, dtype) + 1).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_eager_equals_jit_and_optax_eager(dtype):
  tree = random_tree(9, dtype)
  reference, _ = optax.clip_by_block_rms(0.1).update(tree, None)
  jitted = optax_and_ours(tree, 0.1)[1]
  for x, ref, got, jit in zip(tree, reference, F.clip_by_block_rms(tree, 0.1), jitted):
    np.testing.assert_array_equal(got, jit)
    want = exact(x, 0.1)
    if dtype == jnp.float32:
      assert ulps(got, ref, dtype).max(initial=0) <= F32_APART
    else:
      assert ulps(got, want, dtype).max(initial=0) <= HALF_FROM_EXACT


@pytest.mark.parametrize("dtype,scale", [
    (jnp.float32, 1e20),  # squares overflow float32: optax's update is 0
    (jnp.float32, 1e37),
    (jnp.bfloat16, 1e30),  # bf16 squares overflow
    (jnp.float16, 300.0),  # fp16 squares overflow above 256
    (jnp.float32, 1e-25),  # squares underflow: optax never clips
])
def test_right_where_optax_overflows_or_underflows(dtype, scale):
  tree = random_tree(7, dtype, shapes=[(4, 5), (16,)])
  tree = [(x.astype(jnp.float32) / jnp.max(jnp.abs(x.astype(jnp.float32)))
           * scale).astype(dtype) for x in tree]
  threshold = scale / 10
  reference, _ = optax.clip_by_block_rms(threshold).update(tree, None)
  got = F.clip_by_block_rms(tree, threshold)
  for x, ref, g in zip(tree, reference, got):
    want = exact(x, threshold)
    # optax's is off (zeros, or not clipped)
    assert not np.allclose(np.asarray(ref, np.float64), want, rtol=1e-2, atol=0)
    assert ulps(g, want, dtype).max() <= (F32_FROM_EXACT if dtype == jnp.float32
                                          else HALF_FROM_EXACT)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("threshold", [1e38, 3e38, math.inf])
def test_rms_right_where_the_norm_itself_overflows(dtype, threshold):
  # Entries near the largest float: the 2-norm (~6e38) is beyond float32,
  # the RMS (~3e38) is not. No NaN (inf / inf) and no zeros (threshold / inf).
  top = float(jnp.finfo(dtype).max)
  tree = [jnp.asarray([0.9 * top, -0.95 * top, 0.8 * top, top], dtype),
          jnp.ones(3, dtype), jnp.asarray([0.5 * top, 1.0], dtype)]
  for clip in (F.clip_by_block_rms, jax.jit(F.clip_by_block_rms)):
    got = clip(tree, threshold)
    for x, g in zip(tree, got):
      assert ulps(g, exact(x, threshold), dtype).max() <= (
          F32_FROM_EXACT if dtype == jnp.float32 else HALF_FROM_EXACT)
  tx = oc.clip_by_block_rms(threshold)
  _, state = jax.jit(tx.update)(tree, tx.init(tree))
  rms = max(np.sqrt(np.mean(np.asarray(x, np.float64) ** 2)) for x in tree)
  np.testing.assert_allclose(state.rms, rms, rtol=1e-6 if dtype == jnp.float32 else 1e-2)
  assert state.nonfinite_count == 0


def test_zero_leaves_and_zero_threshold_stay_finite():
  zeros = [jnp.zeros(3), jnp.zeros((2, 2), jnp.bfloat16)]
  reference, _ = optax.clip_by_block_rms(0.0).update(zeros, None)
  assert np.isnan(np.asarray(reference[0])).all()  # optax: 0 / 0
  tx = oc.clip_by_block_rms(0.0)
  updates, state = tx.update(zeros, tx.init(zeros))
  jax.tree.map(np.testing.assert_array_equal, updates, zeros)
  assert state.rms == 0 and state.scale == 1 and state.clipped_count == 0
  clipped = F.clip_by_block_rms(random_tree(0), 0.0)
  assert all((np.asarray(x) == 0).all() for x in clipped)


def test_empty_and_non_clippable_leaves():
  tree = {"w": jnp.full((2, 2), 4.0), "empty": jnp.zeros((0, 3)),
          "step": jnp.array(3, jnp.int32), "none": None,
          "masked": optax.MaskedNode()}
  tx = oc.clip_by_block_rms(1.0)
  updates, state = tx.update(tree, tx.init(tree))
  np.testing.assert_array_equal(updates["w"], np.ones((2, 2)))
  assert updates["empty"].shape == (0, 3)
  assert updates["step"] is tree["step"] and updates["none"] is None
  assert isinstance(updates["masked"], optax.MaskedNode)
  assert state.rms == 4.0 and state.scale == 0.25


def test_state_logs_the_largest_rms_and_the_smallest_factor():
  tree = random_tree(3)
  threshold = 0.5
  rms = [np.sqrt(np.mean(np.asarray(x, np.float64) ** 2)) for x in tree]
  tx = oc.clip_by_block_rms(threshold)
  state = tx.init(tree)
  for step in range(1, 3):
    _, state = jax.jit(tx.update)(tree, state)
    np.testing.assert_allclose(state.rms, max(rms), rtol=1e-6)
    np.testing.assert_allclose(state.scale, min(1, threshold / max(rms)), rtol=1e-6)
    assert (state.count, state.clipped_count, state.nonfinite_count) == (step, step, 0)
  assert sorted(oc.stats(state)) == [f"block_rms/{k}" for k in (
      "clip_rate", "clipped_count", "count", "nonfinite_count", "rms", "scale")]


def test_nan_leaf_is_counted_and_stays_in_its_leaf():
  tree = [jnp.array([1.0, jnp.nan]), jnp.array([30.0, 40.0])]
  tx = oc.clip_by_block_rms(1.0)
  updates, state = tx.update(tree, tx.init(tree))
  assert np.isnan(np.asarray(updates[0])).all()
  np.testing.assert_allclose(updates[1], np.array([0.6, 0.8]) * np.sqrt(2), rtol=1e-6)
  assert np.isnan(state.rms) and state.nonfinite_count == 1


def test_traced_threshold_is_clamped():
  tree = random_tree(1)
  clip = jax.jit(lambda t: F.clip_by_block_rms(tree, t))
  assert all((np.asarray(x) == 0).all() for x in clip(-1.0))
  assert all((np.asarray(x) == 0).all() for x in clip(math.nan))
  jax.tree.map(np.testing.assert_array_equal, clip(math.inf), tree)


def test_under_vmap_each_example_on_its_own():
  batch = jnp.asarray(np.random.default_rng(2).normal(size=(5, 4, 3)) *
                      np.array([0.1, 1, 3, 10, 100])[:, None, None], jnp.float32)
  got = jax.vmap(lambda g: F.clip_by_block_rms([g], 1.0)[0])(batch)
  for example, clipped in zip(batch, got):
    np.testing.assert_array_equal(clipped, F.clip_by_block_rms([example], 1.0)[0])


def test_the_core_gives_each_block_its_rms():
  # The view the clipper asks the core for: norm / sqrt(size) per block,
  # 0 for an empty block, and finite where the block's norm overflows.
  tree = [jnp.zeros((0, 3)), jnp.full((4,), 1.0), jnp.full((9,), 10.0),
          jnp.full((4,), 3e38), jnp.array([jnp.inf, 1.0])]
  measured = _core.measure("t", tree, 2, _core.HERE, _core.PER_LEAF, rms=True)
  np.testing.assert_allclose(measured.units, [0, 1, 10, 3e38, np.inf], rtol=1e-6)


def test_gradients_are_finite_at_zero():
  def loss(x):
    return jnp.sum(F.clip_by_block_rms([x], 1.0)[0])
  assert np.isfinite(jax.grad(loss)(jnp.zeros(4))).all()


# --------------------------------------------------------------------------
# distributed: each leaf's RMS is the whole leaf's

AXES = ("data", "model")
LEAVES = {  # shape, spec on a 2x4 mesh
    "both": ((8, 12), P("data", "model")),
    "model_only": ((6, 16), P(None, "model")),  # replicated over data
    "data_only": ((10, 4), P("data")),  # replicated over model
    "replicated": ((5,), P()),
    "flat": ((24,), P(AXES)),
}


def host_tree(scale):
  rng = np.random.default_rng(11)
  return {k: (rng.normal(size=shape) * scale * (1 + i)).astype(np.float32)
          for i, (k, (shape, _)) in enumerate(LEAVES.items())}


@pytest.mark.parametrize("scale", [1.0, 1e20], ids=["ordinary", "overflowing"])
def test_shard_map_with_specs_equals_unsharded(scale):
  mesh = jax.make_mesh((2, 4), AXES)
  specs = {k: spec for k, (_, spec) in LEAVES.items()}
  host = host_tree(scale)
  tree = {k: jax.device_put(x, NamedSharding(mesh, specs[k])) for k, x in host.items()}
  threshold = 1.5 * scale
  tx = oc.clip_by_block_rms(threshold, axis_name=AXES, specs=specs)

  def step(t):
    updates, state = tx.update(t, tx.init(t))
    return F.clip_by_block_rms(t, threshold, axis_name=AXES, specs=specs), updates, state

  clipped, updates, state = jax.jit(shard_map(
      step, mesh=mesh, in_specs=(specs,), out_specs=(specs, specs, P())))(tree)
  want = F.clip_by_block_rms(host, threshold)
  for key, x in host.items():
    np.testing.assert_allclose(clipped[key], want[key], rtol=2e-6, err_msg=key)
    np.testing.assert_allclose(updates[key], want[key], rtol=2e-6, err_msg=key)
    np.testing.assert_allclose(clipped[key], exact(x, threshold), rtol=2e-6)
  rms = max(np.sqrt(np.mean(np.asarray(x, np.float64) ** 2)) for x in host.values())
  np.testing.assert_allclose(state.rms, rms, rtol=2e-6)


def test_shard_map_without_specs_treats_every_leaf_as_split():
  mesh = jax.make_mesh((8,), ("i",))
  host = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32) * 5
  f = jax.jit(shard_map(functools.partial(F.clip_by_block_rms, threshold=1.0,
                                          axis_name="i"),
                        mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  got = f(jax.device_put(host, NamedSharding(mesh, P("i"))))
  np.testing.assert_allclose(got, exact(host, 1.0), rtol=2e-6)


def test_gspmd_sharded_jit_gives_the_global_result():
  mesh = jax.make_mesh((2, 4), AXES)
  host = host_tree(1.0)
  tree = {k: jax.device_put(x, NamedSharding(mesh, LEAVES[k][1]))
          for k, x in host.items()}
  got = jax.jit(lambda t: F.clip_by_block_rms(t, 1.5))(tree)
  for key, x in host.items():
    np.testing.assert_allclose(got[key], exact(x, 1.5), rtol=2e-6, err_msg=key)


def test_shard_map_one_all_reduce_per_step():
  # The main path all-reduces the per-leaf partial sums once; the rescues
  # (the norm's, and the overflowed-RMS one) run only in a conditional.
  mesh = jax.make_mesh((2, 4), AXES)
  specs = {k: spec for k, (_, spec) in LEAVES.items()}
  tx = oc.clip_by_block_rms(1.0, axis_name=AXES, specs=specs)
  step = jax.jit(shard_map(lambda t: tx.update(t, tx.init(t)), mesh=mesh,
                           in_specs=(specs,), out_specs=(specs, P())))
  tree = {k: jax.ShapeDtypeStruct(shape, jnp.float32,
                                  sharding=NamedSharding(mesh, spec))
          for k, (shape, spec) in LEAVES.items()}
  hlo = step.lower(tree).compile().as_text()
  assert hlo_ops(hlo, "all-reduce")[0] == 1


# --------------------------------------------------------------------------
# layer_axis (issue 13 sections 2 and 4): each layer slice is a block

STACKED = {"kernel": ((4, 8, 16), 0), "bias": ((4, 16), 0), "mid": ((5, 3, 6), 1),
           "last": ((6, 4), -1), "plain": ((8, 4), None)}


def stacked_tree(seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  tree = {}
  for k, (shape, axis) in STACKED.items():
    x = rng.standard_normal(shape)
    if axis is not None:  # a different scale per layer
      scales = 10.0 ** rng.uniform(-2, 1.5, shape[axis])
      x = x * np.expand_dims(scales, [a for a in range(len(shape)) if a != axis % len(shape)])
    tree[k] = jnp.asarray(x, dtype)
  return tree


LAYER_AXES = {k: a for k, (_, a) in STACKED.items()}


def optax_per_layer(tree, threshold):
  """optax.clip_by_block_rms on every layer's slice alone, restacked."""
  ref = optax.clip_by_block_rms(threshold)
  out = {}
  for k, x in tree.items():
    axis = LAYER_AXES[k]
    if axis is None:
      out[k] = ref.update([x], None)[0][0]
    else:
      out[k] = jnp.stack([ref.update([jnp.take(x, i, axis=axis)], None)[0][0]
                          for i in range(x.shape[axis])], axis=axis % x.ndim)
  return out


@pytest.mark.parametrize("threshold", [0.1, 1.0])
def test_layer_axis_equals_optax_on_each_layer(threshold):
  tree = stacked_tree(20)
  want = optax_per_layer(tree, threshold)
  tx = oc.clip_by_block_rms(threshold, layer_axis=LAYER_AXES)
  updates, state = jax.jit(tx.update)(tree, tx.init(tree))
  functional = F.clip_by_block_rms(tree, threshold, layer_axis=LAYER_AXES)
  for k in tree:
    np.testing.assert_array_equal(updates[k], functional[k])
    assert ulps(updates[k], want[k], jnp.float32).max() <= F32_APART, k
  rms = []
  for k, x in tree.items():
    axis, u = LAYER_AXES[k], np.asarray(x, np.float64)
    if axis is None:
      rms.append(np.sqrt(np.mean(u ** 2)))
    else:
      rms.extend(np.sqrt(np.mean(np.moveaxis(u, axis, 0).reshape(u.shape[axis], -1) ** 2,
                                 axis=1)))
  np.testing.assert_allclose(state.rms, max(rms), rtol=1e-6)
  np.testing.assert_allclose(state.scale, min(1, threshold / max(rms)), rtol=1e-6)


def test_layer_axis_one_large_layer_leaves_the_others_alone():
  tree = {"k": jnp.ones((4, 8, 16)).at[2].multiply(100.0)}
  got = F.clip_by_block_rms(tree, 1.0, layer_axis=0)["k"]
  np.testing.assert_array_equal(got, jnp.ones((4, 8, 16)))  # layer 2 cut to rms 1
  whole = F.clip_by_block_rms(tree, 1.0)["k"]
  assert float(whole[0, 0, 0]) < 0.05  # one block: every layer cut


def test_layer_axis_overflowing_layer_norm_is_rescued():
  top = float(jnp.finfo(jnp.float32).max)
  x = jnp.stack([jnp.full(4, 0.9 * top), jnp.full(4, 2.0)])  # norm 1.8 * top
  got = jax.jit(lambda t: F.clip_by_block_rms(t, 1e38, layer_axis=0))([x])[0]
  np.testing.assert_allclose(got, [[1e38] * 4, [2.0] * 4], rtol=1e-6)


def test_layer_axis_under_vmap():
  batch = stacked_tree(21)["kernel"][None] * jnp.array([0.1, 1.0, 10.0])[:, None, None, None]
  got = jax.jit(jax.vmap(lambda g: F.clip_by_block_rms([g], 1.0, layer_axis=0)[0]))(batch)
  for example, clipped in zip(batch, got):
    np.testing.assert_array_equal(clipped, F.clip_by_block_rms([example], 1.0, layer_axis=0)[0])


@pytest.mark.parametrize("which", ["layers", "layers_and_more", "inside"])
def test_layer_axis_shard_map_equals_unsharded(which):
  mesh = jax.make_mesh((2, 4), AXES)
  specs = {"layers": {"k": P("data"), "b": P("data")},
           "layers_and_more": {"k": P("data", None, "model"), "b": P(None, "model")},
           "inside": {"k": P(None, AXES), "b": P()}}[which]
  host = {"k": stacked_tree(22)["kernel"], "b": stacked_tree(23)["bias"]}
  tree = {k: jax.device_put(x, NamedSharding(mesh, specs[k])) for k, x in host.items()}
  tx = oc.clip_by_block_rms(0.5, axis_name=AXES, specs=specs, layer_axis=0)
  step = jax.jit(shard_map(lambda t: tx.update(t, tx.init(t)), mesh=mesh,
                           in_specs=(specs,), out_specs=(specs, P())))
  updates, state = step(tree)
  local = oc.clip_by_block_rms(0.5, layer_axis=0)
  want, want_state = local.update(host, local.init(host))
  for k in host:
    np.testing.assert_allclose(updates[k], want[k], rtol=2e-6, err_msg=k)
  np.testing.assert_allclose(state.rms, want_state.rms, rtol=2e-6)
  np.testing.assert_allclose(state.scale, want_state.scale, rtol=2e-6)
  assert int(state.clipped_count) == 1


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_layer_axis_on_gspmd_sharded_layers(axis_type):
  mesh = jax.make_mesh((2, 4), AXES,
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
  host = stacked_tree(24)
  tree = {k: jax.device_put(x, NamedSharding(mesh, P("data") if LAYER_AXES[k] == 0 else P()))
          for k, x in host.items()}
  got = jax.jit(lambda t: F.clip_by_block_rms(t, 0.5, layer_axis=LAYER_AXES))(tree)
  want = optax_per_layer(host, 0.5)
  for k in host:
    assert ulps(got[k], want[k], jnp.float32).max() <= F32_APART, k
    assert got[k].sharding.is_equivalent_to(tree[k].sharding, host[k].ndim), k


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_axis_dtypes_nan_and_zero(dtype):
  x = stacked_tree(25, dtype)["kernel"]
  got = F.clip_by_block_rms([x], 0.5, layer_axis=0)[0]
  assert got.dtype == dtype
  for layer in range(x.shape[0]):  # one rounding of the exact per-slice value
    assert ulps(got[layer], exact(x[layer], 0.5), dtype).max() <= (
        F32_FROM_EXACT if dtype == jnp.float32 else HALF_FROM_EXACT)
  bad = x.at[1, 0, 0].set(jnp.nan)  # layer 1 only
  tx = oc.clip_by_block_rms(0.5, layer_axis=0)
  updates, state = tx.update([bad], tx.init([bad]))
  assert np.isnan(np.asarray(updates[0][1], np.float64)).all()
  # (the NaN sends the norms through the core's second pass, which sums in
  # another order: the others stay within their roundings of the exact value)
  for layer in (0, 2):
    assert ulps(updates[0][layer], exact(x[layer], 0.5), dtype).max() <= (
        F32_FROM_EXACT if dtype == jnp.float32 else HALF_FROM_EXACT)
  assert state.nonfinite_count == 1
  zeros = jnp.zeros((3, 4), dtype)
  np.testing.assert_array_equal(F.clip_by_block_rms([zeros], 0.0, layer_axis=0)[0], zeros)
  grad = jax.grad(lambda z: jnp.sum(F.clip_by_block_rms([z], 1.0, layer_axis=0)[0]))
  assert np.isfinite(grad(jnp.zeros((3, 4)))).all()
