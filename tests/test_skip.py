"""skip_step: a numpy re-statement of the skip rule, bit-identical inner
states on skipped steps, and the shared transform contract."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from outliers import (
  assert_finite,
  gradients_through_updates,
  norms_with_outlier,
  outlier_step,
  over_outlier_sizes,
  scan_of,
  trees_with_norms,
)

import optaxclip as oc
from optaxclip._skip import skip_step

STEPS = 300
DECAY, WARMUP, ZSCORE, MAX_NORM = 0.95, 30, 6.0, 50.0
# step -> multiple of the usual norm (nan / inf: a non-finite gradient)
SPIKES = {10: 20.0, 60: 10.0, 61: 12.0, 100: 100.0, 150: math.nan,
          151: math.inf, 200: 60.0, 250: 30.0, 251: 3.0}


def norm_sequence():
  rng = np.random.default_rng(0)
  norms = np.exp(0.1 * rng.normal(size=STEPS)) * np.linspace(1.0, 1.5, STEPS)
  for step, multiple in SPIKES.items():
    norms[step] = norms[step] * multiple
  return norms


def grads_with_norms(norms):
  """Random directions with the given global norms (NaN/Inf placed in "a")."""
  rng = np.random.default_rng(1)
  a, b = rng.normal(size=(STEPS, 8)), rng.normal(size=(STEPS, 4, 3))
  length = np.sqrt((a**2).sum(1) + (b**2).sum((1, 2)))
  finite = np.where(np.isfinite(norms), norms, 1.0)
  a, b = a * (finite / length)[:, None], b * (finite / length)[:, None, None]
  a[:, 0] = np.where(np.isfinite(norms), a[:, 0], norms)
  return {"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


def reference(norms, *, max_norm, zscore, decay, warmup):
  """The skip rule restated from its definition, in float64.

  The statistics are the weighted mean and variance of the accepted norms
  with weights decay**(age): what the EMA recurrence must equal.
  """
  accepted, out = [], {k: [] for k in (
      "skip", "nonfinite", "too_large", "spike", "mean", "var", "margin")}
  mean = var = 0.0
  for n in norms:
    finite = bool(np.isfinite(n))
    too_large = finite and n > max_norm
    spike, margin = False, math.inf
    if finite and len(accepted) >= max(warmup, 1):
      limit = zscore * math.sqrt(var)
      spike = n - mean > limit
      margin = abs(n - mean - limit) / max(limit, 1e-30)
    skip = (not finite) or too_large or spike
    if finite and not skip:
      accepted.append(n)
      h = np.asarray(accepted)
      w = decay ** np.arange(len(h))[::-1]
      mean = float((w * h).sum() / w.sum())
      var = float((w * (h - mean) ** 2).sum() / w.sum())
    for key, value in (("skip", skip), ("nonfinite", not finite),
                       ("too_large", too_large), ("spike", spike),
                       ("mean", mean), ("var", var), ("margin", margin)):
      out[key].append(value)
  return {k: np.asarray(v) for k, v in out.items()}


PARAMS = {"a": jnp.linspace(-1.0, 1.0, 8), "b": jnp.ones((4, 3))}


def run_scan(tx, grads):
  """Every step's updates and state, from one compiled scan."""
  def step(carry, g):
    params, state = carry
    updates, state = tx.update(g, state, params)
    return (optax.apply_updates(params, updates), state), (updates, state)

  (params, _), (updates, states) = jax.jit(
      lambda g: jax.lax.scan(step, (PARAMS, tx.init(PARAMS)), g))(grads)
  return params, updates, states


@pytest.fixture(scope="module")
def spiky_run():
  norms = norm_sequence()
  grads = grads_with_norms(norms)
  tx = skip_step(optax.adamw(1e-2), max_norm=MAX_NORM, zscore=ZSCORE,
                 ema_decay=DECAY, warmup_steps=WARMUP)
  params, updates, states = run_scan(tx, grads)
  ref = reference(np.asarray(jax.vmap(oc.functional.global_norm)(grads), np.float64),
                  max_norm=MAX_NORM, zscore=ZSCORE, decay=DECAY, warmup=WARMUP)
  return norms, grads, params, updates, states, ref


def test_skip_decisions_and_statistics_match_the_reference(spiky_run):
  norms, _, _, _, states, ref = spiky_run
  stats = jax.tree.map(np.asarray, states.stats)
  assert not np.any(ref["margin"] < 1e-3), "a decision too close to call"
  skipped = np.diff(np.concatenate([[0], stats.skipped_count])) == 1
  np.testing.assert_array_equal(skipped, ref["skip"])
  # The spikes after warm-up and the non-finite steps are exactly the skips.
  assert set(np.flatnonzero(ref["skip"])) == {s for s in SPIKES if s >= WARMUP}
  np.testing.assert_array_equal(stats.skipped_count, np.cumsum(ref["skip"]))
  np.testing.assert_array_equal(stats.nonfinite_count, np.cumsum(ref["nonfinite"]))
  np.testing.assert_array_equal(stats.max_norm_count, np.cumsum(ref["too_large"]))
  np.testing.assert_array_equal(stats.zscore_count, np.cumsum(ref["spike"]))
  np.testing.assert_array_equal(stats.count, np.arange(1, STEPS + 1))
  np.testing.assert_array_equal(
      stats.ema_count, np.cumsum(~ref["skip"] & np.isfinite(norms)))
  mean_err = np.max(np.abs(stats.norm_mean - ref["mean"]) / ref["mean"])
  std_err = np.max(np.abs(np.sqrt(stats.norm_var) - np.sqrt(ref["var"]))
                   / np.maximum(np.sqrt(ref["var"]), 1e-30))
  finite = np.isfinite(norms)
  norm_err = np.max(np.abs(stats.norm[finite] - norms[finite]) / norms[finite])
  print(f"\nskip_step vs float64 reference over {STEPS} steps: largest relative "
        f"difference mean {mean_err:.2e}, std {std_err:.2e}, norm {norm_err:.2e}")
  assert mean_err < 1e-5 and std_err < 1e-4 and norm_err < 1e-6
  assert np.all(np.isnan(stats.norm[~finite]) | np.isinf(stats.norm[~finite]))


def test_skipped_steps_leave_adamw_bit_identical(spiky_run):
  _, grads, params, updates, states, ref = spiky_run
  inner = jax.tree.map(np.asarray, states.inner_state)
  first = jax.tree.map(np.asarray, optax.adamw(1e-2).init(PARAMS))
  previous = jax.tree.map(lambda f, s: np.concatenate([f[None], s[:-1]]), first, inner)
  for step in np.flatnonzero(ref["skip"]):
    for old, new in zip(jax.tree.leaves(previous), jax.tree.leaves(inner)):
      assert old[step].tobytes() == new[step].tobytes()  # bits, NaN-safe
    assert all(np.all(np.asarray(u)[step] == 0) for u in jax.tree.leaves(updates))
  assert int(inner[0].count[-1]) == STEPS - ref["skip"].sum()
  # The run equals adamw fed only the accepted steps.
  keep = np.flatnonzero(~ref["skip"])
  plain_params, _, plain_states = run_scan(
      optax.adamw(1e-2), jax.tree.map(lambda g: g[keep], grads))
  # (Not bit for bit: XLA fuses adamw differently inside skip_step.)
  ours = jax.tree.leaves((params, jax.tree.map(lambda s: s[-1], states.inner_state)))
  plain = jax.tree.leaves((plain_params, jax.tree.map(lambda s: s[-1], plain_states)))
  worst = max(float(np.max(np.abs(np.asarray(a, np.float64) - b) /
                           (np.abs(np.asarray(b, np.float64)) + 1e-6)))
              for a, b in zip(ours, plain))
  print(f"\nskip_step(adamw) vs adamw on the accepted steps: largest relative "
        f"difference {worst:.2e}")
  assert worst < 1e-5


def test_nonfinite_false_applies_nan_steps_but_keeps_statistics_clean():
  tx = skip_step(optax.sgd(1.0), nonfinite=False, zscore=3.0, warmup_steps=2)
  state = tx.init(PARAMS)
  step = jax.jit(tx.update)
  g = jax.tree.map(jnp.ones_like, PARAMS)
  for _ in range(3):
    _, state = step(g, state)
  bad = {"a": g["a"].at[0].set(jnp.nan), "b": g["b"]}
  updates, state = step(bad, state)
  assert np.isnan(updates["a"][0]) and int(state.stats.skipped_count) == 0
  assert int(state.stats.nonfinite_count) == 1 and int(state.stats.ema_count) == 3
  np.testing.assert_allclose(state.stats.norm_mean, np.sqrt(20.0), rtol=1e-6)


def test_extra_args_reach_the_inner_transform():
  def init_fn(params):
    del params
    return jnp.zeros([], jnp.float32)

  def update_fn(updates, state, params=None, *, value):
    del params, state
    return updates, jnp.asarray(value, jnp.float32)

  inner = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  tx = skip_step(inner, max_norm=100.0)
  state = tx.init(PARAMS)
  _, state = jax.jit(tx.update)(PARAMS, state, PARAMS, value=3.0)
  assert float(state.inner_state) == 3.0
  huge = jax.tree.map(lambda x: x * 1e3, PARAMS)
  _, state = jax.jit(tx.update)(huge, state, PARAMS, value=5.0)
  assert float(state.inner_state) == 3.0  # skipped: untouched


def test_stats_report_skip_and_inner_states():
  tx = skip_step(optax.chain(oc.clip_by_global_norm(1.0), optax.sgd(0.1)), max_norm=1e3)
  state = tx.init(PARAMS)
  _, state = jax.jit(tx.update)(PARAMS, state, PARAMS)
  found = oc.stats(state)
  assert {"skip/norm", "skip/skip_rate", "skip/norm_std", "skip/zscore_count",
          "clip/norm"} <= set(found)
  np.testing.assert_allclose(found["skip/norm"], found["clip/norm"], rtol=1e-6)
  assert all(v.shape == () for v in found.values())


def test_skip_step_around_multisteps_recovers_from_bad_microbatches():
  """skip_step(MultiSteps(...)) judges each micro-batch and rolls the whole
  MultiSteps state back on a bad one: training goes on as if it never came
  (MultiSteps(skip_step(...)) would keep the NaN in its accumulator)."""
  rng = np.random.default_rng(2)
  grads = {"a": rng.normal(size=(12, 8)), "b": rng.normal(size=(12, 4, 3))}
  bad = {2: math.nan, 5: math.inf, 9: 1e3}  # NaN, Inf, a norm spike
  for t, what in bad.items():
    if math.isfinite(what):
      grads["a"][t] *= what
    else:
      grads["a"][t, 0] = what
  grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)

  def optimizer():
    return optax.MultiSteps(optax.chain(oc.clip_by_global_norm(1.0),
                                        optax.adam(0.1)), every_k_schedule=3)

  params, _, states = run_scan(skip_step(optimizer(), max_norm=100.0), grads)
  keep = np.array([t not in bad for t in range(12)])
  reference, _, _ = run_scan(optimizer(), jax.tree.map(lambda g: g[keep], grads))
  assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(params))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7),
               params, reference)
  assert int(states.inner_state.gradient_step[-1]) == 3  # every later window
  assert int(states.stats.nonfinite_count[-1]) == 2
  assert int(states.stats.max_norm_count[-1]) == 1


def test_shard_map_devices_agree():
  """Split gradients: the global norm (not a shard's) decides, and a NaN on
  one device skips the step on every device."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
  tx = skip_step(optax.sgd(1.0), max_norm=5.0, axis_name="i", specs=P("i"))
  step = jax.jit(shard_map(tx.update, mesh=mesh, in_specs=(P("i"), P()),
                           out_specs=(P("i"), P())))
  state = tx.init(jnp.zeros(8))
  local_small = jnp.full(8, 1.5)  # each half: norm 3; globally 4.24
  updates, state = step(local_small, state)
  np.testing.assert_array_equal(updates, -local_small)
  updates, state = step(jnp.full(8, 2.0), state)  # halves 4, globally 5.66
  np.testing.assert_array_equal(updates, jnp.zeros(8))
  updates, state = step(local_small.at[1].set(jnp.nan), state)
  np.testing.assert_array_equal(updates, jnp.zeros(8))
  assert int(state.stats.skipped_count) == 2 and int(state.stats.nonfinite_count) == 1
  np.testing.assert_allclose(state.stats.norm_mean, 1.5 * np.sqrt(8), rtol=1e-6)


# --------------------------------------------------------------------------
# Beyond the shared contract (tests/test_contract.py): this transform's
# own edge cases, statistics and argument errors.

def tree_like(dtype=jnp.float32, scale=1.0):
  rng = np.random.default_rng(0)
  tree = {"w": rng.normal(size=(8, 4)), "b": rng.normal(size=(4,))}
  return jax.tree.map(lambda x: jnp.asarray(x * scale, dtype), tree)


def make(**overrides):
  settings = {"max_norm": 10.0, "zscore": 3.0, "warmup_steps": 2, **overrides}
  return skip_step(optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.5)),
                   **settings)


def signature(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x),
                                 getattr(x, "weak_type", None)), tree)


def test_finite_at_zero():
  tx = make(max_norm=0.0)
  zeros = jax.tree.map(jnp.zeros_like, tree_like())
  state = tx.init(zeros)
  for _ in range(4):  # past the warm-up: a zero std must not skip zeros
    out, state = jax.jit(tx.update)(zeros, state, zeros)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
  assert int(state.stats.skipped_count) == 0 and int(state.stats.ema_count) == 4


# --------------------------------------------------------------------------
# One outlier of any size must not disable the z-score test (in a plain EMA
# its square overflows the variance, or its weight hides every spike for
# thousands of steps), and gradients through the statistics stay finite.

SKIPS = {w: skip_step(optax.sgd(1.0), zscore=6.0, warmup_steps=w) for w in (1, 5)}


@pytest.mark.parametrize("warmup", list(SKIPS))
@pytest.mark.parametrize("where", ["first", "warm-up", "after"])
@over_outlier_sizes
def test_one_outlier_of_any_size_does_not_disable_the_zscore_test(
    warmup, where, size):
  at = outlier_step(where, warmup)
  # The bound of skip_step's docstring.
  probe = at + 1 if at >= warmup else at + 3 + max(warmup, 1)
  updates, states = scan_of(SKIPS[warmup])(trees_with_norms(
      norms_with_outlier(size, at, probe)))
  stats = states.stats
  assert_finite(stats.norm, stats.norm_mean, stats.norm_var)
  spikes = np.diff(np.concatenate([[0], stats.zscore_count]))
  assert spikes[probe] == 1, (spikes, stats.norm_mean, stats.norm_var)
  assert all(np.all(np.asarray(u[probe]) == 0) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("kwargs", [{"zscore": 2.0, "warmup_steps": 2},
                                    {"zscore": 0.0, "max_norm": 1.0}])
def test_gradient_is_finite_at_zero_and_after_a_constant_history(kwargs):
  # (Not adam: optax.adam itself has a NaN gradient at zero gradients.)
  tx = skip_step(optax.sgd(0.1, momentum=0.9), **kwargs)
  for history, grads in gradients_through_updates(tx).items():
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads)), history


def test_stats_std_has_a_finite_gradient_at_a_zero_variance():
  tx = skip_step(optax.sgd(1.0), zscore=3.0)
  state = tx.init(PARAMS)
  std = lambda var: oc.stats(state._replace(
      stats=state.stats._replace(norm_var=var)))["skip/norm_std"]
  assert float(jax.grad(std)(jnp.float32(0.0))) == 0.0


def test_step_is_the_wrappers_decision_and_statistics():
  """``step`` is a pure function of (statistics, norm) that tests can call:
  the wrapper skips exactly when it says so and keeps its statistics."""
  from optaxclip import _skip
  settings = {"nonfinite": True, "max_norm": 10.0, "zscore": 2.0,
              "ema_decay": 0.9, "warmup_steps": 2}
  tx = oc.skip_step(optax.sgd(1.0), **settings)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  expected = state.stats
  for g in [1.0, 1.5, 1.2, 9.0, 20.0, float("nan"), 1.1]:
    grads = {"w": jnp.array([g, 0.0])}
    updates, state = tx.update(grads, state, params)
    skip, expected = _skip.step(expected, jnp.float32(abs(g)), **settings)
    assert bool(skip) == (not np.any(updates["w"]))
    for got, want in zip(state.stats, expected):
      np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("make", [
    lambda: skip_step(optax.identity(), max_norm=1.0),
    lambda: oc.dynamic_loss_scale(2.0, inner=optax.identity()),
])
def test_skipped_step_leaves_integer_leaves_untouched(make):
  """A skipped (or overflowed) step zeroed the step counters in the tree."""
  tx = make()
  grads = {"w": jnp.array([5.0, jnp.inf]), "step": jnp.array([3, 7])}
  updates, _ = tx.update(grads, tx.init(grads), grads)
  np.testing.assert_array_equal(updates["step"], [3, 7])
  np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
