"""global_norm and all_finite (``optaxclip.functional``): the numerical
contract of the one norm every clipper uses.

Orders, dtypes, range (overflow and underflow rescued, subnormal entries
counted), complex and non-float leaves, NaN/Inf propagation, derivatives
(finite at zero and at every magnitude, by a traced order too), compile-time
structure (leaves grouped), vmap and shard_map; property tests on random
trees. References: float64 numpy (``helpers.np_norm``) and JAX's own
derivatives.

Elsewhere: bad arguments in test_errors.py, optax's numbers in
test_parity.py, sharded trees in test_distributed.py.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fuzzing import ORDERS as FUZZ_ORDERS
from fuzzing import (
  Case,
  all_finite,
  cases,
  clippable,
  fuzz_settings,
  is_clippable,
  jitted_clip,
)
from helpers import KERNEL, ONE_PASS, np_norm, random_tree
from hypothesis import example, given
from hypothesis import strategies as st

import optaxclip as oc

F = oc.functional
ORDERS = [0.5, 1, 1.5, 2, 3, 7, math.inf, "inf"]


@pytest.mark.parametrize("ord", ORDERS)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_every_order_matches_float64(ord, scale):
  tree = random_tree(0, scale)
  expected = np_norm(jax.tree.leaves(tree), ord)
  np.testing.assert_allclose(F.global_norm(tree, ord), expected, rtol=2e-6)
  np.testing.assert_allclose(jax.jit(F.global_norm, static_argnums=1)(tree, ord),
                             expected, rtol=2e-6)


def test_absolute_values_for_odd_orders():
  # MindSpore 2.10's clip_by_norm(norm_type=1) sums signed values, gets 0 and
  # leaves this unclipped at max_norm=0.5; the 1-norm is 1.9.
  tree = [jnp.array([[-0.1, -0.25, -0.1], [0.1, 0.25, 0.1]]), jnp.array([-0.5, 0.5])]
  np.testing.assert_allclose(F.global_norm(tree, ord=1), 1.9, rtol=1e-6)
  np.testing.assert_allclose(F.global_norm(tree, ord=3),
                             np_norm(tree, 3), rtol=1e-6)
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
  expected = np_norm(tree, ord)
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
    clipped = jitted_clip(F.clip_by_norm, ord)(tree, max_norm)
    for before, after in zip(tree, clipped):
      leaf_norm = np_norm([before], ord)
      if max_norm / leaf_norm >= tiny:
        np.testing.assert_allclose(F.global_norm(after, ord),
                                   min(max_norm, leaf_norm), rtol=1e-5)


def test_overflow_mixed_with_ordinary_leaves():
  tree = {"huge": jnp.array([1e20, -2e20]), "small": jnp.ones(1000)}
  np.testing.assert_allclose(F.global_norm(tree), np_norm(jax.tree.leaves(tree), 2),
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


def test_python_float_leaves_count_in_the_norm():
  np.testing.assert_allclose(F.global_norm({"a": 3.0, "b": jnp.array(4.0), "i": 7}),
                             5.0)
  clipped, norm = F.clip_by_global_norm({"a": 3.0, "b": 4.0, "i": 7}, 1.0)
  np.testing.assert_allclose([clipped["a"], clipped["b"], norm], [0.6, 0.8, 5.0],
                             rtol=1e-6)
  assert clipped["i"] == 7


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


# --------------------------------------------------------------------------
# Compile time: small leaves of one dtype are reduced together

def many_leaf_tree(count, seed=0):
  """`count` small leaves of mixed shapes and dtypes: several groups each."""
  rng = np.random.default_rng(seed)
  shapes = [(7,), (3, 5), (64,), (2, 2, 2), (1,)]
  dtypes = [jnp.float32, jnp.bfloat16, jnp.float16]
  return [jnp.asarray(rng.normal(size=shapes[i % 5]), dtypes[i % 7 % 3])
          for i in range(count)]


@pytest.mark.parametrize("kernel", ["rescue", "one_pass"])
@pytest.mark.parametrize("ord", [2, 3])
def test_units_of_one_entry(kernel, ord, monkeypatch):
  # A unit of one entry: XLA returns a reduction of one element as it is,
  # without the reducer (the one-pass kernel reduces entries' bits, and
  # decodes them in its reducer: its results are decoded once more).
  monkeypatch.setenv("OPTAXCLIP_KERNEL", kernel)
  tree = [jnp.asarray([v], jnp.float32) for v in (-3.0, 2e-30, 5e30, 0.0, 1.5)]
  tree.append(jnp.asarray([[4.0], [-1e-30]], jnp.float32))  # two units of one
  clipped = jax.jit(lambda t: F.clip_by_norm(t, 0.5, ord=ord))(tree)
  for before, after in zip(tree[:-1], clipped[:-1]):
    expected = np.asarray(before, np.float64) * min(1.0, 0.5 / max(
        abs(float(before[0])), 1e-300))
    np.testing.assert_allclose(np.asarray(after, np.float64), expected, rtol=1e-6)
  per_row = jax.jit(lambda t: F.clip_by_norm(t, 0.5, ord=ord, layer_axis=0))(tree[-1])
  np.testing.assert_allclose(np.asarray(per_row, np.float64).ravel(), [0.5, -1e-30],
                             rtol=1e-6)


@pytest.mark.parametrize("ord", [1, 2, 3, math.inf])
def test_trees_of_several_groups_match_float64(ord, monkeypatch):
  # More leaves than one group holds (groups made small, so that the tree
  # compiles fast), of every dtype (float32: 2 full groups; bfloat16 and
  # float16: a full group and a part), plus one leaf that needs the rescue
  # (for p > 1) among them.
  monkeypatch.setattr(oc._core._batching, "GROUP_SIZE", 8)
  count = 4 * oc._core._batching.GROUP_SIZE + 5
  tree = many_leaf_tree(count)
  np.testing.assert_allclose(F.global_norm(tree, ord), np_norm(tree, ord),
                             rtol=2e-6)
  clipped = jax.jit(lambda t: F.clip_by_norm(t, 0.5, ord=ord))(tree)
  for before, after in zip(tree, clipped):
    norm = np_norm([before], ord)
    expected = np.asarray(before, np.float64) * min(1.0, 0.5 / norm)
    np.testing.assert_allclose(np.asarray(after, np.float64), expected,
                               rtol=1e-2 if before.dtype != jnp.float32 else 1e-5)
  # the same shapes and dtypes: the same program, now rescuing
  tree[count // 2] = jnp.full_like(tree[count // 2], 1e25)
  np.testing.assert_allclose(F.global_norm(tree, ord), np_norm(tree, ord),
                             rtol=2e-6)


def count_ops(fn, tree, op):
  """How many `op` instructions the lowered (unoptimised) program holds."""
  text = jax.jit(fn).lower(tree).as_text(dialect="hlo")
  return sum(f" {op}(" in line for line in text.splitlines())


@pytest.mark.parametrize("count", [300, 1200])
def test_program_grows_by_groups_not_by_leaves(count):
  # Compile time stays flat in the number of leaves because every group of
  # small leaves of one dtype (up to the layout's size) is one
  # concatenation and one reduction (the rescue: one more in the rarely
  # taken overflow branch; the one-pass kernel: one per level of its tree
  # of blocks, and one more tree for the groups' partials together), not
  # one reduction per leaf. Elementwise ops still scale with the leaves.
  if KERNEL in ("one_pass_gpu", "one_pass_tpu"):
    pytest.skip("the CPU's groups (a GPU's and a TPU's programs: test_deviceless)")
  tree = many_leaf_tree(count)
  layout = oc._core._batching.CPU
  by_dtype = {}
  for x in tree:
    by_dtype.setdefault(x.dtype, []).append(x.size)
  groups = [sizes[start:start + layout.size] for sizes in by_dtype.values()
            for start in range(0, len(sizes), layout.size)]
  assert len(groups) * 40 < count  # many leaves per group
  norm = lambda t: F.global_norm(t)
  concatenations = sum(len(g) > 1 for g in groups)
  if ONE_PASS:
    def levels(n):  # the reductions of a tree of blocks over n entries
      return 1 if n <= layout.block else 1 + levels(-(-n // layout.block))
    # each group's (exponent, sum) tree, then one over the groups' partials
    reductions = sum(levels(sum(g)) for g in groups) + levels(len(groups))
    concatenations += 2 * (len(groups) > 1)  # the partials' two columns
  else:
    reductions = 2 * len(groups)
  assert count_ops(norm, tree, "concatenate") == concatenations
  assert count_ops(norm, tree, "reduce") == reductions
  clip = lambda t: F.clip_by_global_norm(t, 1.0)
  assert count_ops(clip, tree, "reduce") == reductions


# --------------------------------------------------------------------------
# NaN and Inf for every order (issue 11, item 4)

GRID_ORDERS = [0.3, 0.5, 1, 1.5, 2, 3, 4, 10, math.inf]
BAD_VALUES = [math.nan, math.inf, -math.inf]


def scaled_numpy_norms(leaves, ord, *, total):
  """float64 norms of the stored values (``helpers.np_norm``: scaled by the
  largest |x|, so that no power overflows or underflows), of all leaves
  together or per leaf."""
  if total:
    return np.asarray(np_norm(leaves, ord))
  return np.asarray([np_norm([x], ord) for x in leaves])


TRACED = {True: jax.jit(lambda t, p: oc._core._norms.norm_of_leaves(t, p)),
          False: jax.jit(lambda t, p: oc._core._norms.unit_norms(t, p))}


def norms_of(leaves, ord, *, total, traced):
  """The library's norms, with the order static or traced (as injected)."""
  if traced:
    return TRACED[total](leaves, jnp.float32(ord))
  fn = oc._core._norms.norm_of_leaves if total else oc._core._norms.unit_norms
  return fn(leaves, ord)


def assert_nonfinite_like(norm, bad):
  if math.isnan(bad):
    assert np.isnan(norm), norm
  else:
    assert np.isposinf(norm), norm


def leaves_with(bad, where, other):
  """An f32, a bf16 and an fp16 leaf; ``bad`` in leaf ``where``, beside
  ``other`` (ordinary, or a magnitude that needs the rescue)."""
  dtypes = [jnp.float32, jnp.bfloat16, jnp.float16]
  big, small = {1e30: (1e30, 6e4), 1e-30: (1e-30, 1e-7)}.get(other,
                                                           (other, other))
  return [jnp.asarray([big if dtype != jnp.float16 else small,
                       bad if k == where else 1.0, -2.0], dtype)
          for k, dtype in enumerate(dtypes)]


@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("total", [True, False], ids=["global", "per_leaf"])
@pytest.mark.parametrize("ord", GRID_ORDERS)
def test_nan_and_inf_propagate_for_every_order(ord, total, traced):
  # 0 < p < 1 and traced orders used to mask `|x| > 0`, which NaN fails:
  # global_norm([1.0, nan], ord=0.5) was 1.0. The leaves are float32,
  # bfloat16 and float16; the bad value sits in each in turn, beside
  # ordinary values or ones that take the rescue.
  for where in range(3):
    for other in (1.0, 1e30, 1e-30):
      for bad in BAD_VALUES:
        leaves = leaves_with(bad, where, other)
        norms = np.asarray(norms_of(leaves, ord, total=total, traced=traced),
                           np.float64)
        assert_nonfinite_like(norms if total else norms[where], bad)
        if not total:  # the other leaves keep their finite norms
          for k in {0, 1, 2} - {where}:
            np.testing.assert_allclose(
                norms[k], scaled_numpy_norms(leaves[k:k + 1], ord, total=True),
                rtol=1e-5)
      leaves = leaves_with(math.inf, where, other)
      leaves[where] = leaves[where].at[2].set(math.nan)
      norms = norms_of(leaves, ord, total=total, traced=traced)
      assert np.isnan(norms if total else norms[where])


@pytest.mark.parametrize("ord", GRID_ORDERS)
def test_nan_propagates_through_every_norm_path(ord):
  grads = {"w": jnp.array([[1.0, 2.0], [jnp.nan, 0.5]]), "b": jnp.ones(2)}
  assert np.isnan(F.global_norm(grads, ord))
  clipped, norm = F.clip_by_global_norm(grads, 1.0, ord=ord)
  assert np.isnan(norm) and np.all(np.isnan(clipped["b"]))
  assert np.all(np.isnan(F.clip_by_norm(grads, 1.0, ord=ord)["w"]))
  examples = F.per_example_clip_by_global_norm(grads["w"], 1.0, ord=ord)
  assert np.isnan(examples.norms[1]) and np.isfinite(examples.norms[0])
  tx = optax.inject_hyperparams(oc.clip_by_global_norm)(max_norm=1.0, ord=ord)
  _, state = jax.jit(tx.update)(grads, tx.init(grads))
  assert np.isnan(state.inner_state.norm)
  assert int(state.inner_state.nonfinite_count) == 1


# --------------------------------------------------------------------------
# Derivatives: finite and right everywhere (issue 11, item 7)

def test_gradient_through_overflow_path_is_finite():
  tree = {"a": jnp.full(4, 1e20)}
  grads = jax.grad(lambda t: F.global_norm(t))(tree)
  np.testing.assert_allclose(grads["a"], np.full(4, 0.5), rtol=1e-5)


def analytic_gradient(x, ord, norm):
  """d norm / dx in float64: sign(x) (|x| / norm) ** (ord - 1); for inf,
  sign(x) at the largest |x| (shared by ties); 0 where x = 0."""
  x = np.asarray(x, np.float64)
  a = np.abs(x)
  if ord == math.inf:
    peak = a == a.max()
    return np.sign(x) * peak / peak.sum()
  with np.errstate(divide="ignore"):
    weights = np.where(a > 0, (a / norm) ** (ord - 1), 0.0)
  return np.sign(x) * weights


TRACED_GRADIENT = jax.jit(jax.grad(lambda t, p: oc._core._norms.norm_of_leaves(t, p)))
GRADIENT_MAGNITUDES = [0.0, 1e-40, 1e-30, 1e-20, 1.0, 6e4, 1e15, 1e20, 1e30,
                       1e38]


@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("ord", GRID_ORDERS)
def test_gradient_is_finite_and_right_at_every_magnitude(ord, traced):
  # Integer orders >= 3 used to give NaN at large entries (ord=3 at 1e20,
  # ord=4 at 1e15, ord=10 at 6e4): the overflowed plain sum's infinite
  # derivative met the zero cotangent of the branch not taken.
  shape = np.array([0.3, -1.0, 2.0, -0.7, 0.0, 1.5])
  fn = oc._core._norms.norm_of_leaves
  if traced:  # one program for every order
    grad = functools.partial(TRACED_GRADIENT, p=jnp.float32(ord))
  else:
    grad = jax.jit(jax.grad(lambda t: fn(t, ord)))
  for magnitude in GRADIENT_MAGNITUDES:
    x = np.asarray(shape * magnitude, np.float32)
    norm = scaled_numpy_norms([x], ord, total=True)
    if norm > np.finfo(np.float32).max:
      continue  # the norm itself is not a float32
    g = np.asarray(grad([jnp.asarray(x)])[0])
    assert np.all(np.isfinite(g)), (magnitude, g)
    if magnitude == 0:
      np.testing.assert_array_equal(g, np.zeros_like(g))
      continue
    expected = analytic_gradient(x, ord, norm)
    np.testing.assert_allclose(g, expected, rtol=2e-5,
                               atol=1e-6 * np.abs(expected).max(),
                               err_msg=f"magnitude {magnitude}")


@pytest.mark.parametrize("ord", [0.3, 1.5, 3.0, 7.5])
def test_derivative_by_a_traced_order(ord):
  # d norm / d p = norm / p * sum r**p log r, r = |x| / norm.
  x = np.asarray([0.3, -1.0, 2.0, 0.0, 1e-30], np.float32)
  norm = lambda q: scaled_numpy_norms([x], q, total=True)  # noqa: E731
  expected = (norm(ord + 1e-6) - norm(ord - 1e-6)) / 2e-6
  got = jax.jit(jax.grad(lambda p: oc._core._norms.norm_of_leaves(
      [jnp.asarray(x)], p)))(jnp.float32(ord))
  np.testing.assert_allclose(got, expected, rtol=1e-4)


@pytest.mark.parametrize("ord", [0.5, 1, 2, 3, 10, math.inf])
def test_per_leaf_and_per_example_gradients_are_right(ord):
  leaves = [jnp.asarray([1e20, -3e19, 0.0]), jnp.asarray([[2.0, -1.0]]),
            jnp.asarray([1e-30, 3e-30])]
  total_grad = jax.grad(lambda t: jnp.sum(oc._core._norms.unit_norms(t, ord)))(leaves)
  for x, g in zip(leaves, total_grad):
    norm = scaled_numpy_norms([x], ord, total=True)
    np.testing.assert_allclose(g, analytic_gradient(x, ord, norm).reshape(
        x.shape), rtol=2e-5, atol=1e-7)
  rows = jnp.asarray([[1e20, -3e19], [2.0, -1.0], [0.0, 0.0]])
  grad = jax.grad(lambda r: jnp.sum(
      F.per_example_clip_by_global_norm([r], 1.0, ord=ord).norms))(rows)
  for x, g in zip(np.asarray(rows), np.asarray(grad)):
    norm = scaled_numpy_norms([x], ord, total=True)
    expected = analytic_gradient(x, ord, norm) if norm else np.zeros(2)
    np.testing.assert_allclose(g, expected, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("ord", [1, 2, 3, 0.5])
def test_gradient_of_complex_leaves_matches_jax(ord):
  z = jnp.asarray([3 + 4j, -1j, 0j, 2e20 - 1e20j], jnp.complex64)
  ours = jax.grad(lambda z: F.global_norm([z], ord))(z)
  with jax.enable_x64(True):  # JAX's own derivative, where nothing overflows
    wide = jnp.asarray(z, jnp.complex128)
    reference = jax.grad(lambda z: jnp.sum(jnp.abs(z) ** ord) ** (1 / ord))(
        wide.at[2].set(1e-300))  # |0| has no derivative; our convention is 0
    reference = np.asarray(reference.at[2].set(0))
  np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-7)


def losses_through_every_clipper(t, p):
  """A loss through each functional clipper, for the order ``p``; the norm
  clippers with Optax's ``eps=0`` and PyTorch's ``eps=1e-6``."""
  losses = {
      "global_norm": F.global_norm(t, p),
      "per_example": jnp.sum(F.per_example_clip_by_global_norm(
          t["b"], 1.0, ord=p).summed),
      "clip_by_value": jnp.sum(F.clip_by_value(t, 1.0)["a"]),
  }
  for eps in (0.0, 1e-6):
    losses[f"clip_by_global_norm(eps={eps})"] = jnp.sum(
        F.clip_by_global_norm(t, 1.0, ord=p, eps=eps)[0]["a"])
    losses[f"clip_by_norm(eps={eps})"] = jnp.sum(F.clip_by_norm(t, 1.0, ord=p, eps=eps)["a"])
  return losses


def gradients_through_every_clipper(t, p):
  return {name: jax.grad(lambda t: losses_through_every_clipper(t, p)[name])(t)
          for name in losses_through_every_clipper(t, p)}


# A traced order compiles once for every order of the grid.
TRACED_GRADIENTS = jax.jit(gradients_through_every_clipper)


@pytest.mark.parametrize("ord", [*GRID_ORDERS, 7, "inf"])
@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
def test_gradient_through_every_clipper_is_finite_at_zero(ord, traced):
  zeros = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2), jnp.bfloat16)}
  if traced:
    grads = TRACED_GRADIENTS(zeros, jnp.float32(ord))
  else:  # the order a Python number, each its own program
    grads = jax.jit(lambda t: gradients_through_every_clipper(t, ord))(zeros)
  for name, grad in grads.items():
    assert all(np.all(np.isfinite(np.asarray(g, np.float32)))
               for g in jax.tree.leaves(grad)), name
  if traced:
    tx = optax.inject_hyperparams(oc.clip_by_global_norm)(max_norm=1.0,
                                                          ord=ord)
    # the order in the state: one program for every order
    grads = jax.jit(jax.grad(lambda t, state: jnp.sum(tx.update(t, state)[0]["a"])))(
        zeros, tx.init(zeros))
    assert all(np.all(np.isfinite(np.asarray(g, np.float32)))
               for g in jax.tree.leaves(grads))


# --------------------------------------------------------------------------
# Subnormal entries (issue 11, item 10), large orders, vmap and shard_map

SUBNORMAL_ORDERS = [0.5, 1, 2, 3]


def subnormal_cases(dtype):
  """Leaves of subnormal values of ``dtype`` (as read by numpy, exactly)."""
  tiny = float(jnp.finfo(dtype).tiny)
  return [
      [jnp.full((10,), tiny / 1e2, dtype)],  # all subnormal
      [jnp.asarray([tiny / 3, -tiny / 7, 0.0], dtype),
       jnp.full((4,), tiny / 50, dtype)],
      # A normal entry beside subnormal ones: for p < 1 they still count.
      [jnp.asarray([tiny * 4, tiny / 2, tiny / 2, tiny / 2], dtype)],
  ]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16,
                                   jnp.complex64])
@pytest.mark.parametrize("ord", SUBNORMAL_ORDERS)
def test_subnormal_entries_count(dtype, ord):
  # global_norm([1e-40] * 10) was 0: XLA:CPU reads subnormals as 0.
  real = jnp.float32 if dtype == jnp.complex64 else dtype
  leaves = [x for case in subnormal_cases(real) for x in case]
  if dtype == jnp.complex64:  # built by numpy, which keeps subnormals
    leaves = [jnp.asarray((np.asarray(x) * (0.6 - 0.8j)).astype(np.complex64))
              for x in leaves]
  for tree, total in ((leaves, False), (leaves, True), (leaves[:1], True)):
    for traced in (False, True):
      norms = np.asarray(norms_of(tree, ord, total=total, traced=traced),
                         np.float64)
      expected = scaled_numpy_norms(tree, ord, total=total)
      assert np.all(norms > 0), norms
      # The result may itself be subnormal: exact to its last bit.
      np.testing.assert_allclose(norms, expected, rtol=1e-5, atol=2.0 ** -148)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.complex64])
def test_infinity_norm_of_subnormal_entries(dtype):
  # A maximum is exact, read from the bits of real entries (issue 32: the
  # largest of entries all below the normal range read as 0 on XLA:CPU).
  # The documented limit left: complex entries' moduli, where subnormals
  # are flushed.
  real = jnp.float32 if dtype == jnp.complex64 else dtype
  tiny = float(jnp.finfo(real).tiny)
  for values, flushable in (([tiny / 3, -tiny / 7], True),
                            ([tiny * 2, tiny / 3], False)):
    leaf = jnp.asarray(np.asarray(values, np.float64).astype(
        np.dtype(dtype)) * (1j if dtype == jnp.complex64 else 1))
    norm = F.global_norm([leaf], "inf")
    expected = scaled_numpy_norms([leaf], math.inf, total=True)
    norm = np.asarray(norm)  # numpy compares subnormals as they are
    assert norm == np.float32(expected) or (
        flushable and dtype == jnp.complex64 and norm == 0), norm


def test_subnormal_entries_count_under_x64():
  with jax.enable_x64(True):
    tiny = float(np.finfo(np.float64).tiny)
    leaves = [jnp.full((10,), tiny / 1e6, jnp.float64),
              jnp.asarray([tiny / 3, 0.0], jnp.float64)]
    for ord in SUBNORMAL_ORDERS:
      for total in (True, False):
        norms = np.asarray(norms_of(leaves, ord, total=total, traced=False))
        assert norms.dtype == np.float64
        np.testing.assert_allclose(norms, scaled_numpy_norms(
            leaves, ord, total=total), rtol=1e-12, atol=2.0 ** -1073)


@pytest.mark.parametrize("ord", [1, 2, 3, math.inf])
def test_vmap_decides_the_rescue_once_for_the_batch(ord):
  # One example's squares overflow, another's underflow, two need nothing:
  # the rescue runs once for all (a conditional, not a select that would
  # run it for every example on every step) and every norm is right.
  rng = np.random.default_rng(9)
  x = rng.normal(size=(4, 5, 3)) * np.asarray([1.0, 1e25, 1e-25, 3.0])[:, None, None]
  x = jnp.asarray(x, jnp.float32)
  norm = functools.partial(F.global_norm, ord=ord)
  batched = jax.jit(jax.vmap(norm))
  if ord != math.inf and not ONE_PASS:  # maxima need no rescue
    assert "conditional" in batched.lower(x).compile().as_text()
  want = [np.linalg.norm(np.asarray(row, np.float64).ravel(), ord) for row in x]
  np.testing.assert_allclose(batched(x), want, rtol=2e-6)
  # Gradients and tangents through the batched decision: as example by example.
  grads = jax.grad(lambda t: jnp.sum(jax.vmap(norm)(t)))(x)
  _, tangents = jax.jvp(jax.vmap(norm), (x,), (jnp.ones_like(x),))
  for i, row in enumerate(x):
    np.testing.assert_allclose(grads[i], jax.grad(norm)(row), rtol=1e-6)
    np.testing.assert_allclose(tangents[i], jax.jvp(norm, (row,), (jnp.ones_like(row),))[1],
                               rtol=1e-6)


@pytest.mark.parametrize("ord", [100, 200, 1000, 1e5])
def test_large_orders(ord):
  # Orders above 126 used to give 0: the rescaled largest entry (in
  # [0.5, 1)) was raised to a power below float32's range.
  leaves = [jnp.asarray([0.5, 0.3, -0.49]), jnp.asarray([3e-20, 1e-20])]
  for total in (True, False):
    np.testing.assert_allclose(norms_of(leaves, ord, total=total, traced=False),
                               scaled_numpy_norms(leaves, ord, total=total),
                               rtol=1e-6)
  np.testing.assert_allclose(
      norms_of(leaves, ord, total=True, traced=True),
      scaled_numpy_norms(leaves, ord, total=True), rtol=1e-6)


@pytest.mark.parametrize("ord", [1, 2, 3, 0.5, math.inf])
def test_gradient_under_shard_map_matches_the_whole_tree(ord):
  # The derivative's partial sums travel as the norm's do: one psum, each
  # replicated leaf counted once.
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(3)
  split = [jnp.asarray(rng.normal(size=(8, 4)) * s, jnp.float32)
           for s in (1.0, 1e20)]
  replicated = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
  specs = [P("i"), P("i"), P()]

  def norm(split, replicated, **kwargs):
    return F.global_norm([*split, replicated], ord, **kwargs)

  sharded = jax.jit(jax.shard_map(
      jax.grad(functools.partial(norm, axis_name="i", specs=specs),
               argnums=(0, 1)),
      mesh=mesh, in_specs=(specs[:2], P()), out_specs=(specs[:2], P())))
  got = jax.tree.leaves(sharded(split, replicated))
  expected = jax.tree.leaves(jax.grad(norm, argnums=(0, 1))(split, replicated))
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------
# Random trees (hypothesis): the true norm, NaN/Inf kept, finite gradients

@fuzz_settings(100)
@example(case=Case("f32", [np.array([1.0, 0, 0, 0, 0]), np.zeros((2, 2))], "nan",
                   (0, 1)), ord=0.5)  # issue 11, item 4
@given(case=cases(), ord=st.sampled_from(FUZZ_ORDERS))
def test_global_norm_is_the_true_norm_and_propagates_nan_inf(case, ord):
  tree = case.tree(inject=True)
  norm = float(F.global_norm(tree, ord))
  values = clippable(tree)
  if any(np.any(np.isnan(v)) for v in values):
    assert math.isnan(norm), f"NaN vanished from the {ord}-norm: {norm}"
  elif not all_finite(tree):
    assert norm == math.inf, f"Inf vanished from the {ord}-norm: {norm}"
  else:
    want = np_norm(values, ord)
    assert abs(norm - want) <= 2e-5 * want + 1e-36, (norm, want)
  assert bool(F.all_finite(tree)) == all_finite(tree)


@fuzz_settings(25)
@given(case=cases(templates=("mixed", "f32", "bf16")), ord=st.sampled_from(FUZZ_ORDERS))
def test_global_norm_gradient_is_finite(case, ord):
  tree = case.tree()
  gradient = jax.grad(lambda t: F.global_norm(t, ord))(
      jax.tree.map(lambda x: x if is_clippable(x) else None, tree))
  assert all_finite(gradient), f"NaN/Inf in the gradient of the {ord}-norm"
