"""The numerical contract of the norm: orders, dtypes, range, shape of trees."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip as oc

F = oc.functional
ORDERS = [0.5, 1, 1.5, 2, 3, 7, math.inf, "inf"]


def numpy_norm(leaves, ord):
  """The reference: float64 numpy over the values as stored."""
  flat = np.concatenate([np.abs(np.asarray(x, np.complex128)).ravel()
                         for x in leaves])
  if ord in (math.inf, "inf"):
    return flat.max(initial=0.0)
  return float(np.sum(flat ** ord) ** (1 / ord))


def random_tree(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(4, 5)) * scale, jnp.float32),
          "b": jnp.asarray(rng.normal(size=(5,)) * scale, jnp.float32),
          "layers": [jnp.asarray(rng.normal(size=(2, 3, 4)) * scale, jnp.float32)]}


@pytest.mark.parametrize("ord", ORDERS)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_every_order_matches_float64(ord, scale):
  tree = random_tree(0, scale)
  expected = numpy_norm(jax.tree.leaves(tree), ord)
  np.testing.assert_allclose(F.global_norm(tree, ord), expected, rtol=2e-6)
  np.testing.assert_allclose(jax.jit(F.global_norm, static_argnums=1)(tree, ord),
                             expected, rtol=2e-6)


@pytest.mark.parametrize("ord", ORDERS)
def test_per_leaf_norms_clip_each_leaf(ord):
  tree = random_tree(1)
  clipped = F.clip_by_norm(tree, 0.5, ord=ord)
  for before, after in zip(jax.tree.leaves(tree), jax.tree.leaves(clipped)):
    norm = numpy_norm([before], ord)
    np.testing.assert_allclose(after, before * min(1.0, 0.5 / norm), rtol=1e-5)


def test_absolute_values_for_odd_orders():
  # MindSpore 2.10's clip_by_norm(norm_type=1) sums signed values, gets 0 and
  # leaves this unclipped at max_norm=0.5; the 1-norm is 1.9.
  tree = [jnp.array([[-0.1, -0.25, -0.1], [0.1, 0.25, 0.1]]), jnp.array([-0.5, 0.5])]
  np.testing.assert_allclose(F.global_norm(tree, ord=1), 1.9, rtol=1e-6)
  np.testing.assert_allclose(F.global_norm(tree, ord=3),
                             numpy_norm(tree, 3), rtol=1e-6)
  clipped, norm = F.clip_by_global_norm(tree, 0.5, ord=1)
  assert F.global_norm(clipped, ord=1) <= 0.5 * (1 + 1e-6)


def test_float16_squares_do_not_overflow():
  tree = [jnp.full((1000,), 300.0, jnp.float16)]
  norm = F.global_norm(tree)
  assert norm.dtype == jnp.float32
  np.testing.assert_allclose(norm, 300.0 * math.sqrt(1000), rtol=1e-6)  # 9486.8
  clipped, _ = F.clip_by_global_norm(tree, 1.0)
  assert clipped[0].dtype == jnp.float16
  np.testing.assert_allclose(clipped[0].astype(np.float32), 1 / math.sqrt(1000),
                             rtol=1e-3)


@pytest.mark.parametrize("ord", [1, 2, 3, 0.5])
@pytest.mark.parametrize("value", [1e20, 1e30, 3e37, 1e-30, 1e-37])
def test_overflow_and_underflow_safe(value, ord):
  # optax and PyTorch return inf for ten 1e20s and zero the whole update.
  tree = [jnp.full((10,), value, jnp.float32), jnp.full((3,), value / 2, jnp.float32)]
  expected = numpy_norm(tree, ord)
  norm = jax.jit(F.global_norm, static_argnums=1)(tree, ord)
  if expected > float(np.finfo(np.float32).max):
    assert np.isposinf(norm)  # the true norm is beyond float32
    return
  np.testing.assert_allclose(norm, expected, rtol=1e-5)
  tiny = float(np.finfo(np.float32).tiny)
  for max_norm in (1.0, 1e-3):
    clipped, _ = F.clip_by_global_norm(tree, max_norm, ord=ord)
    if max_norm / expected < tiny:  # the factor itself is not a normal float
      assert all(np.all(np.asarray(x) == 0) for x in clipped)
    elif expected > max_norm:
      np.testing.assert_allclose(F.global_norm(clipped, ord), max_norm, rtol=1e-5)
    clipped = jax.jit(lambda t: F.clip_by_norm(t, max_norm, ord=ord))(tree)
    for before, after in zip(tree, clipped):
      leaf_norm = numpy_norm([before], ord)
      if max_norm / leaf_norm >= tiny:
        np.testing.assert_allclose(F.global_norm(after, ord),
                                   min(max_norm, leaf_norm), rtol=1e-5)


def test_overflow_mixed_with_ordinary_leaves():
  tree = {"huge": jnp.array([1e20, -2e20]), "small": jnp.ones(1000)}
  np.testing.assert_allclose(F.global_norm(tree), numpy_norm(jax.tree.leaves(tree), 2),
                             rtol=1e-6)
  clipped = F.clip_by_norm(tree, 1.0)
  np.testing.assert_allclose(F.global_norm(clipped["huge"]), 1.0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_norm_of_millions_matches_float64(dtype):
  values = np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32)
  leaf = jnp.asarray(values, dtype)
  expected = np.sqrt(np.sum(np.asarray(leaf, np.float64) ** 2))
  rel = abs(float(jax.jit(F.global_norm)([leaf])) - expected) / expected
  assert rel < 1e-6, rel  # optax.global_norm: 2.7e-3 for bf16


def test_float32_norm_of_many_elements_matches_float64():
  values = np.random.default_rng(1).standard_normal(10_000_000).astype(np.float32)
  expected = np.sqrt(np.sum(values.astype(np.float64) ** 2))
  rel = abs(float(jax.jit(F.global_norm)([jnp.asarray(values)])) - expected) / expected
  assert rel < 1e-6, rel


def test_complex_leaves_use_modulus():
  tree = [jnp.array([3 + 4j, 1j], jnp.complex64), jnp.array([2.0])]
  np.testing.assert_allclose(F.global_norm(tree), math.sqrt(25 + 1 + 4), rtol=1e-6)
  np.testing.assert_allclose(F.global_norm(tree, ord=1), 8.0, rtol=1e-6)
  np.testing.assert_allclose(F.global_norm(tree, ord="inf"), 5.0, rtol=1e-6)
  clipped, _ = F.clip_by_global_norm(tree, 1.0)
  assert clipped[0].dtype == jnp.complex64
  np.testing.assert_allclose(F.global_norm(clipped), 1.0, rtol=1e-6)


def test_non_float_leaves_pass_through_and_are_excluded():
  tree = {"w": jnp.array([3.0, 4.0]), "step": jnp.array(1000, jnp.int32),
          "mask": jnp.array([True, False]), "none": None,
          "masked": optax.MaskedNode()}
  assert F.global_norm(tree) == 5.0
  clipped, norm = F.clip_by_global_norm(tree, 1.0)
  assert norm == 5.0
  assert clipped["step"] is tree["step"] and clipped["mask"] is tree["mask"]
  assert clipped["none"] is None and isinstance(clipped["masked"], optax.MaskedNode)
  np.testing.assert_allclose(clipped["w"], [0.6, 0.8], rtol=1e-6)
  assert F.clip_by_value(tree, 1.0)["step"] is tree["step"]
  assert F.clip_by_norm(tree, 1.0)["mask"] is tree["mask"]


@pytest.mark.parametrize("ord", ORDERS)
def test_zeros_empty_and_zero_threshold_are_finite(ord):
  zeros = {"a": jnp.zeros((3, 2)), "b": jnp.zeros(0)}
  for tree in (zeros, {}, [], {"a": None}):
    norm = F.global_norm(tree, ord)
    assert norm == 0 and norm.dtype == jnp.float32
  for max_norm in (0.0, 1.0):
    clipped, norm = F.clip_by_global_norm(zeros, max_norm, ord=ord)
    assert norm == 0
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(clipped))
  clipped, _ = F.clip_by_global_norm({"a": jnp.ones(3)}, 0.0, ord=ord)
  np.testing.assert_array_equal(clipped["a"], np.zeros(3))
  assert F.all_finite(F.clip_by_norm({"a": jnp.ones(3)}, 0.0, ord=ord))


@pytest.mark.parametrize("ord", ORDERS)
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_gradient_through_clippers_is_finite_at_zero(ord, eps):
  zeros = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2))}
  losses = {
      "clip_by_global_norm":
          lambda t: jnp.sum(F.clip_by_global_norm(t, 1.0, ord=ord, eps=eps)[0]["a"]),
      "clip_by_norm": lambda t: jnp.sum(F.clip_by_norm(t, 1.0, ord=ord, eps=eps)["a"]),
      "global_norm": lambda t: F.global_norm(t, ord),
      "clip_by_value": lambda t: jnp.sum(F.clip_by_value(t, 1.0)["a"]),
  }
  for name, loss in losses.items():
    grads = jax.jit(jax.grad(loss))(zeros)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads)), name


def test_gradient_through_overflow_path_is_finite():
  tree = {"a": jnp.full(4, 1e20)}
  grads = jax.grad(lambda t: F.global_norm(t))(tree)
  np.testing.assert_allclose(grads["a"], np.full(4, 0.5), rtol=1e-5)


def test_float64_under_x64_keeps_float64():
  with jax.enable_x64(True):
    tree = [jnp.array([3.0, 4.0], jnp.float64)]
    assert F.global_norm(tree).dtype == jnp.float64
    assert F.global_norm([jnp.ones(2, jnp.float32)]).dtype == jnp.float32


def test_all_finite():
  assert F.all_finite({})
  assert F.all_finite({"a": jnp.ones(3), "i": jnp.arange(3)})
  assert not F.all_finite({"a": jnp.array([1.0, jnp.inf])})
  assert not jax.jit(F.all_finite)([jnp.array([jnp.nan], jnp.bfloat16)])


def test_nan_and_inf_propagate_through_the_norm():
  assert np.isnan(F.global_norm([jnp.array([1.0, jnp.nan])]))
  assert np.isinf(F.global_norm([jnp.array([1.0, jnp.inf])]))
  assert np.isnan(F.global_norm([jnp.array([jnp.inf, jnp.nan])]))
  assert np.isinf(F.global_norm([jnp.array([1.0, -jnp.inf])], ord=1))


def many_leaf_tree(count, seed=0):
  """`count` small leaves of mixed shapes and dtypes: several groups each."""
  rng = np.random.default_rng(seed)
  shapes = [(7,), (3, 5), (64,), (2, 2, 2), (1,)]
  dtypes = [jnp.float32, jnp.bfloat16, jnp.float16]
  return [jnp.asarray(rng.normal(size=shapes[i % 5]), dtypes[i % 7 % 3])
          for i in range(count)]


@pytest.mark.parametrize("ord", [1, 2, 3, math.inf])
def test_trees_of_several_groups_match_float64(ord):
  # More leaves than one group holds, of every dtype, plus one leaf that
  # needs the rescue (for p > 1) among them.
  count = 2 * oc._norms.GROUP_SIZE + 37
  tree = many_leaf_tree(count)
  np.testing.assert_allclose(F.global_norm(tree, ord), numpy_norm(tree, ord),
                             rtol=2e-6)
  clipped = jax.jit(lambda t: F.clip_by_norm(t, 0.5, ord=ord))(tree)
  for before, after in zip(tree, clipped):
    norm = numpy_norm([before], ord)
    expected = np.asarray(before, np.float64) * min(1.0, 0.5 / norm)
    np.testing.assert_allclose(np.asarray(after, np.float64), expected,
                               rtol=1e-2 if before.dtype != jnp.float32 else 1e-5)
  tree[count // 2] = jnp.full((3,), 1e25, jnp.float32)
  np.testing.assert_allclose(F.global_norm(tree, ord), numpy_norm(tree, ord),
                             rtol=2e-6)


def count_ops(fn, tree, op):
  """How many `op` instructions the lowered (unoptimised) program holds."""
  text = jax.jit(fn).lower(tree).as_text(dialect="hlo")
  return sum(f" {op}(" in line for line in text.splitlines())


@pytest.mark.parametrize("count", [300, 1200])
def test_program_grows_by_groups_not_by_leaves(count):
  # Compile time stays flat in the number of leaves because every group of
  # up to GROUP_SIZE small leaves of one dtype is one concatenation and one
  # reduction (and one more in the rarely taken overflow branch), not one
  # reduction per leaf. Elementwise ops still scale with the leaves.
  tree = many_leaf_tree(count)
  sizes = [sum(x.dtype == dtype for x in tree) for dtype in {x.dtype for x in tree}]
  limit = oc._norms.GROUP_SIZE
  groups = [min(limit, n - start) for n in sizes for start in range(0, n, limit)]
  assert len(groups) * 40 < count  # many leaves per group
  norm = lambda t: F.global_norm(t)
  assert count_ops(norm, tree, "concatenate") == sum(g > 1 for g in groups)
  assert count_ops(norm, tree, "reduce") == 2 * len(groups)
  clip = lambda t: F.clip_by_global_norm(t, 1.0)
  assert count_ops(clip, tree, "reduce") == 2 * len(groups)
