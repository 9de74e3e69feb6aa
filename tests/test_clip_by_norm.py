"""clip_by_norm (the transform and ``functional.clip_by_norm``): every leaf,
or with ``layer_axis`` every layer of a stacked leaf, clipped by its own norm.

Its numbers against float64 numpy (random trees too), the state's largest
norm and smallest factor, ``leaf_norms``, ``layer_axis`` (against
clip_by_norm on the unstacked twin of a stacked tree), ``nonfinite="zero"``
and an inf threshold. Elsewhere: test_contract.py, test_errors.py,
test_arguments.py, test_parity.py (TensorFlow's clip_by_norm),
test_distributed.py, test_fuzz.py, test_x64.py; the tests it shares with
clip_by_global_norm (``leaf_norms`` off by default, a callable
``layer_axis``, ``nonfinite="raise"``) are in test_clip_by_global_norm.py.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fuzzing import (
  SMALL_ORDERS,
  SMALL_SETTINGS,
  jitted_clip,
  jitted_norm,
  small_trees,
  thresholds,
)
from helpers import (
  LAYER_AXIS,
  LEAF_AXES,
  assert_norm_tree,
  assert_scaled_by_layer,
  bad_grads,
  expected_norm_tree,
  f64,
  named_leaves,
  np_factor,
  np_leaf_norm,
  np_norm,
  random_tree,
  run,
  stacked_gradients,
)
from hypothesis import given
from hypothesis import strategies as st

import optaxclip as oc

F = oc.functional
ORDS = [1, 2, 3, math.inf]
ORDERS = [0.5, 1, 1.5, 2, 3, 7, math.inf, "inf"]


@pytest.mark.parametrize("ord", ORDERS)
def test_per_leaf_norms_clip_each_leaf(ord):
  tree = random_tree(1)
  clipped = F.clip_by_norm(tree, 0.5, ord=ord)
  for before, after in zip(jax.tree.leaves(tree), jax.tree.leaves(clipped)):
    norm = np_norm([before], ord)
    np.testing.assert_allclose(after, before * min(1.0, 0.5 / norm), rtol=1e-5)


@SMALL_SETTINGS
@given(small_trees(), thresholds, st.sampled_from(SMALL_ORDERS))
def test_per_leaf_clip_bounds_each_leaf(tree, max_norm, ord):
  clipped = jitted_clip(F.clip_by_norm, ord)(tree, max_norm)
  for a, b in zip(clipped, tree):
    norm = float(jitted_norm(ord)(b))
    assert jitted_norm(ord)(a) <= max_norm * (1 + 1e-6) + 1e-30
    if norm <= max_norm:
      np.testing.assert_array_equal(a, b)
    else:
      np.testing.assert_allclose(a, np.asarray(b) * (max_norm / norm), rtol=2e-6,
                                 atol=1e-37)


def test_zero_mode_per_leaf_clipper():
  tx = oc.clip_by_norm(1.0, nonfinite="zero")
  out, state = tx.update(bad_grads(), tx.init(None))
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert int(state.nonfinite_count) == 1


def test_per_leaf_inf_threshold_spares_the_finite_leaves():
  with_inf = {"w": jnp.array([3.0, jnp.inf]), "b": jnp.array([12.0])}
  out = F.clip_by_norm(with_inf, math.inf)
  np.testing.assert_array_equal(out["b"], with_inf["b"])
  assert np.all(np.isnan(out["w"]))


# --------------------------------------------------------------------------
# leaf_norms and layer_axis: each layer clipped by its own norm

@pytest.mark.parametrize("ord", ORDS)
def test_clip_by_norm_keeps_its_leaf_norms(ord):
  grads = stacked_gradients()
  for layer_axis in (None, LAYER_AXIS):
    tx = oc.clip_by_norm(1.0, ord=ord, leaf_norms=True, layer_axis=layer_axis)
    _, state = run(tx, grads)
    want = expected_norm_tree(grads, ord, layer_axis is not None)
    assert_norm_tree(state.leaf_norms, want)
    np.testing.assert_allclose(state.norm, max(np.max(w) for w in jax.tree.leaves(want)),
                               rtol=1e-6)


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clip_by_norm_clips_each_layer_by_its_own_norm(ord, dtype):
  grads = stacked_gradients(dtype, scale=2.0, seed=5)
  max_norm = 3.0
  tx = oc.clip_by_norm(max_norm, ord=ord, layer_axis=LAYER_AXIS)
  out, state = run(tx, grads)
  norms = {k: np_leaf_norm(x, ord, LEAF_AXES[k]) for k, x in named_leaves(grads).items()}
  factors = {k: np_factor(n, max_norm) for k, n in norms.items()}
  assert 0 < min(np.min(f) for f in factors.values()) < 1  # some layers clip
  assert max(np.max(f) for f in factors.values()) == 1  # and some do not
  assert_scaled_by_layer(out, grads, factors)
  np.testing.assert_allclose(state.norm, max(np.max(n) for n in norms.values()),
                             rtol=1e-5)
  np.testing.assert_allclose(state.scale, min(np.min(f) for f in factors.values()),
                             rtol=1e-5)
  functional = F.clip_by_norm(grads, max_norm, ord=ord, layer_axis=LAYER_AXIS)
  assert_scaled_by_layer(functional, grads, factors)


def unstack(tree):
  """The twin of ``stacked_gradients()`` with each stacked leaf split into layers."""
  leaves = named_leaves(tree)
  return {name: (list(np.moveaxis(np.asarray(x), LEAF_AXES[name], 0))
                 if LEAF_AXES[name] is not None else x)
          for name, x in leaves.items()}


@pytest.mark.parametrize("ord", ORDS)
def test_layer_axis_equals_clip_by_norm_on_the_unstacked_twin(ord):
  grads = stacked_gradients(scale=2.0, seed=6)
  stacked, _ = run(oc.clip_by_norm(3.0, ord=ord, layer_axis=LAYER_AXIS), grads)
  twin, _ = run(oc.clip_by_norm(3.0, ord=ord), jax.tree.map(jnp.asarray, unstack(grads)))
  for name, x in named_leaves(stacked).items():
    axis = LEAF_AXES[name]
    want = twin[name] if axis is None else np.stack(twin[name], axis)
    np.testing.assert_allclose(np.asarray(x), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_any_layer_axis_of_a_leaf(axis):
  x = jnp.asarray(np.random.default_rng(7).normal(size=(3, 4, 5)), jnp.float32)
  out = F.clip_by_norm([x], 1.0, layer_axis=axis)[0]
  factor = np_factor(np_leaf_norm(x, 2, axis), 1.0)
  shape = [1, 1, 1]
  shape[axis] = -1
  np.testing.assert_allclose(np.asarray(out), f64(x) * factor.reshape(shape), rtol=1e-6)
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=axis)
  _, state = run(tx, [x])
  np.testing.assert_allclose(state.leaf_norms[0], np_leaf_norm(x, 2, axis), rtol=1e-6)


@pytest.mark.parametrize("call", ["init", "update", "functional"])
def test_layer_axis_errors_name_the_leaf(call):
  grads = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
  run_it = {
      "init": lambda la: oc.clip_by_norm(1.0, layer_axis=la).init(grads),
      "update": lambda la: oc.clip_by_norm(1.0, layer_axis=la).update(grads, None),
      "functional": lambda la: F.clip_by_norm(grads, 1.0, layer_axis=la)}[call]
  with pytest.raises(ValueError, match=re.escape(
      "`clip_by_norm(layer_axis=1)` is out of range for leaf ['b'] of shape (3,)")):
    run_it({"w": 1, "b": 1})
  with pytest.raises(ValueError, match=r"does not match the gradient tree"):
    run_it({"w": 0})
  with pytest.raises(TypeError, match=r"must hold ints .* got 'w'"):
    run_it({"w": "w", "b": None})


# --------------------------------------------------------------------------
# A callable layer_axis: direct, and injected with static_args

def _every_3d(grads):
  return jax.tree.map(lambda x: 0 if x.ndim == 3 else None, grads)


STACK = {"w": jnp.stack([jnp.ones((2, 2)), 100 * jnp.ones((2, 2))])}


def test_injected_callable_layer_axis_in_static_args_clips_per_layer():
  tx = optax.inject_hyperparams(oc.clip_by_norm, static_args=("layer_axis",))(
      max_norm=1.0, layer_axis=_every_3d)
  updates, state = jax.jit(tx.update)(STACK, tx.init(STACK))
  # Each layer's slice clipped by its own norm: layer 0 (norm 2) to 0.5.
  np.testing.assert_allclose(updates["w"][:, 0, 0], [0.5, 0.5], rtol=1e-6)


def test_a_direct_callable_is_not_refused():
  tx = oc.clip_by_norm(1.0, layer_axis=_every_3d)
  updates, _ = tx.update(STACK, tx.init(STACK))
  np.testing.assert_allclose(updates["w"][:, 0, 0], [0.5, 0.5], rtol=1e-6)
