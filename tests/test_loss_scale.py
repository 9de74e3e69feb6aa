"""dynamic_loss_scale: the scale schedule against a numpy re-statement, the
whole chain skipping on overflow, float16 training, checkpoints, contract."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import optaxclip as oc
from optaxclip._loss_scale import LossScaleState, dynamic_loss_scale, loss_scale
from optaxclip._skip import skip_step

STEPS = 60
OVERFLOWS = {3, 4, 5, 6, 7, 8, 9, 10, 20, 33, 34, 47}
BASE = {"w": jnp.array([[0.5, -1.25], [3.0, 0.0]]), "b": jnp.array([1e-3, -7.0])}


def reference_schedule(overflows, *, initial, period, factor, min_scale):
  """MindSpore's DynamicLossScaleUpdateCell / jmp.DynamicLossScale, restated."""
  scale, good, rows = initial, 0, []
  for overflow in overflows:
    if overflow:
      scale, good = max(min_scale, scale / factor), 0
    else:
      good += 1
      if good >= period:
        scale, good = scale * factor, 0
    rows.append((scale, good))
  return np.asarray(rows)


def run_schedule(tx, overflows, state=None):
  """Feeds BASE * scale (Inf at overflow steps); returns unscaled grads and states."""
  def step(state, overflow):
    grads = jax.tree.map(lambda g: g * state.scale, BASE)
    grads["b"] = jnp.where(overflow, grads["b"].at[1].set(jnp.inf), grads["b"])
    unscaled, state = tx.update(grads, state)
    return state, (unscaled, state)

  state = tx.init(BASE) if state is None else state
  return jax.jit(lambda s, o: jax.lax.scan(step, s, o))(state, jnp.asarray(overflows))


@pytest.mark.parametrize("initial,period,factor,min_scale", [
    (64.0, 5, 2.0, 4.0), (27.0, 3, 3.0, 1.0)])
def test_schedule_matches_the_reference(initial, period, factor, min_scale):
  overflows = np.array([t in OVERFLOWS for t in range(STEPS)])
  tx = dynamic_loss_scale(initial, period=period, factor=factor, min_scale=min_scale)
  _, (unscaled, states) = run_schedule(tx, overflows)
  ref = reference_schedule(overflows, initial=initial, period=period,
                           factor=factor, min_scale=min_scale)
  worst = np.max(np.abs(np.asarray(states.scale, np.float64) - ref[:, 0]) / ref[:, 0])
  print(f"\nloss-scale schedule vs reference, {STEPS} steps: largest relative "
        f"difference {worst:.1e}")
  assert worst <= 1e-7
  assert np.min(states.scale) == min_scale  # the floor was reached and held
  np.testing.assert_array_equal(states.good_steps, ref[:, 1])
  np.testing.assert_array_equal(states.count, np.arange(1, STEPS + 1))
  np.testing.assert_array_equal(states.overflow_count, np.cumsum(overflows))
  # Finite steps come back unscaled (exactly for power-of-two scales).
  finite = ~overflows
  np.testing.assert_allclose(unscaled["w"][finite], np.broadcast_to(
      BASE["w"], (finite.sum(), 2, 2)), rtol=0 if factor == 2 else 1e-6)
  assert not np.any(np.isfinite(unscaled["b"][overflows][:, 1]))  # passed on


def test_growth_stops_below_float32_overflow():
  tx = dynamic_loss_scale(2.0**127, period=1)
  state = tx.init(BASE)
  for _ in range(3):
    _, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, BASE), state)
  assert float(state.scale) == 2.0**127 and int(state.good_steps) == 0


def test_checkpoint_and_jit_round_trip_keep_the_schedule():
  """Settings live in the transform: a restored state, run by a freshly built
  transform under jit, goes on exactly as the uninterrupted run (floor,
  period and factor included); jmp loses min_loss_scale here."""
  settings = dict(period=4, factor=4.0, min_scale=8.0)
  overflows = np.array([t in OVERFLOWS or 36 <= t < 46 for t in range(STEPS)])
  full, _ = run_schedule(dynamic_loss_scale(2.0**9, **settings), overflows)
  half, _ = run_schedule(dynamic_loss_scale(2.0**9, **settings), overflows[:30])
  leaves, treedef = jax.tree.flatten(half)
  restored = pickle.loads(pickle.dumps(
      jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])))
  assert type(restored) is LossScaleState
  restored = jax.tree.map(jnp.asarray, restored)
  resumed, (_, states) = run_schedule(dynamic_loss_scale(2.0**9, **settings),
                                      overflows[30:], restored)
  jax.tree.map(np.testing.assert_array_equal, resumed, full)
  assert float(np.min(states.scale)) == 8.0  # the floor survived
  assert {np.dtype(x.dtype) for x in jax.tree.leaves(resumed)} == \
      {np.dtype(np.float32), np.dtype(np.int32)}


# --------------------------------------------------------------------------
# Skipping the whole optimizer on an overflow

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.ones(3)}
CHAINS = {
    "skip_step(chain(loss_scale, adamw))": lambda **kw: skip_step(
        optax.chain(dynamic_loss_scale(2.0**10, **kw), optax.adamw(1e-2))),
    "chain(loss_scale, skip_step(adamw))": lambda **kw: optax.chain(
        dynamic_loss_scale(2.0**10, **kw), skip_step(optax.adamw(1e-2))),
}


def adam_state(state):
  return [s for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
      if isinstance(s, optax.ScaleByAdamState)][0]


@pytest.mark.parametrize("name", CHAINS)
def test_overflow_skips_the_whole_chain_and_backs_off(name):
  tx = CHAINS[name]()
  state = tx.init(PARAMS)
  step = jax.jit(tx.update)
  grads = jax.tree.map(lambda p: p * 0.1 * loss_scale(state), PARAMS)
  for _ in range(2):
    _, state = step(grads, state, PARAMS)
  before = adam_state(state)
  overflow = {"w": grads["w"].at[0, 0].set(jnp.inf), "b": grads["b"]}
  updates, state = step(overflow, state, PARAMS)
  after = adam_state(state)
  for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    assert np.asarray(old).tobytes() == np.asarray(new).tobytes()
  assert int(after.count) == 2
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  assert float(loss_scale(state)) == 2.0**9  # backed off, and it stuck
  found = oc.stats(state)
  assert found["loss_scale/overflow_count"] == 1 and found["skip/nonfinite_count"] == 1
  # The next finite step (at the new scale) goes through, unscaled.
  grads = jax.tree.map(lambda p: p * 0.1 * loss_scale(state), PARAMS)
  updates, state = step(grads, state, PARAMS)
  assert int(adam_state(state).count) == 3
  np.testing.assert_allclose(oc.stats(state)["skip/norm"],
                             oc.functional.global_norm(PARAMS) * 0.1, rtol=1e-6)
  assert not all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


def test_wrapping_skip_step_judges_unscaled_norms():
  """The scale doubles every 2 steps; the norm skip_step sees does not."""
  tx = skip_step(optax.chain(dynamic_loss_scale(2.0**4, period=2), optax.sgd(0.1)),
                 zscore=3.0, warmup_steps=2, max_norm=10.0)
  state = tx.init(PARAMS)
  step = jax.jit(tx.update)
  norm = float(oc.functional.global_norm(PARAMS))
  for _ in range(12):
    grads = jax.tree.map(lambda p: p * loss_scale(state), PARAMS)
    _, state = step(grads, state, PARAMS)
    np.testing.assert_allclose(state.stats.norm, norm, rtol=1e-6)
  assert float(loss_scale(state)) == 2.0**10
  assert int(state.stats.skipped_count) == 0


def test_loss_scale_is_found_anywhere_and_missing_is_an_error():
  for tx in (optax.MultiSteps(CHAINS["skip_step(chain(loss_scale, adamw))"](), 2),
             optax.inject_hyperparams(dynamic_loss_scale)(2.0**10),
             optax.named_chain(("ls", dynamic_loss_scale(2.0**10)),
                               ("opt", optax.sgd(0.1)))):
    assert float(jax.jit(loss_scale)(tx.init(PARAMS))) == 2.0**10
  with pytest.raises(ValueError, match=r"`loss_scale\(opt_state\)`.*found no"):
    loss_scale(optax.adam(0.1).init(PARAMS))
  two = optax.chain(dynamic_loss_scale(), dynamic_loss_scale())
  with pytest.raises(ValueError, match="found 2"):
    loss_scale(two.init(PARAMS))


def test_shard_map_devices_agree_on_an_overflow():
  mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
  tx = dynamic_loss_scale(2.0**10, axis_name="i")
  step = jax.jit(shard_map(tx.update, mesh=mesh, in_specs=(P("i"), P()),
                           out_specs=(P("i"), P())))
  state = tx.init(jnp.zeros(8))
  grads, state = step(jnp.full(8, 2.0**10).at[6].set(jnp.inf), state)  # device 1
  assert float(state.scale) == 2.0**9 and int(state.overflow_count) == 1
  np.testing.assert_array_equal(grads[:6], 1.0)


# --------------------------------------------------------------------------
# Float16 training: a linear regression whose float16 gradients underflow.

def test_float16_training_learns_only_with_loss_scaling():
  """``C * mean(err**2)`` over 4096 examples: each example's gradient
  ``2 * C * err / 4096`` (about 5e-9) flushes to zero in float16, so without
  loss scaling every gradient is exactly 0 and nothing is learned. The first
  scales (2**20 .. 2**16) overflow the float16 loss: those steps are skipped
  while the scale backs off to 2**15, and then the model learns."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4096, 8)), jnp.float16)
  y = x @ jnp.asarray(rng.normal(size=8), jnp.float16)

  def loss_fn(w):
    err = x @ w - y
    return 1e-5 * jnp.mean(err * err)

  w0 = jnp.zeros(8, jnp.float16)
  tx = skip_step(optax.chain(dynamic_loss_scale(2.0**20), optax.sgd(1e4)))

  def train(scaled, steps=40):
    @jax.jit
    def step(w, state):
      scale = loss_scale(state).astype(jnp.float16) if scaled else jnp.float16(1)
      loss, grads = jax.value_and_grad(lambda w: loss_fn(w) * scale)(w)
      updates, state = tx.update(grads, state, w)
      return optax.apply_updates(w, updates), state, grads

    w, state = w0, tx.init(w0)
    for _ in range(steps):
      w, state, grads = step(w, state)
    assert w.dtype == jnp.float16
    return float(loss_fn(w)), state, grads

  start = float(loss_fn(w0))
  unscaled_loss, _, grads = train(scaled=False)
  assert np.all(np.asarray(grads) == 0) and unscaled_loss == start
  scaled_loss, state, _ = train(scaled=True)
  assert scaled_loss < 1e-3 * start
  assert float(loss_scale(state)) == 2.0**15 and int(state.stats.skipped_count) == 5


# --------------------------------------------------------------------------
# Beyond the shared contract (tests/test_contract.py): this transform's
# own edge cases, statistics and argument errors.

def tree_like(dtype=jnp.float32, scale=1.0):
  rng = np.random.default_rng(0)
  tree = {"w": rng.normal(size=(8, 4)), "b": rng.normal(size=(4,)), "n": None}
  return jax.tree.map(lambda x: jnp.asarray(x * scale * 256, dtype), tree)


def signature(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x),
                                 getattr(x, "weak_type", None)), tree)


def test_finite_at_zero():
  tx = dynamic_loss_scale(2.0**15, period=2)
  zeros = jax.tree.map(jnp.zeros_like, tree_like())
  state = tx.init(zeros)
  for _ in range(2):
    out, state = jax.jit(tx.update)(zeros, state)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert float(state.scale) == 2.0**16 and int(state.overflow_count) == 0


def test_stats_report_the_loss_scale():
  tx = optax.chain(dynamic_loss_scale(2.0**4), optax.sgd(0.1))
  _, state = tx.update(tree_like(), tx.init(tree_like()))
  assert oc.stats(state) == {"loss_scale/scale": 16.0, "loss_scale/good_steps": 1,
                             "loss_scale/count": 1, "loss_scale/overflow_count": 0}
