"""dynamic_loss_scale: the scale schedule against a numpy re-statement, the
whole chain skipping on overflow, float16 training, checkpoints, contract."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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
  # Overflowed steps pass zeros on, never the Inf.
  assert all(np.all(np.asarray(u)[overflows] == 0) for u in jax.tree.leaves(unscaled))


def test_growth_stops_at_the_largest_scale():
  tx = dynamic_loss_scale(2.0**126, period=1)
  state = tx.init(BASE)
  for _ in range(3):
    _, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, BASE), state)
  assert float(state.scale) == 2.0**126 and int(state.good_steps) == 0


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
# name -> (builder, whether a skip_step sees the overflow and counts it)
GUARDED = {
    "skip_step(chain(loss_scale, adamw))": (lambda **kw: skip_step(
        optax.chain(dynamic_loss_scale(2.0**10, **kw), optax.adamw(1e-2))), True),
    "loss_scale(adamw)": (lambda **kw: dynamic_loss_scale(
        2.0**10, inner=optax.adamw(1e-2), **kw), False),
    "loss_scale(skip_step(adamw))": (lambda **kw: dynamic_loss_scale(
        2.0**10, inner=skip_step(optax.adamw(1e-2)), **kw), False),
    "skip_step(loss_scale(adamw))": (lambda **kw: skip_step(dynamic_loss_scale(
        2.0**10, inner=optax.adamw(1e-2), **kw)), True),
}


def adam_state(state):
  return [s for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
      if isinstance(s, optax.ScaleByAdamState)][0]


@pytest.mark.parametrize("name", GUARDED)
def test_overflow_skips_the_whole_chain_and_backs_off(name):
  make, skip_sees_it = GUARDED[name]
  tx = make()
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
  assert found["loss_scale/overflow_count"] == 1
  assert found.get("skip/nonfinite_count", 0) == int(skip_sees_it)
  # The next finite step (at the new scale) goes through, unscaled.
  grads = jax.tree.map(lambda p: p * 0.1 * loss_scale(state), PARAMS)
  updates, state = step(grads, state, PARAMS)
  assert int(adam_state(state).count) == 3
  if "skip/norm" in found:  # skip_step judges the unscaled gradients
    np.testing.assert_allclose(oc.stats(state)["skip/norm"],
                               oc.functional.global_norm(PARAMS) * 0.1, rtol=1e-6)
  assert not all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


def overflow_run(tx, steps=12, overflows=(3, 4, 8), scale=1.0):
  """Trains PARAMS on loss-scaled gradients ``(p - 0.5) * scale``, Inf at
  ``overflows``; returns the params, the last state and every update."""
  @jax.jit
  def step(params, state, t):
    grads = jax.tree.map(lambda p: (p - 0.5) * scale * loss_scale(state), params)
    grads["w"] = jnp.where(jnp.isin(t, jnp.asarray(overflows)),
                           grads["w"].at[1, 2].set(jnp.inf), grads["w"])
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  params, state, every = PARAMS, tx.init(PARAMS), []
  for t in range(steps):
    params, state, updates = step(params, state, t)
    every.append(updates)
  return params, state, every


def reference_run(inner, steps=12, overflows=(3, 4, 8), scale=1.0):
  """``inner`` fed the true gradients, the overflowed steps left out."""
  params, state = PARAMS, inner.init(PARAMS)
  update = jax.jit(inner.update)
  for t in range(steps):
    if t not in overflows:
      grads = jax.tree.map(lambda p: (p - 0.5) * scale, params)
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
  return params


# Every optaxclip clipper, between the loss scaling and the optimizer.
CLIPPERS = {
    "clip_by_global_norm": lambda: oc.clip_by_global_norm(0.5),
    "clip_by_global_norm_raise": lambda: oc.clip_by_global_norm(
        0.5, nonfinite="raise"),
    "clip_by_norm": lambda: oc.clip_by_norm(0.3),
    "clip_grad_norm": lambda: oc.clip_grad_norm(0.5),
    "adaptive_grad_clip": lambda: oc.adaptive_grad_clip(0.05),
    "auto_clip": lambda: oc.auto_clip(50.0, history=8),
    "zclip": lambda: oc.zclip(warmup_steps=2),
    "adagc": lambda: oc.adagc(warmup_steps=2),
    "clip_by_value": lambda: oc.clip_by_value(0.2),
}


@pytest.mark.parametrize("clipper", [None, *CLIPPERS])
def test_wrapper_drops_overflowed_steps_for_any_clipper_inside(clipper):
  """dynamic_loss_scale(chain(clipper, adamw)) is ``chain(clipper, adamw)``
  on the true gradients with the overflowed steps never seen."""
  def inner():
    opt = optax.adamw(0.05)
    return opt if clipper is None else optax.chain(CLIPPERS[clipper](), opt)

  tx = dynamic_loss_scale(2.0**8, inner=inner(), period=3)
  params, state, every = overflow_run(tx, scale=4.0)
  for t in (3, 4, 8):
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(every[t]))
  assert int(state.loss_scale.overflow_count) == 3
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               params, reference_run(inner(), scale=4.0))


WRAPPED = dynamic_loss_scale(2.0**10, inner=optax.adam(0.1), period=2)


@jax.jit
def wrapped_step(params, state, overflow):
  grads = jax.tree.map(lambda p: (p - 0.5) * loss_scale(state), params)
  grads["b"] = jnp.where(overflow, grads["b"].at[0].set(jnp.nan), grads["b"])
  updates, state = WRAPPED.update(grads, state, params)
  return optax.apply_updates(params, updates), state


@jax.jit
def adam_step(params, state):
  grads = jax.tree.map(lambda p: p - 0.5, params)
  updates, state = optax.adam(0.1).update(grads, state, params)
  return optax.apply_updates(params, updates), state


@settings(max_examples=25, deadline=None)
@given(overflows=st.lists(st.booleans(), min_size=1, max_size=12),
       exponent=st.integers(0, 40))
def test_wrapper_is_the_optimizer_on_the_finite_steps(overflows, exponent):
  """For any pattern of overflows and any power-of-two scale: the wrapped
  Adam is Adam run on the finite steps only, and every overflow backs off."""
  state = WRAPPED.init(PARAMS)
  state = state._replace(loss_scale=state.loss_scale._replace(
      scale=jnp.float32(2.0**exponent)))
  params, ref, ref_state = PARAMS, PARAMS, optax.adam(0.1).init(PARAMS)
  for overflow in overflows:
    params, state = wrapped_step(params, state, overflow)
    if not overflow:
      ref, ref_state = adam_step(ref, ref_state)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               (params, state.inner_state), (ref, ref_state))
  assert int(state.loss_scale.overflow_count) == sum(overflows)


@pytest.mark.parametrize("clipper", [None, "clip_by_global_norm_raise", "zclip",
                                     "auto_clip"])
def test_chain_form_passes_no_overflow_on(clipper):
  """The chain form: an overflow gives the rest of the chain zeros, so Adam's
  moments and the params stay finite (they were NaN for ever before)."""
  parts = [] if clipper is None else [CLIPPERS[clipper]()]
  tx = optax.chain(dynamic_loss_scale(2.0**4), *parts, optax.adam(0.1))
  params, state, every = overflow_run(tx)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state)
             if jnp.issubdtype(x.dtype, jnp.inexact))
  assert all(np.all(np.isfinite(u)) for e in every for u in jax.tree.leaves(e))
  assert int(oc.stats(state)["loss_scale/overflow_count"]) == 3


def test_wrapper_passes_extra_args_and_takes_the_optimizer_first():
  def init_fn(params):
    del params
    return jnp.zeros([], jnp.float32)

  def update_fn(updates, state, params=None, *, value):
    del params, state
    return updates, jnp.asarray(value, jnp.float32)

  tx = dynamic_loss_scale(optax.GradientTransformationExtraArgs(init_fn, update_fn))
  state = tx.init(PARAMS)
  assert float(loss_scale(state)) == 2.0**15  # the default scale
  step = jax.jit(tx.update)
  _, state = step(PARAMS, state, PARAMS, value=3.0)
  assert float(state.inner_state) == 3.0
  _, state = step({"w": PARAMS["w"] * jnp.inf, "b": PARAMS["b"]}, state, PARAMS,
                  value=5.0)
  assert float(state.inner_state) == 3.0  # overflow: untouched
  sgd = optax.sgd(1.0)
  a, b = dynamic_loss_scale(sgd, period=7), dynamic_loss_scale(inner=sgd, period=7)
  assert jax.tree.structure(a.init(PARAMS)) == jax.tree.structure(b.init(PARAMS))


def test_loss_scale_is_found_anywhere_and_missing_is_an_error():
  sgd = optax.sgd(0.1)
  for tx in (dynamic_loss_scale(2.0**10, inner=optax.MultiSteps(sgd, 2)),
             skip_step(dynamic_loss_scale(2.0**10, inner=sgd)),
             dynamic_loss_scale(2.0**10, inner=skip_step(optax.MultiSteps(sgd, 2))),
             optax.inject_hyperparams(dynamic_loss_scale)(2.0**10),
             optax.inject_hyperparams(dynamic_loss_scale)(2.0**10, inner=sgd),
             optax.named_chain(("ls", dynamic_loss_scale(2.0**10)),
                               ("opt", optax.sgd(0.1)))):
    state = tx.init(PARAMS)
    assert float(jax.jit(loss_scale)(state)) == 2.0**10
    found = {k: v for k, v in oc.stats(state).items() if k.endswith("loss_scale/scale")}
    assert [float(v) for v in found.values()] == [2.0**10]
  with pytest.raises(ValueError, match=r"`loss_scale\(opt_state\)`.*found no"):
    loss_scale(optax.adam(0.1).init(PARAMS))
  two = optax.chain(dynamic_loss_scale(), dynamic_loss_scale())
  with pytest.raises(ValueError, match="found 2"):
    loss_scale(two.init(PARAMS))


@pytest.mark.parametrize("wrapped", [False, True])
def test_loss_scale_inside_multisteps_is_an_error(wrapped):
  """Inside MultiSteps the accumulator sums scaled gradients: one overflow
  makes it NaN for good (or, behind a guard, the scale never backs off)."""
  inner = (dynamic_loss_scale(inner=optax.adamw(1e-2)) if wrapped else
           skip_step(optax.chain(dynamic_loss_scale(), optax.adamw(1e-2))))
  state = optax.MultiSteps(inner, 2).init(PARAMS)
  with pytest.raises(ValueError, match=r"(?s)inside optax.MultiSteps.*"
                     r"dynamic_loss_scale\(optax.MultiSteps\(optimizer, k\)\)"):
    loss_scale(state)


def test_apply_if_finite_around_the_loss_scaling_is_an_error():
  """apply_if_finite rolls the back-off back: the scale stays too large and
  the next steps overflow again, until max_consecutive_errors."""
  tx = optax.apply_if_finite(dynamic_loss_scale(2.0**10, inner=optax.adam(0.1)), 3)
  state = tx.init(PARAMS)
  inf = jax.tree.map(lambda p: p * jnp.inf, PARAMS)
  _, after = tx.update(inf, state, PARAMS)
  assert float(after.inner_state.loss_scale.scale) == 2.0**10  # rolled back
  with pytest.raises(ValueError, match=r"inside optax.apply_if_finite, which "
                     r"rolls the scale's back-off back"):
    loss_scale(state)
  inside = dynamic_loss_scale(2.0**10, inner=optax.apply_if_finite(optax.adam(0.1), 3))
  state = inside.init(PARAMS)
  _, state = inside.update(inf, state, PARAMS)
  assert float(loss_scale(state)) == 2.0**9


# --------------------------------------------------------------------------
# Clippers must see unscaled gradients.

STATEFUL_CLIPPERS = list(CLIPPERS)  # clip_by_value too: its state is empty
WRONG_ORDERS = {
    "chain(clip, loss_scale, sgd)": lambda clip: optax.chain(
        clip, dynamic_loss_scale(), optax.sgd(1.0)),
    "chain(clip, loss_scale(sgd))": lambda clip: optax.chain(
        clip, dynamic_loss_scale(optax.sgd(1.0))),
    "named_chain(b=clip, a=loss_scale)": lambda clip: optax.named_chain(
        ("b_clip", clip), ("a_scale", dynamic_loss_scale()), ("opt", optax.sgd(1.0))),
    "chain(masked(clip), loss_scale, sgd)": lambda clip: optax.chain(
        optax.masked(clip, {"w": True, "b": False}), dynamic_loss_scale(),
        optax.sgd(1.0)),
    "chain(skip_step(chain(clip, sgd)), loss_scale)": lambda clip: optax.chain(
        skip_step(optax.chain(clip, optax.sgd(1.0))), dynamic_loss_scale()),
}


@pytest.mark.parametrize("order", WRONG_ORDERS)
@pytest.mark.parametrize("clipper", STATEFUL_CLIPPERS)
def test_clipper_before_the_loss_scaling_is_an_error(clipper, order):
  tx = WRONG_ORDERS[order](CLIPPERS[clipper]())
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=r"(?s)`loss_scale\(opt_state\)`: the "
                     r"clipper state \w+State at opt_state\S+ comes before "
                     r"dynamic_loss_scale's state.*dynamic_loss_scale\(optax.chain"):
    loss_scale(state)


@pytest.mark.parametrize("clipper", STATEFUL_CLIPPERS)
def test_wrappers_reject_a_clipper_before_the_loss_scaling_at_init(clipper):
  chain = optax.chain(CLIPPERS[clipper](), dynamic_loss_scale(), optax.sgd(1.0))
  with pytest.raises(ValueError, match=r"`skip_step\(inner=...\).init`: .*"
                     r"inner_state\[0\] comes before"):
    skip_step(chain).init(PARAMS)
  with pytest.raises(ValueError, match=r"`dynamic_loss_scale\(inner=...\).init`"):
    dynamic_loss_scale(optax.chain(CLIPPERS[clipper](), dynamic_loss_scale(),
                                   optax.sgd(1.0))).init(PARAMS)


TRUE = {"w": jnp.array([[0.1, -0.2, 0.0], [0.0, 0.0, 0.2]]), "b": jnp.zeros(3)}
RIGHT_ORDERS = {
    "chain(loss_scale, clip, sgd)": lambda: optax.chain(
        dynamic_loss_scale(2.0**10), oc.clip_by_global_norm(1.0), optax.sgd(1.0)),
    "loss_scale(chain(clip, sgd))": lambda: dynamic_loss_scale(
        2.0**10, inner=optax.chain(oc.clip_by_global_norm(1.0), optax.sgd(1.0))),
    "skip_step(chain(loss_scale, clip, sgd))": lambda: skip_step(optax.chain(
        dynamic_loss_scale(2.0**10), oc.clip_by_global_norm(1.0), optax.sgd(1.0))),
    "named_chain(z=loss_scale, a=clip)": lambda: optax.named_chain(
        ("z_scale", dynamic_loss_scale(2.0**10)),
        ("a_clip", oc.clip_by_global_norm(1.0)), ("opt", optax.sgd(1.0))),
    "partition(clip | loss_scale(sgd))": lambda: optax.partition(
        {"clipped": optax.chain(oc.clip_by_global_norm(1.0), optax.sgd(1.0)),
         "scaled": dynamic_loss_scale(2.0**10, inner=optax.sgd(1.0))},
        {"w": "scaled", "b": "clipped"}),
}


@pytest.mark.parametrize("order", RIGHT_ORDERS)
def test_clipper_after_the_loss_scaling_sees_the_true_norm(order):
  """True norm 0.3 under max_norm 1.0: the update is the unclipped gradient
  (a clipper before the scaling made it 300x too small)."""
  tx = RIGHT_ORDERS[order]()
  state = tx.init(PARAMS)
  scale = loss_scale(state)  # no error: the order is right
  assert float(oc.functional.global_norm(TRUE)) == pytest.approx(0.3)
  scaled = jax.tree.map(lambda g: g * scale, TRUE)
  updates, state = jax.jit(tx.update)(scaled, state, PARAMS)
  jax.tree.map(lambda u, g: np.testing.assert_allclose(u, -g, rtol=1e-6),
               updates, TRUE)
  found = oc.stats(state)
  if "clip/norm" in found and order != "partition(clip | loss_scale(sgd))":
    np.testing.assert_allclose(found["clip/norm"], 0.3, rtol=1e-6)
    assert int(found["clip/clipped_count"]) == 0


def test_the_clipper_before_the_loss_scaling_clipped_wrongly():
  """What the error prevents: the scaled norm (0.3 * 1024) is clipped."""
  tx = optax.chain(oc.clip_by_global_norm(1.0), dynamic_loss_scale(2.0**10),
                   optax.sgd(1.0))
  updates, _ = tx.update(jax.tree.map(lambda g: g * 2.0**10, TRUE),
                         tx.init(PARAMS))
  np.testing.assert_allclose(updates["w"], -TRUE["w"] / (0.3 * 2.0**10), rtol=1e-5)


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


@pytest.mark.parametrize("inner", [None, optax.sgd(-1.0)])
def test_shard_map_devices_agree_on_an_overflow(inner):
  mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
  tx = dynamic_loss_scale(2.0**10, axis_name="i", inner=inner)
  step = jax.jit(shard_map(tx.update, mesh=mesh, in_specs=(P("i"), P()),
                           out_specs=(P("i"), P())))
  state = tx.init(jnp.zeros(8))
  grads, state = step(jnp.full(8, 2.0**10), state)
  np.testing.assert_array_equal(grads, 1.0)
  grads, state = step(jnp.full(8, 2.0**10).at[6].set(jnp.inf), state)  # device 1
  assert float(loss_scale(state)) == 2.0**9
  assert int(oc.stats(state)["loss_scale/overflow_count"]) == 1
  np.testing.assert_array_equal(grads, 0.0)  # device 0 dropped its half too


# --------------------------------------------------------------------------
# Float16 training: a linear regression whose float16 gradients underflow.

@pytest.mark.parametrize("wrapped", [False, True])
def test_float16_training_learns_only_with_loss_scaling(wrapped):
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
  tx = (dynamic_loss_scale(2.0**20, inner=optax.sgd(1e4)) if wrapped else
        skip_step(optax.chain(dynamic_loss_scale(2.0**20), optax.sgd(1e4))))

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
  found = oc.stats(state)
  assert float(loss_scale(state)) == 2.0**15
  assert found["loss_scale/overflow_count"] == 5
  assert found.get("skip/skipped_count", 5) == 5


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


def test_optimizer_given_twice_is_an_error():
  with pytest.raises(TypeError, match=r"`dynamic_loss_scale\(initial_scale=...\)`"
                     r" is an optax transformation and `inner` is given too"):
    dynamic_loss_scale(optax.sgd(0.1), inner=optax.sgd(0.1))


@pytest.mark.parametrize("inner", [None, optax.sgd(0.1)])
def test_state_does_not_alias_the_users_initial_scale(inner):
  """The state holds a copy: donating it leaves the user's array alive, and
  under inject_hyperparams the scale and the injected value are two buffers
  (one buffer donated twice was an error)."""
  users = jnp.array(16.0, jnp.float32)
  tx = dynamic_loss_scale(users, inner=inner)
  state = tx.init(PARAMS)
  assert loss_scale(state).unsafe_buffer_pointer() != users.unsafe_buffer_pointer()
  step = jax.jit(tx.update, donate_argnums=1)
  grads = jax.tree.map(lambda p: p * 16.0, PARAMS)
  for _ in range(2):
    _, state = step(grads, state, PARAMS)
  assert not users.is_deleted() and float(users) == 16.0
  tx = optax.inject_hyperparams(dynamic_loss_scale)(16.0, inner=inner)
  state = tx.init(PARAMS)
  for _ in range(2):
    _, state = jax.jit(tx.update, donate_argnums=1)(grads, state, PARAMS)
  assert float(loss_scale(state)) == 16.0


def test_scale_never_grows_past_a_normal_reciprocal():
  """Above 2**126, 1/scale is subnormal and flushed to zero: every unscaled
  gradient was 0 and no overflow was ever counted."""
  tx = dynamic_loss_scale(2.0**120, period=1)
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  for _ in range(10):
    _, state = update(jax.tree.map(jnp.zeros_like, PARAMS), state)
  assert float(loss_scale(state)) == 2.0**126
  grads = jax.tree.map(lambda p: jnp.full_like(p, 2.0**126), PARAMS)
  unscaled, state = update(grads, state)
  for leaf in jax.tree.leaves(unscaled):
    np.testing.assert_array_equal(leaf, 1.0)


# --------------------------------------------------------------------------
# Moved from test_fuzz.py and test_arguments.py: ``loss_scale(state)``
# without exactly one loss-scale state, exact unscaling at every power of two
# (hypothesis), a traced initial scale, and any clipper put before the loss
# scaling (refused, or given the true gradients).

import hypothesis.extra.numpy as hnp  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402
from hypothesis import assume, example  # noqa: E402


def test_loss_scale_names_a_state_without_exactly_one_loss_scale():
  params = {"w": jnp.ones(2)}
  for tx in (optax.sgd(0.1), optax.chain(oc.dynamic_loss_scale(), oc.dynamic_loss_scale())):
    with pytest.raises(ValueError, match="loss_scale"):
      oc.loss_scale(tx.init(params))


@fuzz_settings(40)
@example(exponent=126, unit=np.ones(4, np.float32))  # the largest scale reached
@given(exponent=st.integers(-24, 126), unit=hnp.arrays(
    np.float32, (4,), elements=st.floats(0.5, 2, width=32)))
def test_loss_scale_unscales_exactly_at_every_power_of_two(exponent, unit):
  # Every scale the schedule can reach (at most 2**126, whose reciprocal is
  # still a normal float) divides exactly: gradients come back as they were.
  scale = 2.0**exponent
  tx = oc.dynamic_loss_scale(scale, min_scale=min(scale, 1.0))
  true = jnp.asarray(unit)
  scaled = true * jnp.float32(scale)
  assume(bool(jnp.all(jnp.isfinite(scaled))))
  out, state = tx.update({"g": scaled}, tx.init(None))
  np.testing.assert_array_equal(out["g"], true, err_msg=f"unscaled by 2**{exponent}")
  assert int(state.overflow_count) == 0


def test_traced_initial_scale_acts_as_one():
  params = {"w": jnp.array([[1.0, -2.0], [0.5, 1.0]]), "b": jnp.array([0.1, 0.0])}
  tx = optax.inject_hyperparams(oc.dynamic_loss_scale)(initial_scale=-4.0)
  with pytest.raises(ValueError, match="initial_scale"):
    tx.init(params)  # eager: concrete, checked
  state = jax.jit(tx.init)(params)  # traced: clamped
  assert float(oc.loss_scale(state)) == 1.0


CLIPPERS_OF_ANY_KIND = {
    "clip_by_global_norm": lambda: oc.clip_by_global_norm(1.0),
    "clip_by_norm": lambda: oc.clip_by_norm(1.0),
    "clip_grad_norm": lambda: oc.clip_grad_norm(1.0),
    "clip_by_value": lambda: oc.clip_by_value(0.5),
    "adaptive_grad_clip": lambda: oc.adaptive_grad_clip(1.0),
    "auto_clip": lambda: oc.auto_clip(50.0, history=4),
    "zclip": lambda: oc.zclip(warmup_steps=2),
    "adagc": lambda: oc.adagc(warmup_steps=2),
}


@pytest.mark.parametrize("name", list(CLIPPERS_OF_ANY_KIND))
def test_clipper_before_loss_scale_is_rejected_or_correct(name):
  # The clipper would see the scaled gradients: refused before any update
  # is applied (at init, reading the scale, or updating), or the updates are
  # those of the same clipper on the true gradients.
  scale = 2.0**10
  tx = optax.chain(CLIPPERS_OF_ANY_KIND[name](), oc.dynamic_loss_scale(scale, period=1000),
                   optax.sgd(1.0))
  reference = optax.chain(CLIPPERS_OF_ANY_KIND[name](), optax.sgd(1.0))
  params = {"w": jnp.full((2, 3), 2.0), "b": jnp.full(3, 2.0)}
  rng = np.random.default_rng(0)
  true = {k: jnp.asarray(rng.normal(size=v.shape) * 0.1, jnp.float32)
          for k, v in params.items()}
  try:
    state = tx.init(params)
    scaled = jax.tree.map(lambda g: g * oc.loss_scale(state), true)
    updates, state = tx.update(scaled, state, params)
  except (ValueError, TypeError) as error:
    assert "dynamic_loss_scale" in str(error), str(error)
    return
  ref_state = reference.init(params)
  for _ in range(3):
    want, ref_state = reference.update(true, ref_state, params)
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7,
                                 err_msg="the clipper saw the scaled gradients")
    true = jax.tree.map(lambda g: g * 1.5, true)
    scaled = jax.tree.map(lambda g: g * oc.loss_scale(state), true)
    updates, state = tx.update(scaled, state, params)
