"""microbatch_guard: optax.MultiSteps never accumulates a bad micro-batch,
and training goes on as if the bad micro-batches had never come."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import optaxclip as oc

K = 3  # micro-batches per window
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.ones(3)}
# micro-batch -> what is wrong with it (a multiple of its norm, or NaN/Inf)
BAD = {2: math.nan, 7: math.inf, 8: 1e3, 13: -math.inf}


def micro_batches(n=18, bad=BAD):
  rng = np.random.default_rng(0)
  w, b = rng.normal(size=(n, 2, 3)), rng.normal(size=(n, 3))
  for t, what in bad.items():
    if math.isfinite(what):
      w[t], b[t] = w[t] * what, b[t] * what
    else:
      w[t, 1, 2] = what
  return {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


def train(tx, batches):
  """Params after every micro-batch, and every state, from one scan."""
  def step(carry, grads):
    params, state = carry
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return (params, state), (params, state)

  return jax.jit(lambda b: jax.lax.scan(step, (PARAMS, tx.init(PARAMS)), b)[1])(batches)


def without(batches, dropped):
  keep = np.array([t not in dropped for t in range(len(batches["w"]))])
  return jax.tree.map(lambda x: x[keep], batches)


def optimizer():
  return optax.chain(oc.clip_by_global_norm(1.0), optax.adam(0.1))


def assert_close(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


@pytest.mark.parametrize("max_norm", [None, 50.0])
def test_guard_drops_bad_microbatches_as_if_they_never_came(max_norm):
  dropped = {t for t, what in BAD.items() if not math.isfinite(what) or max_norm}
  batches = micro_batches()
  tx = optax.MultiSteps(optimizer(), K, should_skip_update_fn=oc.microbatch_guard(
      max_norm=max_norm))
  params, states = train(tx, batches)
  assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(params))
  np.testing.assert_array_equal(
      np.flatnonzero(states.skip_state.skipped), sorted(dropped))  # counted
  # Every later window is applied, with what the good micro-batches give.
  ref_params, ref_states = train(optax.MultiSteps(optimizer(), K),
                                 without(batches, dropped))
  good = len(batches["w"]) - len(dropped)
  assert int(states.gradient_step[-1]) == good // K
  assert_close(jax.tree.map(lambda x: x[-1], params),
               jax.tree.map(lambda x: x[-1], ref_params))
  # The guard saw each micro-batch's own (overflow-safe) norm.
  norms = jax.vmap(oc.functional.global_norm)(batches)
  np.testing.assert_allclose(states.skip_state.norm, norms, rtol=1e-6)


def test_without_a_guard_one_nan_microbatch_stalls_multisteps_for_ever():
  """Why the guard is needed: MultiSteps resets its accumulator by
  multiplying by 0, so a NaN micro-batch stays in it; a skip_step inside then
  skips every later window (the composition the PyTorch page showed)."""
  tx = optax.MultiSteps(oc.skip_step(optimizer()), K)
  params, states = train(tx, micro_batches(bad={K + 1: math.nan}))
  first = jax.tree.map(lambda x: x[K - 1], params)  # after the first window
  assert not np.allclose(first["w"], PARAMS["w"])
  assert_close(jax.tree.map(lambda x: x[-1], params), first)  # nothing since
  assert int(states.inner_opt_state.stats.skipped_count[-1]) == 18 // K - 1


def test_huge_finite_microbatches_are_not_taken_for_nan():
  """Squares of 1e20 overflow float32; the guard's norm does not."""
  tx = optax.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=oc.microbatch_guard())
  state = tx.init(PARAMS)
  huge = jax.tree.map(lambda p: jnp.full_like(p, 1e20), PARAMS)
  _, state = jax.jit(tx.update)(huge, state, PARAMS)
  assert not bool(state.skip_state.skipped) and int(state.mini_step) == 1
  np.testing.assert_allclose(state.skip_state.norm, 1e20 * 3, rtol=1e-6)


def test_with_loss_scaling_outside():
  """dynamic_loss_scale(MultiSteps(...)): an overflowed micro-batch reaches
  neither the accumulator nor the optimizer; the guard judges unscaled
  micro-batches."""
  tx = oc.dynamic_loss_scale(2.0**10, inner=optax.MultiSteps(
      optimizer(), K, should_skip_update_fn=oc.microbatch_guard(max_norm=50.0)))
  batches = micro_batches()
  state, params = tx.init(PARAMS), PARAMS
  for t in range(len(batches["w"])):
    scaled = jax.tree.map(lambda b: b[t] * oc.loss_scale(state), batches)
    updates, state = jax.jit(tx.update)(scaled, state, params)
    params = optax.apply_updates(params, updates)
  ref_params, _ = train(optax.MultiSteps(optimizer(), K), without(batches, BAD))
  assert_close(params, jax.tree.map(lambda x: x[-1], ref_params))
  found = oc.stats(state)
  assert found["loss_scale/overflow_count"] == 3 and found["loss_scale/scale"] == 2.0**7


def test_stats_report_the_last_microbatch():
  tx = optax.MultiSteps(optax.sgd(1.0), 2, should_skip_update_fn=oc.microbatch_guard())
  state = tx.init(PARAMS)
  _, state = tx.update(jax.tree.map(lambda p: p * jnp.nan, PARAMS), state, PARAMS)
  found = oc.stats(state)
  assert set(found) == {"microbatch/norm", "microbatch/skipped"}
  assert bool(found["microbatch/skipped"]) and np.isnan(found["microbatch/norm"])
  assert found["microbatch/norm"].dtype == jnp.float32


def test_shard_map_devices_agree():
  mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
  guard = oc.microbatch_guard(max_norm=5.0, axis_name="i")
  decide = jax.jit(shard_map(lambda g: guard(g, jnp.int32(0), None), mesh=mesh,
                             in_specs=P("i"), out_specs=P()))
  assert not bool(decide(jnp.full(8, 1.5))[0])  # halves 3, globally 4.24
  assert bool(decide(jnp.full(8, 2.0))[0])  # halves 4, globally 5.66
  assert bool(decide(jnp.full(8, 1.0).at[6].set(jnp.nan))[0])  # device 1
