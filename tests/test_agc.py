"""adaptive_grad_clip: Optax's numbers, a float64 restatement, and the contract.

Run with ``-s`` to see the largest relative differences against the float64
restatement of ``optax.transforms._clipping.unitwise_norm``/``unitwise_clip``.
"""


import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fuzzing import assert_named_error
from helpers import STEPS, Largest, f64_leaves, norm_sequence
from hypothesis import given, settings
from hypothesis import strategies as st

import optaxclip as oc

F = oc.functional
adaptive_grad_clip = oc.adaptive_grad_clip
adaptive_grad_clip_fn = F.adaptive_grad_clip

# Every kind of leaf optax distinguishes: scalar, vector, squeezable, linear
# IO, multi-head, conv HWIO, conv 3-D DHWIO.
LEAF_SHAPES = {"scalar": (), "vector": (5,), "row": (1, 5), "column": (5, 1, 1),
               "linear": (4, 3), "heads": (2, 3, 4), "conv": (3, 3, 2, 4),
               "conv3d": (2, 2, 2, 3, 4)}
AT_LEAST_2D = {k: LEAF_SHAPES[k] for k in ("linear", "heads", "conv")}
SOME = {k: LEAF_SHAPES[k] for k in ("vector", "linear", "conv")}
CLIPPING = 0.1


def tree_of(shapes, seed, scale=1.0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=s) * scale, dtype) for k, s in shapes.items()}


def np_unit_axes(shape, axis=None):
  if axis is not None:
    return axis
  if len([d for d in shape if d != 1]) <= 1:
    return tuple(range(len(shape)))
  return {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}[len(shape)]


def np_agc(grads, params, clipping, eps=1e-3, axis=None):
  """optax's unitwise_norm / unitwise_clip in float64: (clipped, factors)."""
  clipped, factors = [], []
  for g, p in zip(f64_leaves(grads), f64_leaves(params)):
    axes = np_unit_axes(g.shape, axis)
    g_norm = np.sqrt(np.sum(g ** 2, axis=axes, keepdims=True))
    p_norm = np.sqrt(np.sum(p ** 2, axis=axes, keepdims=True))
    limit = clipping * np.maximum(p_norm, eps)
    factor = np.where(g_norm < limit, 1.0, limit / np.maximum(g_norm, 1e-6))
    clipped.append(g * factor)
    factors.append(factor)
  return clipped, factors


def optax_agc(grads, params, clipping, eps=1e-3, axis=None):
  tx = optax.adaptive_grad_clip(clipping, eps, axis)
  return tx.update(grads, tx.init(params), params)[0]


def assert_tree_close(actual, expected, rtol):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.dtype == e.dtype and a.shape == e.shape
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64),
                               rtol=rtol, atol=0)


_agc_fn = jax.jit(adaptive_grad_clip_fn, static_argnames="axis")
_optax_fn = jax.jit(optax_agc, static_argnames="axis")


@pytest.mark.parametrize("clipping", [0.01, 0.1, 1.0])
def test_matches_optax_on_every_leaf_kind(clipping):
  params = tree_of(LEAF_SHAPES, seed=0)
  params["linear"] = params["linear"].at[:, 0].set(0.0)  # eps floors this unit
  grads = tree_of(LEAF_SHAPES, seed=1, scale=0.3)
  got = _agc_fn(grads, params, clipping)
  assert_tree_close(got, _optax_fn(grads, params, clipping), rtol=1e-6)


@pytest.mark.parametrize("axis", [0, -1, (0, 1)])
def test_matches_optax_with_axis_given(axis):
  params = tree_of(AT_LEAST_2D, seed=2)
  grads = tree_of(AT_LEAST_2D, seed=3, scale=0.3)
  got = _agc_fn(grads, params, CLIPPING, axis=axis)
  expected = _optax_fn(grads, params, CLIPPING, axis=axis)
  assert_tree_close(got, expected, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_matches_float64(dtype):
  # optax computes half-precision norms in their own dtype; here they are
  # float32 and the result is one rounding of the float64 numbers.
  params = tree_of(SOME, seed=4, dtype=dtype)
  grads = tree_of(SOME, seed=5, scale=0.3, dtype=dtype)
  got = _agc_fn(grads, params, CLIPPING)
  expected, _ = np_agc(grads, params, CLIPPING)
  info = jnp.finfo(dtype)  # one rounding; subnormals keep less precision
  for a, e in zip(jax.tree.leaves(got), expected):
    assert a.dtype == dtype
    np.testing.assert_allclose(np.asarray(a, np.float64), e,
                               rtol=float(info.eps), atol=float(info.smallest_subnormal))


def _floats(shape):
  return hnp.arrays(np.float32, shape, elements=st.floats(
      -1e3, 1e3, width=32, allow_subnormal=False))


@settings(max_examples=40, deadline=None)
@given(w=_floats((4, 3)), v=_floats((5,)), pw=_floats((4, 3)), pv=_floats((5,)),
       clipping=st.floats(0, 10, width=32, allow_subnormal=False))
def test_clipped_units_stay_within_their_limit(w, v, pw, pv, clipping):
  # Invariants: each unit's norm ends at most clipping * max(|param|, eps),
  # units under their limit are untouched, and directions are kept.
  grads, params = {"v": v, "w": w}, {"v": pv, "w": pw}
  out = _agc_fn(grads, params, clipping)
  for x, y, p in zip(f64_leaves(grads), f64_leaves(out), f64_leaves(params)):
    axes = np_unit_axes(x.shape)
    unit_norm = lambda a: np.sqrt(np.sum(a ** 2, axis=axes, keepdims=True))
    limit = clipping * np.maximum(unit_norm(p), 1e-3)
    assert np.all(unit_norm(y) <= limit * (1 + 1e-5) + 1e-30)
    under = unit_norm(x) < limit * (1 - 1e-5)  # clear of float32 rounding
    np.testing.assert_array_equal(np.where(under, y - x, 0), 0)
    assert np.all(y * x >= 0)


def test_finite_for_huge_gradients():
  # Squares of 1e20 overflow float32: optax then zeroes these units.
  shapes = {"linear": (4, 3), "vector": (5,)}
  params = tree_of(shapes, seed=6)
  grads = tree_of(shapes, seed=7, scale=1e20)
  got = _agc_fn(grads, params, CLIPPING)
  expected, _ = np_agc(grads, params, CLIPPING)
  for a, e in zip(jax.tree.leaves(got), expected):
    np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=1e-6)


def test_matches_the_float64_restatement_step_by_step():
  # Gradients of norm ~1 with spikes against fixed parameters: the clipped
  # updates and every statistic in the state, step by step.
  shapes = {"b": (4,), "conv": (3, 3, 2, 4), "w": (8, 4)}
  params = tree_of(shapes, seed=8, scale=0.5)
  norms = norm_sequence(seed=9)
  rng = np.random.default_rng(10)
  tx = adaptive_grad_clip(0.3)
  step = jax.jit(tx.update)
  state = tx.init(params)
  largest = Largest()
  clipped_steps = 0
  for t in range(STEPS):
    grads = {k: jnp.asarray(rng.normal(size=s) * norms[t] / 20, jnp.float32)
             for k, s in shapes.items()}
    out, state = step(grads, state, params)
    expected, factors = np_agc(grads, params, 0.3)
    for got, want in zip(jax.tree.leaves(out), expected):
      largest.check("clipped gradient", got, want)
    hits = sum(int(np.sum(f < 1)) for f in factors)
    units = sum(f.size for f in factors)
    largest.check("scale", state.scale, min(f.min() for f in factors))
    largest.check("clipped fraction", state.clipped_fraction, hits / units)
    clipped_steps += hits > 0
    assert (int(state.clipped_units), int(state.count), int(state.clipped_count)) \
        == (hits, t + 1, clipped_steps), t
  assert 0 < clipped_steps < STEPS
  largest.report("adaptive_grad_clip(0.3)")


def test_shard_map_with_specs_matches_the_whole_tree():
  from jax import shard_map
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  shapes = {"linear": (8, 12), "conv": (3, 3, 4, 8), "vector": (16,),
            "replicated": (4, 6), "heads": (4, 2, 8)}
  specs = {"linear": P("data", "model"),  # a unit split over data
           "conv": P(None, None, "data", "model"),
           "vector": P("model"),  # the one unit split over model
           "replicated": P(),
           "heads": P(None, "data", "model")}  # units split over devices
  params = tree_of(shapes, seed=11)
  grads = tree_of(shapes, seed=12, scale=0.1)
  tx = adaptive_grad_clip(CLIPPING, axis_name=("data", "model"), specs=specs)
  put = lambda tree: jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)
  step = jax.jit(shard_map(tx.update, mesh=mesh, in_specs=(specs, P(), specs),
                           out_specs=(specs, P())))
  state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
  out, state = step(put(grads), state, put(params))
  local = adaptive_grad_clip(CLIPPING)
  expected, expected_state = jax.jit(local.update)(grads, local.init(params), params)
  assert_tree_close(out, expected, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               state, expected_state)
  assert 0 < float(state.clipped_fraction) < 1


# --------------------------------------------------------------------------
# Beyond the shared contract (tests/test_contract.py): this transform's
# own edge cases, statistics and argument errors.

CONTRACT_SHAPES = {"w": (8, 4), "b": (4,)}


def params_like(dtype=jnp.float32):
  return tree_of(CONTRACT_SHAPES, seed=13, dtype=dtype)


def tree_like(dtype=jnp.float32, scale=1.0):
  return tree_of(CONTRACT_SHAPES, seed=14, scale=scale, dtype=dtype)


def test_finite_at_zero():
  tx = adaptive_grad_clip(CLIPPING)
  zeros = jax.tree.map(jnp.zeros_like, tree_like())
  for grads, params in ((zeros, zeros), (tree_like(), zeros), (zeros, params_like())):
    out, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((out, state)))
  out = _agc_fn(tree_like(), zeros, 0.0)  # clipping=0: every unit to zero
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  # Gradients through the clipper, w.r.t. updates and params, at zero.
  loss = lambda g, p: jnp.sum(adaptive_grad_clip_fn([g], [p], CLIPPING)[0])
  for gradient in jax.jit(jax.grad(loss, argnums=(0, 1)))(zeros["w"], zeros["w"]):
    assert np.all(np.isfinite(gradient))


def test_nonfinite_updates_are_counted():
  tx = adaptive_grad_clip(CLIPPING)
  bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), tree_like())
  _, state = jax.jit(tx.update)(bad, tx.init(bad), params_like())
  assert int(state.nonfinite_count) == 1 and int(state.clipped_count) == 0


def test_stats_report_the_clipped_units():
  tx = optax.chain(adaptive_grad_clip(CLIPPING), optax.sgd(0.1))
  params = params_like()
  _, state = jax.jit(tx.update)(tree_like(), tx.init(params), params)
  found = oc.stats(state)
  assert set(found) == {f"agc/{k}" for k in (
      "clipped_fraction", "clipped_units", "scale", "count", "clipped_count",
      "nonfinite_count", "clip_rate")}
  assert int(found["agc/count"]) == 1 and int(found["agc/clipped_units"]) > 0


# Issue 11 (items 4, 7, 10) for the unit norms, which have their own rescue.
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_entry_reaches_its_unit_only(bad):
  params = tree_of({"linear": (4, 3)}, seed=20)
  grads = tree_of({"linear": (4, 3)}, seed=21, scale=3.0)
  grads["linear"] = grads["linear"].at[1, 2].set(bad)  # unit (column) 2
  got = np.asarray(_agc_fn(grads, params, CLIPPING)["linear"], np.float64)
  assert np.all(np.isnan(got[:, 2]) | (got[:, 2] == 0))
  assert np.isnan(got[1, 2])  # the unit's norm is NaN/Inf: as optax
  expected, _ = np_agc({"linear": grads["linear"][:, :2]},
                       {"linear": params["linear"][:, :2]}, CLIPPING)
  np.testing.assert_allclose(got[:, :2], expected[0], rtol=1e-6)


@pytest.mark.parametrize("scale", [0.0, 1e-30, 1.0, 1e20, 1e37])
def test_gradients_through_the_unit_norms_are_finite(scale):
  # The overflow branch must not leak NaN into the gradient; at 1e37 a
  # unit's norm is still a float32.
  params = tree_of({"linear": (4, 3)}, seed=22)
  grads = tree_of({"linear": (4, 3)}, seed=23, scale=scale)
  loss = lambda g, p: jnp.sum(adaptive_grad_clip_fn(g, p, CLIPPING)["linear"])
  for gradient in jax.jit(jax.grad(loss, argnums=(0, 1)))(grads, params):
    assert np.all(np.isfinite(gradient["linear"])), gradient


# --------------------------------------------------------------------------
# layer_axis (issue 13 section 2): scanned layers, each slice clipped as
# optax clips that layer alone.

# name: (shape, layer axis); the slices are linear, bias, conv, scalar, heads.
STACKED = {"kernel": ((4, 8, 16), 0), "bias": ((4, 16), 0),
           "conv": ((3, 3, 2, 4, 3), -1), "gain": ((4,), 0),
           "heads": ((2, 3, 5, 4), 1), "plain": ((8, 4), None)}
STACKED_SHAPES = {k: s for k, (s, _) in STACKED.items()}
LAYER_AXES = {k: a for k, (_, a) in STACKED.items()}


def optax_per_layer(grads, params, layer_axes, clipping, eps=1e-3, axis=None):
  """optax.adaptive_grad_clip on every layer's slice alone, restacked."""
  tx = optax.adaptive_grad_clip(clipping, eps, axis)
  out = {}
  for k, g in grads.items():
    stacked = layer_axes[k]
    if stacked is None:
      out[k] = tx.update({k: g}, None, {k: params[k]})[0][k]
      continue
    slices = [tx.update({k: jnp.take(g, i, axis=stacked)}, None,
                        {k: jnp.take(params[k], i, axis=stacked)})[0][k]
              for i in range(g.shape[stacked])]
    out[k] = jnp.stack(slices, axis=stacked % g.ndim)
  return out


@pytest.mark.parametrize("clipping", [0.01, 0.1])
def test_layer_axis_equals_optax_on_each_layer(clipping):
  params = tree_of(STACKED_SHAPES, seed=30)
  grads = tree_of(STACKED_SHAPES, seed=31, scale=0.3)
  grads["kernel"] = grads["kernel"].at[2].multiply(100.0)
  grads["conv"] = grads["conv"].at[..., 0].multiply(30.0)
  want = optax_per_layer(grads, params, LAYER_AXES, clipping)
  fn = jax.jit(lambda g, p: adaptive_grad_clip_fn(g, p, clipping, layer_axis=LAYER_AXES))
  assert_tree_close(fn(grads, params), want, rtol=1e-6)
  tx = adaptive_grad_clip(clipping, layer_axis=LAYER_AXES)
  updates, state = tx.update(grads, tx.init(params), params)
  assert_tree_close(updates, want, rtol=1e-6)
  # Units counted per layer: a [4, 8, 16] kernel has 4 x 16, a [4, 16] bias 4.
  units = 4 * 16 + 4 + 3 * 4 + 4 + 3 * 5 * 4 + 4
  assert float(state.clipped_fraction) == pytest.approx(int(state.clipped_units) / units)


def test_layer_axis_with_axis_reads_the_slice_axes():
  params = tree_of({"w": (3, 6, 4, 5)}, seed=32)
  grads = tree_of({"w": (3, 6, 4, 5)}, seed=33, scale=0.3)
  for layer, axis in ((0, 1), (2, (0, 2)), (-1, -1)):
    got = adaptive_grad_clip_fn(grads, params, 0.1, axis=axis, layer_axis=layer)
    want = optax_per_layer(grads, params, {"w": layer}, 0.1, axis=axis)
    assert_tree_close(got, want, rtol=1e-6)


def test_one_layer_with_large_gradients_leaves_the_others_alone():
  # The measurement: a [4, 8, 16] kernel (4 scanned layers), layer 2
  # with 100x gradients. Without layer_axis optax's units span the 4 layers
  # and every other layer is clipped ~5x more than on its own.
  rng = np.random.default_rng(34)
  params = {"k": jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)}
  grads = {"k": jnp.asarray(rng.normal(size=(4, 8, 16)) * 0.1, jnp.float32)}
  grads["k"] = grads["k"].at[2].multiply(100.0)
  got = adaptive_grad_clip_fn(grads, params, 0.1, layer_axis=0)["k"]
  want = optax_per_layer(grads, params, {"k": 0}, 0.1)["k"]
  np.testing.assert_allclose(got, want, rtol=1e-6)
  mixed = _optax_fn(grads, params, 0.1)["k"]  # units across layers
  for layer in (0, 1, 3):
    assert np.linalg.norm(want[layer]) > 3 * np.linalg.norm(mixed[layer])


def test_layer_axis_under_jit_and_vmap():
  params = tree_of({"k": (4, 8, 6)}, seed=35)
  grads = tree_of({"k": (3, 4, 8, 6)}, seed=36, scale=0.3)  # 3 examples
  clip = lambda g: adaptive_grad_clip_fn(g, params, 0.1, layer_axis=0)
  batched = jax.jit(jax.vmap(clip))(grads)
  for i in range(3):
    one = clip({"k": grads["k"][i]})
    np.testing.assert_allclose(batched["k"][i], one["k"], rtol=1e-6)


@pytest.mark.parametrize("spec", ["layers", "layers_and_units", "inputs"])
def test_layer_axis_split_over_the_mesh_equals_unsharded(spec):
  from jax import shard_map
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  specs = {"layers": {"k": P("x", None, None), "b": P("x")},
           "layers_and_units": {"k": P("x", None, "y"), "b": P("x", "y")},
           "inputs": {"k": P(None, ("x", "y")), "b": P(None, "y")}}[spec]
  shapes = {"k": (4, 8, 16), "b": (4, 16)}
  params = tree_of(shapes, seed=37)
  grads = tree_of(shapes, seed=38, scale=0.03)
  grads["k"] = grads["k"].at[1].multiply(100.0)
  tx = adaptive_grad_clip(0.1, axis_name=("x", "y"), specs=specs, layer_axis=0)
  put = lambda tree: jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)
  step = jax.jit(shard_map(tx.update, mesh=mesh, in_specs=(specs, P(), specs),
                           out_specs=(specs, P())))
  out, state = step(put(grads), tx.init(params), put(params))
  local = adaptive_grad_clip(0.1, layer_axis=0)
  expected, expected_state = jax.jit(local.update)(grads, local.init(params), params)
  assert_tree_close(out, expected, rtol=1e-6)
  assert_tree_close(out, optax_per_layer(grads, params, {"k": 0, "b": 0}, 0.1), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               state, expected_state)
  assert 0 < float(state.clipped_fraction) < 1


# --------------------------------------------------------------------------
# functional.unitwise_norm / unitwise_clip: optax's numbers, overflow-safe

_unitwise_norm = jax.jit(oc.functional.unitwise_norm,
                         static_argnames=("axis", "layer_axis"))


@pytest.mark.parametrize("kind", list(LEAF_SHAPES))
def test_unitwise_norm_matches_optax(kind):
  x = tree_of({kind: LEAF_SHAPES[kind]}, seed=40)[kind]
  want = optax.transforms.unitwise_norm(x)
  for got in (oc.functional.unitwise_norm(x), _unitwise_norm(x)):
    assert got.shape == want.shape == x.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    exact = np.sqrt(np.sum(np.asarray(x, np.float64) ** 2,
                           axis=np_unit_axes(x.shape), keepdims=True))
    np.testing.assert_allclose(got, np.broadcast_to(exact, x.shape), rtol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, (0, 2)])
def test_unitwise_norm_with_axis_matches_optax(axis):
  x = tree_of({"x": (3, 4, 5)}, seed=41)["x"]
  np.testing.assert_allclose(_unitwise_norm(x, axis=axis),
                             optax.transforms.unitwise_norm(x, axis=axis), rtol=1e-6)


@pytest.mark.parametrize("dtype,scale", [(jnp.float32, 1e30), (jnp.float32, 1e-30),
                                         (jnp.bfloat16, 1e30), (jnp.float16, 1e3)])
def test_unitwise_norm_is_finite_where_optax_overflows(dtype, scale):
  x = tree_of({"x": (6, 3)}, seed=42, scale=scale, dtype=dtype)["x"]
  want = np.sqrt(np.sum(np.asarray(x, np.float64) ** 2, axis=0, keepdims=True))
  got = _unitwise_norm(x)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, np.broadcast_to(want, x.shape), rtol=1e-6)
  if scale > 1:  # optax squares in the leaf's dtype: inf
    assert np.all(np.isinf(np.asarray(optax.transforms.unitwise_norm(x), np.float64)))


def test_unitwise_norm_layer_axis_is_optax_per_slice():
  x = tree_of({"x": (4, 8, 6)}, seed=43)["x"]
  for layer in (0, 1, 2):
    want = jnp.stack([optax.transforms.unitwise_norm(jnp.take(x, i, axis=layer))
                      for i in range(x.shape[layer])], axis=layer)
    np.testing.assert_allclose(_unitwise_norm(x, layer_axis=layer), want, rtol=1e-6)


@pytest.mark.parametrize("kind", list(AT_LEAST_2D))
def test_unitwise_clip_equals_optax_bit_for_bit(kind):
  grad = tree_of({kind: LEAF_SHAPES[kind]}, seed=44)[kind]
  g_norm = optax.transforms.unitwise_norm(grad)
  max_norm = jnp.asarray(np.random.default_rng(45).uniform(0.5, 3, grad.shape),
                         jnp.float32)
  max_norm = max_norm.at[(0,) * grad.ndim].set(0.0)  # a unit cut to zero
  want = optax.transforms.unitwise_clip(g_norm, max_norm, grad)
  got = oc.functional.unitwise_clip(g_norm, max_norm, grad)
  np.testing.assert_array_equal(got, want)
  zero = jnp.zeros_like(grad)
  np.testing.assert_array_equal(oc.functional.unitwise_clip(zero, zero, zero), zero)
  np.testing.assert_array_equal(
      jax.jit(oc.functional.unitwise_clip)(g_norm, max_norm, grad), want)


def test_unitwise_pieces_make_optax_agc():
  # optax's AGC from the two functions, leaf by leaf.
  params = tree_of(SOME, seed=46)
  grads = tree_of(SOME, seed=47, scale=0.3)
  ours = {k: F.unitwise_clip(F.unitwise_norm(grads[k]),
                             0.1 * jnp.maximum(F.unitwise_norm(params[k]), 1e-3), grads[k])
          for k in grads}
  assert_tree_close(ours, _optax_fn(grads, params, 0.1), rtol=1e-6)


def test_units_come_from_the_whole_leaf_under_shard_map():
  # Kernels split down to [1, 6] and [8, 1] per device: their units were
  # chosen from the shards (optax's squeeze rule: a "vector", one unit per
  # device) instead of the whole leaves' columns.
  from jax import shard_map
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((4,), ("model",))
  shapes = {"rows": (4, 6), "cols": (8, 4)}
  specs = {"rows": P("model"), "cols": P(None, "model")}  # [1, 6] and [8, 1] shards
  params = tree_of(shapes, seed=50)
  grads = tree_of(shapes, seed=51, scale=0.3)
  put = lambda tree: jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)
  clip = jax.jit(shard_map(
      lambda g, p: adaptive_grad_clip_fn(g, p, 0.1, axis_name="model", specs=specs),
      mesh=mesh, in_specs=(specs, specs), out_specs=specs))
  assert_tree_close(clip(put(grads), put(params)), _optax_fn(grads, params, 0.1),
                    rtol=1e-6)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_layer_axis_on_gspmd_sharded_layers(axis_type):
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  # The units (layer, output) are split over both mesh axes.
  mesh = jax.make_mesh((2, 4), ("x", "y"),
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
  params = tree_of({"k": (4, 8, 16)}, seed=52)
  grads = tree_of({"k": (4, 8, 16)}, seed=53, scale=0.03)
  grads["k"] = grads["k"].at[3].multiply(100.0)
  put = lambda tree: {"k": jax.device_put(tree["k"], NamedSharding(mesh, P("x", None, "y")))}
  got = jax.jit(lambda g, p: adaptive_grad_clip_fn(g, p, 0.1, layer_axis=0))(
      put(grads), put(params))
  assert_tree_close(got, optax_per_layer(grads, params, {"k": 0}, 0.1), rtol=1e-6)
  assert got["k"].sharding.is_equivalent_to(put(grads)["k"].sharding, 3)


def test_layer_axis_nan_stays_in_its_layer_and_zero_is_finite():
  params = tree_of({"k": (3, 4, 5)}, seed=54)
  grads = tree_of({"k": (3, 4, 5)}, seed=55, scale=0.3)
  bad = {"k": grads["k"].at[1, 0, 0].set(jnp.nan)}
  got = adaptive_grad_clip_fn(bad, params, 0.1, layer_axis=0)["k"]
  assert np.isnan(got[1, :, 0]).all() and np.isfinite(np.delete(np.asarray(got), 1, 0)).all()
  zeros = {"k": jnp.zeros((3, 4, 5))}
  loss = lambda g, p: jnp.sum(adaptive_grad_clip_fn(g, p, CLIPPING, layer_axis=0)["k"])
  for gradient in jax.jit(jax.grad(loss, argnums=(0, 1)))(zeros, zeros):
    assert np.all(np.isfinite(gradient["k"]))


@pytest.mark.parametrize("params", [
    {"v": jnp.ones((2, 3)), "b": jnp.ones(3)},  # same leaves, other keys
    {"w": jnp.ones((3, 2)), "b": jnp.ones(3)},  # other shapes
    {"w": jnp.ones((2, 3)), "b": jnp.ones(3), "c": jnp.ones(2)},  # more leaves
])
def test_adaptive_grad_clip_names_mismatched_params(params):
  grads = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
  tx = oc.adaptive_grad_clip(0.1)
  for clip in (lambda g, p: tx.update(g, tx.init(p), p),
               lambda g, p: F.adaptive_grad_clip(g, p, 0.1)):
    with pytest.raises((ValueError, TypeError)) as info:
      clip(grads, params)
    assert_named_error(info.value, "adaptive_grad_clip", "params")
