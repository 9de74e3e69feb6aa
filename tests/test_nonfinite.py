"""NaN and Inf gradients: propagate (as the references), zero, or raise."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip as oc


def bad_grads():
  return {"encoder": {"w": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2)},
          "head": [jnp.array([jnp.inf, 0.0]), jnp.ones(3)]}


def test_propagate_matches_optax_on_nan():
  grads = bad_grads()
  ours, state = oc.clip_by_global_norm(1.0).update(grads, oc.clip_by_global_norm(1.0).init(grads))
  theirs, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.isnan(a), np.isnan(b)),
               ours, theirs)
  assert np.isnan(state.norm) and int(state.nonfinite_count) == 1
  assert int(state.clipped_count) == 0


def test_propagate_inf_norm_zeroes_finite_entries_like_pytorch():
  # PyTorch: clip_coef = max_norm / (inf + 1e-6) = 0, so finite entries
  # become 0 and infinite ones NaN.
  grads = [jnp.array([jnp.inf, 2.0]), jnp.array([3.0])]
  out, state = oc.clip_grad_norm(1.0).update(grads, oc.clip_grad_norm(1.0).init(grads))
  assert np.isnan(out[0][0]) and out[0][1] == 0 and out[1][0] == 0
  assert np.isinf(state.norm) and int(state.nonfinite_count) == 1


@pytest.mark.parametrize("jit", [False, True])
def test_zero_mode_returns_zeros_and_counts(jit):
  tx = oc.clip_by_global_norm(1.0, nonfinite="zero")
  grads = bad_grads()
  update = jax.jit(tx.update) if jit else tx.update
  out, state = update(grads, tx.init(grads))
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert int(state.nonfinite_count) == 1 and int(state.count) == 1
  assert state.scale == 0
  good = jax.tree.map(jnp.ones_like, grads)
  out, state = update(good, state)
  np.testing.assert_allclose(oc.functional.global_norm(out), 1.0, rtol=1e-6)
  assert int(state.nonfinite_count) == 1 and int(state.count) == 2
  assert int(state.clipped_count) == 1


def test_zero_mode_per_leaf_clipper():
  tx = oc.clip_by_norm(1.0, nonfinite="zero")
  out, state = tx.update(bad_grads(), tx.init(None))
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert int(state.nonfinite_count) == 1


@pytest.mark.parametrize("jit", [False, True])
def test_raise_names_the_leaf_paths(jit):
  tx = oc.clip_by_global_norm(1.0, nonfinite="raise")
  grads = bad_grads()
  update = jax.jit(tx.update) if jit else tx.update
  with pytest.raises(RuntimeError) as info:
    jax.block_until_ready(update(grads, tx.init(grads)))
  message = str(info.value)
  assert "['encoder']['w']" in message and "['head'][0]" in message
  assert "['encoder']['b']" not in message and "['head'][1]" not in message
  assert "clip_by_global_norm" in message
  if not jit:
    assert isinstance(info.value, oc.NonFiniteGradientError)


def test_raise_does_not_fire_on_finite_gradients():
  tx = oc.clip_by_global_norm(1.0, nonfinite="raise")
  grads = jax.tree.map(jnp.ones_like, bad_grads())
  out, state = jax.jit(tx.update)(grads, tx.init(grads))
  jax.block_until_ready(out)
  assert int(state.nonfinite_count) == 0


@pytest.mark.parametrize("jit", [False, True])
def test_clip_grad_norm_error_if_nonfinite(jit):
  # PyTorch raises a RuntimeError; so do we, eagerly and under jit.
  tx = oc.clip_grad_norm(1.0, error_if_nonfinite=True)
  update = jax.jit(tx.update) if jit else tx.update
  grads = [jnp.array([1.0, jnp.inf])]
  with pytest.raises(RuntimeError, match=r"\[0\]"):
    jax.block_until_ready(update(grads, tx.init(grads)))
  out, _ = update([jnp.array([3.0, 4.0])], tx.init(grads))
  np.testing.assert_allclose(out[0], np.array([3.0, 4.0]) / (5 + 1e-6), rtol=1e-6)


def test_raise_under_vmap_only_fires_for_bad_examples():
  tx = oc.clip_by_global_norm(1.0, nonfinite="raise")
  batch = jnp.ones((4, 3))
  out, _ = jax.vmap(lambda g: tx.update(g, tx.init(g)))(batch)
  np.testing.assert_allclose(out, np.full((4, 3), 1 / np.sqrt(3)), rtol=1e-6)
  with pytest.raises(RuntimeError):
    jax.block_until_ready(jax.vmap(lambda g: tx.update(g, tx.init(g)))(
        batch.at[2, 1].set(jnp.nan)))
