"""The contract every optaxclip transform keeps, checked for each of them."""

import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip as oc
from conftest import FLOAT_DTYPES

# name -> (factory, threshold keyword, threshold). The threshold is what
# optax.inject_hyperparams injects in the tests below.
TRANSFORMS = {
    "clip_by_value": (oc.clip_by_value, "max_value", 0.5),
    "clip_by_norm": (oc.clip_by_norm, "max_norm", 0.5),
    "clip_by_norm_inf": (functools.partial(oc.clip_by_norm, ord="inf"), "max_norm", 0.5),
    "clip_by_global_norm": (oc.clip_by_global_norm, "max_norm", 0.5),
    "clip_by_global_norm_ord3": (functools.partial(oc.clip_by_global_norm, ord=3),
                                 "max_norm", 0.5),
    "clip_by_global_norm_zero": (
        functools.partial(oc.clip_by_global_norm, nonfinite="zero"), "max_norm", 0.5),
    "clip_by_global_norm_raise": (
        functools.partial(oc.clip_by_global_norm, nonfinite="raise"), "max_norm", 0.5),
    "clip_grad_norm": (oc.clip_grad_norm, "max_norm", 0.5),
    "clip_grad_norm_inf": (functools.partial(oc.clip_grad_norm, norm_type="inf"),
                           "max_norm", 0.5),
}
NAMES = list(TRANSFORMS)


def make(name, **overrides):
  factory, key, value = TRANSFORMS[name]
  return factory(**{key: value, **overrides})


def grads_like(dtype=jnp.float32, scale=1.0):
  rng = np.random.default_rng(0)
  tree = {"dense": {"w": rng.normal(size=(8, 4)), "b": rng.normal(size=(4,))},
          "norm": [rng.normal(size=(3,))]}
  return jax.tree.map(lambda x: jnp.asarray(x * scale, dtype), tree)


def signature(tree):
  """Shape, dtype and weak type of every leaf: what jit keys its cache on."""
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x),
                                 getattr(x, "weak_type", None)), tree)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_dtype_and_state_types_are_stable(name, dtype):
  tx = make(name)
  grads = grads_like(dtype)
  state = tx.init(grads)
  for update in (tx.update, jax.jit(tx.update)):
    out, new_state = update(grads, state)
    assert signature(out) == signature(grads)
    assert signature(new_state) == signature(state)
    assert not any(getattr(x, "weak_type", False) for x in jax.tree.leaves(new_state))


@pytest.mark.parametrize("name", NAMES)
def test_init_accepts_shape_dtype_structs(name):
  tx = make(name)
  grads = grads_like()
  specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), grads)
  assert signature(jax.eval_shape(tx.init, specs)) == signature(tx.init(grads))
  out_shapes = jax.eval_shape(tx.update, specs, tx.init(grads))
  assert jax.tree.map(lambda s: (s.shape, s.dtype), out_shapes[0]) == \
      jax.tree.map(lambda x: (x.shape, x.dtype), grads)


@pytest.mark.parametrize("name", NAMES)
def test_eager_and_jit_agree_and_clip(name):
  tx = make(name)
  grads = grads_like(scale=3.0)
  state = tx.init(grads)
  eager, eager_state = tx.update(grads, state)
  jitted, jit_state = jax.jit(tx.update)(grads, state)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), eager, jitted)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               eager_state, jit_state)
  assert not jax.tree.all(jax.tree.map(
      lambda a, b: bool(np.allclose(a, b)), eager, grads)), "nothing was clipped"


@pytest.mark.parametrize("name", NAMES)
def test_idempotent(name):
  tx = make(name)
  grads = grads_like(scale=3.0)
  once, state = jax.jit(tx.update)(grads, tx.init(grads))
  twice, _ = jax.jit(tx.update)(once, state)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), once, twice)


@pytest.mark.parametrize("name", NAMES)
def test_below_threshold_is_a_no_op(name):
  tx = make(name)
  grads = grads_like(scale=1e-3)
  out, _ = jax.jit(tx.update)(grads, tx.init(grads))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), out, grads)


@pytest.mark.parametrize("name", NAMES)
def test_finite_at_zero(name):
  tx = make(name)
  zeros = jax.tree.map(jnp.zeros_like, grads_like())
  out, state = jax.jit(tx.update)(zeros, tx.init(zeros))
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
  tx_zero = make(name, **{TRANSFORMS[name][1]: 0.0})
  out, _ = jax.jit(tx_zero.update)(grads_like(), tx_zero.init(zeros))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))


@pytest.mark.parametrize("name", NAMES)
def test_composes_with_chain_and_multisteps(name):
  grads = grads_like(scale=3.0)
  clipped, _ = make(name).update(grads, make(name).init(grads))
  chained = optax.chain(make(name), optax.sgd(1.0))
  state = chained.init(grads)
  updates, state = jax.jit(chained.update)(grads, state, grads)
  jax.tree.map(lambda u, c: np.testing.assert_allclose(u, -c, rtol=1e-6), updates, clipped)
  # MultiSteps clips the accumulated (mean) gradient once per 2 micro-steps.
  multi = optax.MultiSteps(optax.chain(make(name), optax.sgd(1.0)), every_k_schedule=2)
  state = multi.init(grads)
  step = jax.jit(multi.update)
  updates, state = step(grads, state, grads)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  updates, state = step(grads, state, grads)
  jax.tree.map(lambda u, c: np.testing.assert_allclose(u, -c, rtol=1e-5), updates, clipped)


@pytest.mark.parametrize("name", NAMES)
def test_inject_hyperparams_threshold(name):
  factory, key, value = TRANSFORMS[name]
  grads = grads_like(scale=3.0)
  tx = optax.inject_hyperparams(factory)(**{key: value})
  state = tx.init(grads)
  step = jax.jit(tx.update)
  injected, state = step(grads, state)
  expected, _ = make(name).update(grads, make(name).init(grads))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), injected, expected)
  # Raising the injected threshold far above the gradients turns clipping off.
  state.hyperparams[key] = jnp.asarray(1e6, state.hyperparams[key].dtype)
  unclipped, _ = step(grads, state)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), unclipped, grads)


# nonfinite="raise" stops on NaN by design (tested in test_nonfinite.py).
@pytest.mark.parametrize("name", [n for n in NAMES if not n.endswith("_raise")])
def test_apply_if_finite_skips_nan_steps(name):
  tx = optax.apply_if_finite(optax.chain(make(name), optax.sgd(1.0)), max_consecutive_errors=3)
  grads = grads_like(scale=3.0)
  state = tx.init(grads)
  step = jax.jit(tx.update)
  bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), grads)
  updates, state = step(bad, state, grads)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  assert int(state.notfinite_count) == 1
  updates, state = step(grads, state, grads)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
  assert int(state.notfinite_count) == 0


@pytest.mark.parametrize("name", NAMES)
def test_state_is_a_checkpointable_pytree(name):
  tx = make(name)
  grads = grads_like(scale=3.0)
  _, state = jax.jit(tx.update)(grads, tx.init(grads))
  leaves, treedef = jax.tree.flatten(state)
  rebuilt = jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
  restored = pickle.loads(pickle.dumps(rebuilt))
  assert type(restored) is type(state)
  assert signature(jax.tree.map(jnp.asarray, restored)) == signature(state)
  again, _ = jax.jit(tx.update)(grads, jax.tree.map(jnp.asarray, restored))
  expected, _ = jax.jit(tx.update)(grads, state)
  jax.tree.map(np.testing.assert_array_equal, again, expected)
