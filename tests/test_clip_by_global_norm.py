"""clip_by_global_norm (the transform and ``functional.clip_by_global_norm``):
its numbers, its options and its state.

- the clip's invariants on random trees (hypothesis);
- non-finite gradients: ``nonfinite="propagate"`` (as optax and PyTorch),
  ``"zero"`` and ``"raise"`` (naming the leaves), an inf threshold;
- ``use_norm``: clipping by a norm measured beforehand (TensorFlow's
  ``use_norm``, PyTorch's ``clip_grads_with_norm_``);
- ``leaf_norms`` and ``layer_axis``: the norm of every leaf, or of every
  layer of a stacked leaf, kept in the state (``clip_grad_norm`` takes the
  same options: the cases run for both);
- ``groups``: each group of leaves clipped by its own global norm.

References: float64 numpy, optax, and one clipper per group on the group's
own sub-tree. Elsewhere: the contract every transform keeps
(test_contract.py), bad arguments (test_errors.py), traced, inf and Python
float arguments (test_arguments.py), golden and live values of PyTorch,
TensorFlow and optax (test_parity.py), sharded gradients
(test_distributed.py), random trees (test_fuzz.py), float64 (test_x64.py).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FLOAT_DTYPES
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
  assert_norm_tree,
  bad_grads,
  expected_norm_tree,
  f64,
  named_leaves,
  norm_of_named,
  np_factor,
  np_leaf_norm,
  run,
  stacked_gradients,
  ulps,
)
from hypothesis import given
from hypothesis import strategies as st

import optaxclip as oc

F = oc.functional
ORDS = [1, 2, 3, math.inf]


# --------------------------------------------------------------------------
# The clip's invariants

@SMALL_SETTINGS
@given(small_trees(), thresholds, st.sampled_from(SMALL_ORDERS),
       st.sampled_from([0.0, 1e-6]))
def test_global_clip_bounds_norm_keeps_direction_and_is_a_no_op_below(tree, max_norm, ord, eps):
  clip = jitted_clip(F.clip_by_global_norm, ord, eps=eps)
  clipped, norm = clip(tree, max_norm)
  after = jitted_norm(ord)(clipped)
  assert after <= max_norm * (1 + 1e-6) + 1e-30
  if norm + eps <= max_norm:
    for a, b in zip(clipped, tree):
      np.testing.assert_array_equal(a, b)
  factor = min(1.0, max_norm / (float(norm) + eps)) if norm > 0 else 1.0
  for a, b in zip(clipped, tree):  # one common factor: direction preserved
    np.testing.assert_allclose(a, np.asarray(b) * factor, rtol=2e-6, atol=1e-37)


# --------------------------------------------------------------------------
# Non-finite gradients: propagate (as the references), zero, or raise

def test_propagate_matches_optax_on_nan():
  grads = bad_grads()
  ours, state = oc.clip_by_global_norm(1.0).update(grads, oc.clip_by_global_norm(1.0).init(grads))
  theirs, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.isnan(a), np.isnan(b)),
               ours, theirs)
  assert np.isnan(state.norm) and int(state.nonfinite_count) == 1
  assert int(state.clipped_count) == 0


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


def test_raise_under_vmap_only_fires_for_bad_examples():
  tx = oc.clip_by_global_norm(1.0, nonfinite="raise")
  batch = jnp.ones((4, 3))
  out, _ = jax.vmap(lambda g: tx.update(g, tx.init(g)))(batch)
  np.testing.assert_allclose(out, np.full((4, 3), 1 / np.sqrt(3)), rtol=1e-6)
  with pytest.raises(RuntimeError):
    jax.block_until_ready(jax.vmap(lambda g: tx.update(g, tx.init(g)))(
        batch.at[2, 1].set(jnp.nan)))


@pytest.mark.parametrize("ord", [0.3, 0.5, 0.9])
def test_nonfinite_guards_trigger_for_fractional_ord(ord):
  grads = {"w": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2)}
  tx = oc.clip_grad_norm(1.0, norm_type=ord, error_if_nonfinite=True)
  with pytest.raises(RuntimeError, match=r"\['w'\]"):
    jax.block_until_ready(jax.jit(tx.update)(grads, tx.init(grads)))
  tx = oc.clip_by_global_norm(1.0, ord=ord, nonfinite="raise")
  with pytest.raises(RuntimeError, match=r"\['w'\]"):
    jax.block_until_ready(jax.jit(tx.update)(grads, tx.init(grads)))
  tx = oc.clip_by_global_norm(1.0, ord=ord, nonfinite="zero")
  out, state = jax.jit(tx.update)(grads, tx.init(grads))
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert int(state.nonfinite_count) == 1


@pytest.mark.parametrize("make", [
    lambda: oc.clip_by_global_norm(1.0, nonfinite="raise"),
    lambda: oc.clip_by_global_norm(1.0, nonfinite="raise", leaf_norms=True),
    lambda: oc.clip_by_norm(1.0, nonfinite="raise", layer_axis=0),
    lambda: oc.clip_grad_norm(1.0, error_if_nonfinite=True)],
    ids=["global", "leaf_norms", "per_layer", "grad_norm"])
def test_nonfinite_raise_names_only_the_leaves_that_hold_it(make):
  # Not the clipped leaves: a NaN factor makes every one of them NaN.
  bad = {"decoder": jnp.ones((2, 2)), "encoder": jnp.array([[1.0, jnp.nan]])}
  tx = make()
  with pytest.raises(oc.NonFiniteGradientError,
                     match=r"Leaves holding NaN or Inf: \['encoder'\]\. Pass"):
    tx.update(bad, tx.init(bad))


@pytest.mark.parametrize("max_norm", [-1.0, math.nan])
def test_traced_negative_max_norm_never_flips_the_update(max_norm):
  # The issue's own case: inject_hyperparams(clip_by_global_norm)(-1.0).
  grads = {"w": jnp.array([[0.3, -0.4], [0.5, 0.1]]), "b": jnp.array([-0.2, 0.6])}
  tx = optax.inject_hyperparams(oc.clip_by_global_norm)(max_norm=1.0)
  state = tx.init(grads)
  state.hyperparams["max_norm"] = jnp.float32(max_norm)
  out, _ = jax.jit(tx.update)(grads, state)
  for x, g in zip(jax.tree.leaves(out), jax.tree.leaves(grads)):
    assert np.all(np.asarray(x) * np.asarray(g) >= 0)  # no sign flip
    np.testing.assert_array_equal(x, 0)


FINITE = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}
WITH_INF = {"w": jnp.array([3.0, jnp.inf]), "b": jnp.array([12.0])}


@pytest.mark.parametrize("name,ours", [
    ("clip_by_global_norm", lambda g: F.clip_by_global_norm(g, math.inf)[0]),
    ("transform", lambda g: oc.clip_by_global_norm(math.inf).update(g, None)[0]),
    ("clip_grad_norm", lambda g: oc.clip_grad_norm(math.inf).update(g, None)[0]),
])
def test_inf_threshold_on_inf_gradients_matches_optax_and_torch(name, ours):
  # torch.nn.utils.clip_grad_norm_(max_norm=inf) on an Inf gradient: the
  # coefficient inf / (inf + 1e-6) is NaN and every gradient becomes NaN
  # (torch 2.13 prints tensor([nan, nan])); optax.clip_by_global_norm(inf)
  # gives NaN everywhere too. The norm is Inf, the step is counted.
  del name
  reference, _ = optax.clip_by_global_norm(math.inf).update(WITH_INF, None)
  out = ours(WITH_INF)
  for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(reference)):
    assert np.all(np.isnan(x)) and np.all(np.isnan(y))
  for value in (1.0, math.inf):  # finite gradients: as optax
    reference, _ = optax.clip_by_global_norm(value).update(FINITE, None)
    ours_finite = F.clip_by_global_norm(FINITE, value)[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 ours_finite, reference)


def test_inf_threshold_counts_a_nonfinite_step():
  tx = oc.clip_by_global_norm(math.inf)
  _, state = tx.update(WITH_INF, tx.init(WITH_INF))
  assert float(state.norm) == math.inf
  assert int(state.nonfinite_count) == 1 and int(state.clipped_count) == 0


# --------------------------------------------------------------------------
# use_norm: the factor is ``max_norm / use_norm`` (``max_norm / (use_norm +
# eps)``), computed once, and nothing is reduced. The references' own
# numbers are in test_parity.py (golden and live).

def use_norm_tree(dtype=jnp.float32, seed=0, scale=1.0):
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
def test_use_norm_true_norm_gives_the_same_result_as_measuring(seed, scale, max_norm, eps):
  tree = use_norm_tree(seed=seed, scale=scale)
  measured, norm = F.clip_by_global_norm(tree, max_norm, eps=eps)
  given, returned = F.clip_by_global_norm(tree, max_norm, eps=eps,
                                          use_norm=F.global_norm(tree))
  np.testing.assert_array_equal(returned, norm)
  jax.tree.map(np.testing.assert_array_equal, given, measured)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("use_norm", [0.0, 0.3, 1.0, 7.5, 1e30])
def test_use_norm_factor_is_max_norm_over_the_given_norm(use_norm, eps):
  tree = use_norm_tree()
  max_norm = 1.0
  clipped, returned = F.clip_by_global_norm(tree, max_norm, eps=eps,
                                            use_norm=use_norm)
  factor = expected_factor(max_norm, use_norm, eps)
  assert returned.dtype == jnp.float32 and returned == np.float32(use_norm)
  jax.tree.map(lambda got, x: np.testing.assert_array_equal(
      got, np.asarray(x) * factor), clipped, tree)


def test_use_norm_tree_is_not_reduced():
  # A NaN in the tree would make a measured norm NaN; the given one is used.
  tree = [jnp.array([jnp.nan, 3.0]), jnp.array([4.0])]
  clipped, norm = F.clip_by_global_norm(tree, 1.0, use_norm=2.0)
  assert norm == 2.0
  np.testing.assert_array_equal(clipped[1], [2.0])
  jaxpr = str(jax.make_jaxpr(
      lambda t: F.clip_by_global_norm(t, 1.0, use_norm=2.0))(use_norm_tree()))
  assert "reduce" not in jaxpr and "cond" not in jaxpr, jaxpr


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_use_norm_dtypes_are_kept_and_scaled_once(dtype):
  tree = use_norm_tree(dtype)
  clipped, norm = F.clip_by_global_norm(tree, 1.0, use_norm=4.0)
  assert norm.dtype == jnp.float32
  jax.tree.map(lambda got, x: (
      np.testing.assert_array_equal(
          got, (x.astype(jnp.float32) * np.float32(0.25)).astype(dtype)),
      (got.dtype == dtype) or pytest.fail(f"{got.dtype} != {dtype}")),
      clipped, tree)


def test_use_norm_under_jit_with_a_traced_norm():
  tree = use_norm_tree()

  @jax.jit
  def clip(tree, max_norm, use_norm):
    return F.clip_by_global_norm(tree, max_norm, use_norm=use_norm)

  for use_norm in (0.5, 2.0, 8.0):
    got, norm = clip(tree, 2.0, use_norm)
    want, _ = F.clip_by_global_norm(tree, 2.0, use_norm=use_norm)
    assert norm == use_norm
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_use_norm_under_vmap_each_example_by_its_own_norm():
  batch = {"w": jnp.arange(12.0).reshape(4, 3), "b": jnp.ones((4, 2))}
  norms = jnp.array([0.5, 1.0, 4.0, 10.0])
  clipped, returned = jax.vmap(
      lambda g, n: F.clip_by_global_norm(g, 2.0, use_norm=n))(batch, norms)
  np.testing.assert_array_equal(returned, norms)
  factors = np.minimum(1, np.float32(2.0) / np.asarray(norms))
  for key in batch:
    np.testing.assert_array_equal(
        clipped[key], np.asarray(batch[key]) * factors[:, None])


def test_use_norm_non_clippable_leaves_pass_through():
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


def test_use_norm_nan_norm_makes_every_leaf_nan_as_tensorflow_and_torch():
  clipped, norm = F.clip_by_global_norm(use_norm_tree(), 1.0, use_norm=math.nan)
  assert np.isnan(norm)
  assert all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(clipped))


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_use_norm_inf_norm_gives_factor_zero_as_a_measured_inf_norm(eps):
  tree = [jnp.array([1.0, jnp.inf]), jnp.array([3.0, 4.0])]
  measured, norm = F.clip_by_global_norm(tree, 5.0, eps=eps)
  given, returned = F.clip_by_global_norm(tree, 5.0, eps=eps, use_norm=math.inf)
  assert norm == returned == math.inf
  jax.tree.map(np.testing.assert_array_equal, given, measured)
  np.testing.assert_array_equal(given[1], [0.0, 0.0])


def test_use_norm_traced_negative_norm_acts_as_zero_and_nan_stays_nan():
  tree = use_norm_tree()
  clip = jax.jit(lambda n: F.clip_by_global_norm(tree, 1.0, use_norm=n))
  clipped, norm = clip(-3.0)
  assert norm == 0.0
  jax.tree.map(np.testing.assert_array_equal, clipped, tree)
  clipped, norm = clip(math.nan)
  assert np.isnan(norm)
  assert all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(clipped))


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_use_norm_zero_norm_and_zero_threshold_are_finite(max_norm):
  zeros = jax.tree.map(jnp.zeros_like, use_norm_tree())
  clipped, _ = F.clip_by_global_norm(zeros, max_norm, use_norm=0.0)
  jax.tree.map(np.testing.assert_array_equal, clipped, zeros)
  clipped, _ = F.clip_by_global_norm(use_norm_tree(), 0.0, use_norm=2.0)
  assert all((np.asarray(x) == 0).all() for x in jax.tree.leaves(clipped))


def test_use_norm_gradient_through_the_given_norm():
  # d/dn (x * max_norm / n) = -x * max_norm / n**2; 0 where not clipped.
  x = jnp.array([3.0, 4.0])

  def loss(n):
    return jnp.sum(F.clip_by_global_norm([x], 2.0, use_norm=n)[0][0])

  np.testing.assert_allclose(jax.grad(loss)(4.0), -7.0 * 2.0 / 16.0, rtol=1e-6)
  assert jax.grad(loss)(1.0) == 0.0
  assert jax.grad(loss)(0.0) == 0.0


def test_use_norm_float64_norm_under_x64():
  with jax.enable_x64(True):
    tree = [jnp.array([3.0, 4.0], jnp.float64)]
    clipped, norm = F.clip_by_global_norm(tree, 1.0, use_norm=1e300)
    assert norm.dtype == jnp.float64 and norm == 1e300
    np.testing.assert_array_equal(clipped[0], np.array([3.0, 4.0]) * (1 / 1e300))


# --------------------------------------------------------------------------
# leaf_norms and layer_axis: per-leaf and per-layer norms kept in the state,
# against float64 numpy (on `helpers.stacked_gradients()`)

GLOBAL_CLIPPERS = {
    "clip_by_global_norm": lambda **k: oc.clip_by_global_norm(1.0, **k),
    "clip_grad_norm": lambda **k: oc.clip_grad_norm(
        1.0, **{("norm_type" if a == "ord" else a): v for a, v in k.items()}),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("name", list(GLOBAL_CLIPPERS))
def test_leaf_norms_equal_numpy_per_leaf_and_per_layer(name, ord, jit):
  grads = stacked_gradients()
  for layer_axis in (None, LAYER_AXIS):
    tx = GLOBAL_CLIPPERS[name](ord=ord, leaf_norms=True, layer_axis=layer_axis)
    _, state = run(tx, grads, jit)
    assert_norm_tree(state.leaf_norms,
                     expected_norm_tree(grads, ord, layer_axis is not None))


def test_leaf_norm_tree_has_the_gradients_structure():
  grads = stacked_gradients()
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=LAYER_AXIS)
  state = tx.init(grads)
  # None where a leaf is not clippable (the int step), as for None and
  # MaskedNode subtrees; zeros of each norm's shape before the first step.
  assert state.leaf_norms["step"] is None and state.leaf_norms["frozen"] is None
  assert state.leaf_norms["masked"] == optax.MaskedNode()
  assert jax.tree.map(np.shape, state.leaf_norms) == jax.tree.map(
      np.shape, expected_norm_tree(grads, 2))
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(state.leaf_norms))
  _, new_state = run(tx, grads)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)


def test_leaf_norms_under_an_injected_traced_order():
  grads = stacked_gradients()
  tx = optax.inject_hyperparams(oc.clip_by_global_norm)(
      max_norm=1.0, ord=3.0, leaf_norms=True, layer_axis=LAYER_AXIS)
  state = tx.init(grads)
  for ord in (3.0, 1.0, 2.0, math.inf, 0.5):
    state.hyperparams["ord"] = jnp.asarray(ord, jnp.float32)
    _, new_state = jax.jit(tx.update)(grads, state)
    want = expected_norm_tree(grads, ord)
    assert_norm_tree(new_state.inner_state.leaf_norms, want, rtol=2e-6)
    np.testing.assert_allclose(
        new_state.inner_state.norm,
        norm_of_named(grads, ord),
        rtol=2e-6)


@pytest.mark.parametrize("scale", [1.0, 1e30, 1e-30])
@pytest.mark.parametrize("ord", ORDS)
def test_global_norm_is_the_norm_of_the_leaf_norms(ord, scale):
  # Same partial sums: the global norm is the norm of what the state keeps
  # (to the rounding of one root), and what leaf_norms=False gives (a few
  # ulps: the leaves' norms are rounded to float32 first).
  grads = stacked_gradients(scale=scale, seed=2)
  tx = oc.clip_by_global_norm(1.0, ord=ord, leaf_norms=True, layer_axis=LAYER_AXIS)
  _, state = run(tx, grads)
  kept = np.concatenate([np.ravel(f64(x)) for x in jax.tree.leaves(state.leaf_norms)])
  assert ulps(state.norm, np_leaf_norm(kept, ord)) <= 2
  _, plain = run(oc.clip_by_global_norm(1.0, ord=ord), grads)
  assert ulps(state.norm, plain.norm) <= 4
  want = norm_of_named(grads, ord)
  np.testing.assert_allclose(f64(state.norm), want, rtol=2e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("ord", ORDS)
def test_a_nonfinite_leaf_shows_in_its_own_entry_only(ord, bad):
  grads = stacked_gradients(seed=3)
  # One bad value in layer 2 of the stacked kernel, and one in `emb`.
  grads["layers"]["attn"]["kernel"] = grads["layers"]["attn"]["kernel"].at[2, 1, 1].set(bad)
  grads["emb"] = grads["emb"].at[0, 0].set(bad)
  tx = oc.clip_by_global_norm(1.0, ord=ord, leaf_norms=True, layer_axis=LAYER_AXIS)
  _, state = run(tx, grads)
  kernel = np.asarray(state.leaf_norms["layers"]["attn"]["kernel"])
  want_bad = np.isnan if math.isnan(bad) else np.isposinf
  assert want_bad(kernel[2]) and want_bad(state.leaf_norms["emb"])
  good = expected_norm_tree(stacked_gradients(seed=3), ord)
  np.testing.assert_allclose(np.delete(kernel, 2),
                             np.delete(good["layers"]["attn"]["kernel"], 2), rtol=1e-6)
  for path in (("bias",), ("layers", "mlp", 0), ("layers", "mlp", 1)):
    got, want = state.leaf_norms, good
    for key in path:
      got, want = got[key], want[key]
    np.testing.assert_allclose(f64(got), want, rtol=1e-6)


@pytest.mark.parametrize("make", [
    lambda **k: oc.clip_by_global_norm(1.0, **k),
    lambda **k: oc.clip_grad_norm(1.0, **k),
    lambda **k: oc.clip_by_norm(1.0, **k)], ids=["global", "grad_norm", "per_leaf"])
def test_leaf_norms_off_by_default_compiles_the_same_program(make):
  grads = stacked_gradients()
  default, off = make(), make(leaf_norms=False)
  assert default.init(grads).leaf_norms is None
  assert off.init(grads).leaf_norms is None

  def lowered(tx):
    return jax.jit(tx.update).lower(grads, tx.init(grads)).as_text()

  assert lowered(off) == lowered(default)


def test_layer_axis_may_be_a_callable_of_the_gradients():
  grads = stacked_gradients()
  as_callable = lambda tree: jax.tree.map(  # noqa: E731
      lambda _: None, tree) | {"layers": {"attn": 0, "mlp": [0, -1]}}
  for tx in (oc.clip_by_global_norm(1.0, leaf_norms=True,
                                    layer_axis=as_callable),
             oc.clip_by_norm(1.0, leaf_norms=True, layer_axis=as_callable)):
    _, state = run(tx, grads)
    assert_norm_tree(state.leaf_norms, expected_norm_tree(grads, 2, True))


def test_layer_axis_without_leaf_norms_leaves_the_global_norm_alone():
  # clip_by_global_norm takes layer_axis for logging only.
  grads = stacked_gradients()
  tx = oc.clip_by_global_norm(1.0, layer_axis=LAYER_AXIS)
  assert jax.jit(tx.update).lower(grads, tx.init(grads)).as_text() == \
      jax.jit(oc.clip_by_global_norm(1.0).update).lower(
          grads, oc.clip_by_global_norm(1.0).init(grads)).as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_leaf_norms_of_half_precision_leaves(dtype):
  # fp16 squares overflow above 256: the norms accumulate in float32.
  grads = stacked_gradients(dtype, scale=300.0, seed=4)
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=LAYER_AXIS)
  out, state = run(tx, grads)
  assert_norm_tree(state.leaf_norms, expected_norm_tree(grads, 2), rtol=1e-5)
  assert all(np.isfinite(f64(x)).all() for x in jax.tree.leaves(state.leaf_norms))
  assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, grads)


# --------------------------------------------------------------------------
# groups: against one clip_by_global_norm per group on its own sub-tree

LABELS = {"layers": {"attn": "attn", "mlp": "mlp"}, "emb": "embed", "bias": "mlp",
          "step": "attn", "frozen": "attn", "masked": "attn"}
GROUP_LEAVES = {"attn": ["kernel"], "mlp": ["mlp0", "mlp1", "bias"], "embed": ["emb"]}


def by_path(tree):
  """The same labels from the tree, by a callable (as optax.partition)."""
  def label(path, _):
    keys = [getattr(k, "key", None) for k in path]
    return "embed" if "emb" in keys else "attn" if "attn" in keys else "mlp"
  return jax.tree_util.tree_map_with_path(label, tree)


@pytest.mark.parametrize("groups", [LABELS, by_path], ids=["tree", "callable"])
@pytest.mark.parametrize("ord", ORDS)
def test_groups_equal_one_clipper_per_group(ord, groups):
  grads = stacked_gradients(scale=3.0, seed=8)
  max_norm = {"attn": 1.0, "mlp": 100.0, "embed": 0.5}
  tx = oc.clip_by_global_norm(max_norm, ord=ord, groups=groups)
  out, state = run(tx, grads)
  leaves, clipped = named_leaves(grads), named_leaves(out)
  for label, names in GROUP_LEAVES.items():
    sub = {name: leaves[name] for name in names}
    want, alone = run(oc.clip_by_global_norm(max_norm[label], ord=ord), sub)
    for name in names:
      np.testing.assert_allclose(np.asarray(clipped[name]), np.asarray(want[name]),
                                 rtol=2e-6)
    group = state.groups[label]
    np.testing.assert_allclose(group.norm, alone.norm, rtol=2e-6)
    np.testing.assert_allclose(group.scale, alone.scale, rtol=2e-6)
    assert int(group.clipped_count) == int(alone.clipped_count)
  assert int(state.groups["mlp"].clipped_count) == 0  # a group left alone
  np.testing.assert_array_equal(out["step"], grads["step"])
  found = oc.stats(state)
  for label in GROUP_LEAVES:
    for field in ("norm", "scale", "count", "clipped_count", "nonfinite_count",
                  "clip_rate"):
      assert f"clip/{label}/{field}" in found


def test_groups_with_one_number_and_leaf_norms():
  grads = stacked_gradients(scale=3.0, seed=9)
  tx = oc.clip_by_global_norm(1.0, groups=LABELS, leaf_norms=True, layer_axis=LAYER_AXIS)
  out, state = run(tx, grads)
  assert_norm_tree(state.leaf_norms, expected_norm_tree(grads, 2))
  for label, names in GROUP_LEAVES.items():
    norm = np_leaf_norm(np.concatenate([f64(named_leaves(grads)[n]).ravel()
                                        for n in names]), 2)
    np.testing.assert_allclose(state.groups[label].norm, norm, rtol=2e-6)
    for name in names:
      np.testing.assert_allclose(f64(named_leaves(out)[name]),
                                 f64(named_leaves(grads)[name]) * np_factor(norm, 1.0),
                                 rtol=2e-6)
  assert "clip/layer_norm/layers/attn/kernel/3" in oc.stats(state)


def test_a_group_without_a_limit_fails_at_init_naming_it():
  tx = oc.clip_by_global_norm({"attn": 1.0, "mlp": 1.0}, groups=LABELS)
  with pytest.raises(ValueError, match=r"no limit for group 'embed'"):
    tx.init(stacked_gradients())


def test_nonfinite_zero_zeroes_only_the_bad_group():
  grads = stacked_gradients(scale=3.0, seed=10)
  grads["emb"] = grads["emb"].at[1, 1].set(jnp.nan)
  tx = oc.clip_by_global_norm(1.0, groups=LABELS, nonfinite="zero")
  out, state = run(tx, grads)
  np.testing.assert_array_equal(out["emb"], np.zeros_like(grads["emb"]))
  assert int(state.groups["embed"].nonfinite_count) == 1
  clean = stacked_gradients(scale=3.0, seed=10)
  want, _ = run(oc.clip_by_global_norm(1.0, groups=LABELS), clean)
  for name in ("kernel", "mlp0", "mlp1", "bias"):
    np.testing.assert_array_equal(named_leaves(out)[name], named_leaves(want)[name])
  assert int(state.groups["attn"].nonfinite_count) == 0


def test_nonfinite_raise_names_the_leaf():
  grads = stacked_gradients(seed=11)
  grads["bias"] = grads["bias"].at[0].set(jnp.inf)
  tx = oc.clip_by_global_norm(1.0, groups=LABELS, nonfinite="raise")
  with pytest.raises(oc.NonFiniteGradientError, match=r"\['bias'\]"):
    tx.update(grads, tx.init(grads))


def test_groups_on_a_tree_without_floating_leaves():
  tree = {"step": jnp.int32(3), "frozen": None}
  for nonfinite in ("propagate", "zero", "raise"):
    tx = oc.clip_by_global_norm(1.0, groups="all", leaf_norms=True, nonfinite=nonfinite)
    out, state = run(tx, tree)
    assert state.groups == {} and out["step"] == 3


def test_vmap_over_a_batch_of_trees():
  batch = [stacked_gradients(scale=s, seed=14) for s in (0.5, 1.0, 4.0)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batch)
  for tx in (oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=LAYER_AXIS),
             oc.clip_by_norm(1.0, leaf_norms=True, layer_axis=LAYER_AXIS),
             oc.clip_by_global_norm(1.0, groups=LABELS, leaf_norms=True,
                                    layer_axis=LAYER_AXIS)):
    out, state = jax.jit(jax.vmap(lambda t, tx=tx: tx.update(t, tx.init(t))))(stacked)
    for i, grads in enumerate(batch):
      want_out, want_state = run(tx, grads)
      jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(
          np.asarray(a)[i], np.asarray(b), rtol=1e-6), (out, state), (want_out, want_state))


# --------------------------------------------------------------------------
# groups= as a callable under optax.inject_hyperparams

def test_injected_callable_groups_is_refused_or_works_as_static():
  grads = {"body": jnp.full(4, 10.0), "head": jnp.array([1.0])}
  labels = lambda tree: {"body": "b", "head": "h"}  # noqa: E731
  tx = optax.inject_hyperparams(oc.clip_by_global_norm)(max_norm=1.0, groups=labels)
  with pytest.raises(TypeError, match=r"static_args=\('groups',\)"):
    tx.init(grads)
  tx = optax.inject_hyperparams(oc.clip_by_global_norm, static_args=("groups",))(
      max_norm=1.0, groups=labels)
  updates, _ = tx.update(grads, tx.init(grads))
  assert float(updates["head"][0]) == 1.0  # its own group's norm is 1: kept
