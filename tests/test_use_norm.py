"""``functional.clip_by_global_norm(..., use_norm=...)``: clipping by a norm
measured beforehand (TensorFlow's ``use_norm``, PyTorch's
``clip_grads_with_norm_``).

The references' own numbers are in tests/test_parity.py (golden and live);
here, what follows from the definition: the factor is ``max_norm / use_norm``
(``max_norm / (use_norm + eps)``), computed once, and nothing is reduced.
Bad arguments are rows of tests/test_errors.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FLOAT_DTYPES

import optaxclip as oc

F = oc.functional


def tree_like(dtype=jnp.float32, seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(4, 3)) * scale, dtype),
          "b": [jnp.asarray(rng.normal(size=(3,)) * scale, dtype)],
          "s": jnp.asarray(rng.normal() * scale, dtype)}


def expected_factor(max_norm, use_norm, eps):
  """The factor in float32, as numpy rounds it: one division."""
  max_norm, use_norm = np.float32(max_norm), np.float32(use_norm)
  denominator = use_norm + np.float32(eps)
  return np.float32(1) if denominator <= max_norm else max_norm / denominator


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 1e-3), (2, 1e3)])
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 1e6])
def test_true_norm_gives_the_same_result_as_measuring(seed, scale, max_norm, eps):
  tree = tree_like(seed=seed, scale=scale)
  measured, norm = F.clip_by_global_norm(tree, max_norm, eps=eps)
  given, returned = F.clip_by_global_norm(tree, max_norm, eps=eps,
                                          use_norm=F.global_norm(tree))
  np.testing.assert_array_equal(returned, norm)
  jax.tree.map(np.testing.assert_array_equal, given, measured)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("use_norm", [0.0, 0.3, 1.0, 7.5, 1e30])
def test_factor_is_max_norm_over_the_given_norm(use_norm, eps):
  tree = tree_like()
  max_norm = 1.0
  clipped, returned = F.clip_by_global_norm(tree, max_norm, eps=eps,
                                            use_norm=use_norm)
  factor = expected_factor(max_norm, use_norm, eps)
  assert returned.dtype == jnp.float32 and returned == np.float32(use_norm)
  jax.tree.map(lambda got, x: np.testing.assert_array_equal(
      got, np.asarray(x) * factor), clipped, tree)


def test_the_tree_is_not_reduced():
  # A NaN in the tree would make a measured norm NaN; the given one is used.
  tree = [jnp.array([jnp.nan, 3.0]), jnp.array([4.0])]
  clipped, norm = F.clip_by_global_norm(tree, 1.0, use_norm=2.0)
  assert norm == 2.0
  np.testing.assert_array_equal(clipped[1], [2.0])
  jaxpr = str(jax.make_jaxpr(
      lambda t: F.clip_by_global_norm(t, 1.0, use_norm=2.0))(tree_like()))
  assert "reduce" not in jaxpr and "cond" not in jaxpr, jaxpr


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_dtypes_are_kept_and_scaled_once(dtype):
  tree = tree_like(dtype)
  clipped, norm = F.clip_by_global_norm(tree, 1.0, use_norm=4.0)
  assert norm.dtype == jnp.float32
  jax.tree.map(lambda got, x: (
      np.testing.assert_array_equal(
          got, (x.astype(jnp.float32) * np.float32(0.25)).astype(dtype)),
      (got.dtype == dtype) or pytest.fail(f"{got.dtype} != {dtype}")),
      clipped, tree)


def test_under_jit_with_a_traced_norm():
  tree = tree_like()

  @jax.jit
  def clip(tree, max_norm, use_norm):
    return F.clip_by_global_norm(tree, max_norm, use_norm=use_norm)

  for use_norm in (0.5, 2.0, 8.0):
    got, norm = clip(tree, 2.0, use_norm)
    want, _ = F.clip_by_global_norm(tree, 2.0, use_norm=use_norm)
    assert norm == use_norm
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_under_vmap_each_example_by_its_own_norm():
  batch = {"w": jnp.arange(12.0).reshape(4, 3), "b": jnp.ones((4, 2))}
  norms = jnp.array([0.5, 1.0, 4.0, 10.0])
  clipped, returned = jax.vmap(
      lambda g, n: F.clip_by_global_norm(g, 2.0, use_norm=n))(batch, norms)
  np.testing.assert_array_equal(returned, norms)
  factors = np.minimum(1, np.float32(2.0) / np.asarray(norms))
  for key in batch:
    np.testing.assert_array_equal(
        clipped[key], np.asarray(batch[key]) * factors[:, None])


def test_non_clippable_leaves_pass_through():
  tree = {"w": jnp.ones(3), "step": jnp.array(7, jnp.int32),
          "mask": jnp.array([True, False]), "none": None,
          "masked": optax.MaskedNode()}
  clipped, _ = F.clip_by_global_norm(tree, 1.0, use_norm=4.0)
  assert jax.tree.structure(clipped) == jax.tree.structure(tree)
  np.testing.assert_array_equal(clipped["w"], 0.25 * np.ones(3))
  assert clipped["step"] is tree["step"] and clipped["mask"] is tree["mask"]
  assert clipped["none"] is None and isinstance(clipped["masked"], optax.MaskedNode)
  empty, norm = F.clip_by_global_norm({}, 1.0, use_norm=3.0)
  assert empty == {} and norm == 3.0


def test_nan_norm_makes_every_leaf_nan_as_tensorflow_and_torch():
  clipped, norm = F.clip_by_global_norm(tree_like(), 1.0, use_norm=math.nan)
  assert np.isnan(norm)
  assert all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(clipped))


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_inf_norm_gives_factor_zero_as_a_measured_inf_norm(eps):
  tree = [jnp.array([1.0, jnp.inf]), jnp.array([3.0, 4.0])]
  measured, norm = F.clip_by_global_norm(tree, 5.0, eps=eps)
  given, returned = F.clip_by_global_norm(tree, 5.0, eps=eps, use_norm=math.inf)
  assert norm == returned == math.inf
  jax.tree.map(np.testing.assert_array_equal, given, measured)
  np.testing.assert_array_equal(given[1], [0.0, 0.0])


def test_traced_negative_norm_acts_as_zero_and_nan_stays_nan():
  tree = tree_like()
  clip = jax.jit(lambda n: F.clip_by_global_norm(tree, 1.0, use_norm=n))
  clipped, norm = clip(-3.0)
  assert norm == 0.0
  jax.tree.map(np.testing.assert_array_equal, clipped, tree)
  clipped, norm = clip(math.nan)
  assert np.isnan(norm)
  assert all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(clipped))


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_zero_norm_and_zero_threshold_are_finite(max_norm):
  zeros = jax.tree.map(jnp.zeros_like, tree_like())
  clipped, _ = F.clip_by_global_norm(zeros, max_norm, use_norm=0.0)
  jax.tree.map(np.testing.assert_array_equal, clipped, zeros)
  clipped, _ = F.clip_by_global_norm(tree_like(), 0.0, use_norm=2.0)
  assert all((np.asarray(x) == 0).all() for x in jax.tree.leaves(clipped))


def test_gradient_through_the_given_norm():
  # d/dn (x * max_norm / n) = -x * max_norm / n**2; 0 where not clipped.
  x = jnp.array([3.0, 4.0])

  def loss(n):
    return jnp.sum(F.clip_by_global_norm([x], 2.0, use_norm=n)[0][0])

  np.testing.assert_allclose(jax.grad(loss)(4.0), -7.0 * 2.0 / 16.0, rtol=1e-6)
  assert jax.grad(loss)(1.0) == 0.0
  assert jax.grad(loss)(0.0) == 0.0


def test_float64_norm_under_x64():
  with jax.enable_x64(True):
    tree = [jnp.array([3.0, 4.0], jnp.float64)]
    clipped, norm = F.clip_by_global_norm(tree, 1.0, use_norm=1e300)
    assert norm.dtype == jnp.float64 and norm == 1e300
    np.testing.assert_array_equal(clipped[0], np.array([3.0, 4.0]) * (1 / 1e300))
