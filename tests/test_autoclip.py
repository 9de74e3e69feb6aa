"""auto_clip: AutoClip against a float64 numpy restatement, and the contract.

The reference appends each step's global L2 norm to a list, takes
``numpy.percentile`` of the list and clips with
``torch.nn.utils.clip_grad_norm_``'s factor ``min(1, thr / (norm + 1e-6))``.
Run with ``-s`` to see the largest relative differences.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  STEPS,  # noqa: F401 (test_adagc.py imports it from here)
  Largest,
  f64_leaves,
  gradient_steps,
  norm_sequence,
  tree_like,
  warm,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from outliers import (
  assert_finite,
  gradients_through_updates,
  norms_with_outlier,
  over_outlier_sizes,
  scan_of,
  trees_with_norms,
)

import optaxclip as oc
from optaxclip._adaptive.autoclip import percentile_of_prefix

auto_clip = oc.auto_clip

RTOL = 1e-5


# --------------------------------------------------------------------------
# The reference, step by step in float64

def reference(steps, percentile, history=None, eps=1e-6):
  seen = []
  for tree in steps:
    leaves = f64_leaves(tree)
    norm = np.sqrt(sum(np.sum(x ** 2) for x in leaves))
    seen.append(norm)
    window = seen[-history:] if history else seen
    threshold = np.percentile(window, percentile)  # linear interpolation
    scale = min(1.0, threshold / (norm + eps))
    yield {"norm": norm, "threshold": threshold, "scale": scale,
           "clipped": [x * scale for x in leaves]}


def run_against_reference(tx, steps, expected, title):
  largest = Largest()
  step = jax.jit(tx.update)
  state = tx.init(steps[0])
  clipped_steps = 0
  for t, (tree, ref) in enumerate(zip(steps, expected)):
    out, state = step(tree, state)
    largest.check("norm", state.norm, ref["norm"])
    largest.check("threshold", state.threshold, ref["threshold"])
    largest.check("scale", state.scale, ref["scale"])
    for got, want in zip(jax.tree.leaves(out), ref["clipped"]):
      largest.check("clipped gradient", got, want)
    clipped_steps += ref["scale"] < 1
    assert int(state.count) == t + 1
    assert int(state.clipped_count) == clipped_steps
  assert int(state.nonfinite_count) == 0
  largest.report(title)
  return largest.seen


@pytest.mark.parametrize("percentile", [10.0, 50.0, 97.5])
def test_matches_the_reference_step_by_step(percentile):
  steps = gradient_steps(norm_sequence())
  seen = run_against_reference(
      auto_clip(percentile), steps, reference(steps, percentile),
      f"auto_clip({percentile})")
  assert seen["scale"] < RTOL


def test_ring_buffer_keeps_the_last_history_norms():
  # Past `history` steps the reference is the percentile of the last norms.
  steps = gradient_steps(norm_sequence(seed=2), seed=3)
  run_against_reference(auto_clip(50.0, history=40), steps,
                        reference(steps, 50.0, history=40),
                        "auto_clip(50, history=40)")


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(0, 1e6, width=32, allow_subnormal=False),
                      min_size=1, max_size=16),
       q=st.floats(0, 100))
def test_percentile_of_prefix_is_numpy_percentile(values, q):
  buffer = np.zeros(16, np.float32)
  buffer[:len(values)] = values
  got = _percentile(buffer, np.int32(len(values)), np.float32(q))
  want = np.percentile(np.asarray(values, np.float64), np.float32(q))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * max(values))


_percentile = jax.jit(percentile_of_prefix)


# --------------------------------------------------------------------------
# Beyond the shared contract (tests/test_contract.py): this transform's
# own edge cases, statistics and argument errors.

def make(**overrides):
  return auto_clip(**{"percentile": 10.0, "history": 8, **overrides})


def test_inject_hyperparams_history_sets_the_shape_at_init():
  grads = tree_like()
  injected = optax.inject_hyperparams(auto_clip)(percentile=10.0, history=8)
  with pytest.raises(TypeError, match="static_args"):
    jax.jit(injected.init)(grads)  # a traced history cannot size the buffer
  static = optax.inject_hyperparams(auto_clip, static_args="history")(history=8)
  state = jax.jit(static.init)(grads)
  assert state.inner_state.norms.shape == (8,)


def test_finite_at_zero():
  tx = make()
  zeros = jax.tree.map(jnp.zeros_like, tree_like())
  state = tx.init(zeros)
  for _ in range(2):
    out, state = jax.jit(tx.update)(zeros, state)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
  loss = lambda g: sum(jnp.sum(x) for x in jax.tree.leaves(tx.update(g, state)[0]))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.jit(jax.grad(loss))(zeros)))


def test_nonfinite_norm_is_kept_out_of_the_history():
  tx = make()
  grads = tree_like()
  state = warm(tx, grads, growth=1.0)
  bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), grads)
  out, after = jax.jit(tx.update)(bad, state)
  assert np.isnan(np.asarray(out["norm"][0])).any()  # propagates, as the reference
  np.testing.assert_array_equal(after.norms, state.norms)
  assert int(after.size) == int(state.size) and int(after.nonfinite_count) == 1
  assert int(after.clipped_count) == int(state.clipped_count)
  # optax.apply_if_finite then skips the step and the clipper goes on.
  guarded = optax.apply_if_finite(optax.chain(make(), optax.sgd(1.0)), 3)
  guarded_state = guarded.init(grads)
  updates, guarded_state = jax.jit(guarded.update)(bad, guarded_state, grads)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  updates, guarded_state = jax.jit(guarded.update)(grads, guarded_state, grads)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))


def test_stats_report_threshold_norm_and_counts():
  tx = optax.chain(make(), optax.sgd(0.1))
  grads = tree_like()
  state = warm(tx, grads, growth=1.0)
  found = jax.jit(oc.stats)(state)
  assert set(found) == {f"auto_clip/{k}" for k in (
      "norm", "threshold", "scale", "count", "clipped_count",
      "nonfinite_count", "clip_rate")}
  assert int(found["auto_clip/count"]) == 3
  assert all(v.shape == () for v in found.values())


def test_shard_map_norm_is_global():
  from jax import shard_map
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((8,), ("data",))
  grads = {"w": np.random.default_rng(4).normal(size=(16, 4)).astype(np.float32),
           "b": np.ones(4, np.float32)}
  specs = {"w": P("data"), "b": P()}
  tx = auto_clip(50.0, history=4, axis_name="data", specs=specs)
  state = jax.device_put(tx.init(grads), NamedSharding(mesh, P()))
  step = jax.jit(shard_map(tx.update, mesh=mesh, in_specs=(specs, P()),
                           out_specs=(specs, P())))
  for k in (1.0, 3.0):
    sharded = jax.tree.map(lambda x, s: jax.device_put(x * k, NamedSharding(mesh, s)),
                           grads, specs)
    out, state = step(sharded, state)
  local = make(percentile=50.0, history=4)
  expected_state = local.init(grads)
  for k in (1.0, 3.0):
    expected, expected_state = jax.jit(local.update)(
        jax.tree.map(lambda x: x * k, grads), expected_state)
  np.testing.assert_allclose(state.norm, expected_state.norm, rtol=1e-6)
  np.testing.assert_allclose(state.threshold, expected_state.threshold, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), out, expected)


# --------------------------------------------------------------------------
# One outlier of any size takes one rank of the history: spikes are still
# clipped, and gradients through the history stay finite.

AUTO_CLIPS = {p: auto_clip(p, history=32) for p in (10.0, 90.0)}


@pytest.mark.parametrize("percentile", list(AUTO_CLIPS))
@pytest.mark.parametrize("at", [0, 5, 25])
@over_outlier_sizes
def test_one_outlier_of_any_size_takes_one_rank_of_the_history(percentile, at, size):
  # The bound of auto_clip's docstring: (300 - p) / (100 - p) norms held.
  probe = max(at + 1, int(np.ceil((300 - percentile) / (100 - percentile))) - 1)
  _, states = scan_of(AUTO_CLIPS[percentile])(trees_with_norms(
      norms_with_outlier(size, at, probe)))
  assert_finite(states.norms, states.norm, states.threshold, states.scale)
  assert float(states.threshold[probe]) < 2.0  # among the usual norms
  assert float(states.scale[probe]) < 1e-5


def test_gradient_is_finite_at_zero_and_after_a_constant_history():
  tx = auto_clip(50.0, history=4)
  for history, grads in gradients_through_updates(tx).items():
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads)), history


def test_auto_clip_clips_a_huge_float64_norm_against_its_history():
  with jax.enable_x64(True):
    tx = oc.auto_clip()
    state = tx.init({"w": jnp.zeros(2)})
    for g in (1.0, 1.0, 1.0, 1.0, 1e40):
      updates, state = tx.update({"w": jnp.array([0.6 * g, 0.8 * g])}, state)
    np.testing.assert_allclose(updates["w"], [0.6, 0.8], rtol=1e-6)
