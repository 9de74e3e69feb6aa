"""dynamic_loss_scale: the scale schedule against a numpy re-statement, the
whole chain skipping on overflow, float16 training, checkpoints, contract;
PyTorch's GradScaler (golden and live, the migration page's recipe run as
written), accumulation (every_k_steps), DeepSpeed's and Megatron-LM's
hysteresis (restated from their code), the floor."""

import contextlib
import functools
import importlib.util
import io
import json
import pathlib
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_docs
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import optaxclip as oc
from optaxclip._guards.loss_scale import LossScaleState, dynamic_loss_scale, loss_scale
from optaxclip._guards.skip import skip_step

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
  # GradScaler grows while the grown float32 is finite: 2**127 with factor
  # 2; with factor 3 from 3**79 (3**80 < 2**128 < 3**81), 3**80.
  for first, factor, top in [(2.0**126, 2.0, 2.0**127), (3.0**79, 3.0, 3.0**80)]:
    tx = dynamic_loss_scale(first, period=1, factor=factor)
    state = tx.init(BASE)
    for _ in range(3):
      _, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, BASE), state)
    assert float(state.scale) == float(np.float32(top)) and int(state.good_steps) == 0


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
      scale = loss_scale(state) if scaled else jnp.float32(1)
      # The documented recipe: a float32 product. The loss is float16 here,
      # so its cotangent (the scale) is float16 in the backward pass, Inf
      # from 2**16 on, in JAX as in PyTorch: 2**20 .. 2**16 overflow.
      grads = jax.grad(lambda w: loss_fn(w).astype(jnp.float32) * scale)(w)
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
                             "loss_scale/hysteresis": 1, "loss_scale/count": 1,
                             "loss_scale/overflow_count": 0,
                             "loss_scale/min_scale_overflow_count": 0}


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gradscalers_top_scale_unscales_exactly(dtype):
  """GradScaler's largest scale, 2**127, whose reciprocal is subnormal (XLA
  flushes it to zero): unscaled by two normal factors, exactly. float16
  gradients cannot hold it: their overflow backs the scale off."""
  tx = dynamic_loss_scale(2.0**120, period=1)
  params = {"w": jnp.zeros(3, dtype)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(10):
    _, state = update(jax.tree.map(jnp.zeros_like, params), state)
  assert float(loss_scale(state)) == 2.0**127
  grads = {"w": (jnp.array([1.0, -0.75, 2.0**-100], jnp.float32) * 2.0**127).astype(dtype)}
  unscaled, state = update(grads, state)
  if dtype == jnp.float16:
    assert int(state.overflow_count) == 1 and float(state.scale) == 2.0**126
    assert not np.any(np.asarray(unscaled["w"]))
  else:
    assert unscaled["w"].dtype == dtype and int(state.overflow_count) == 0
    np.testing.assert_array_equal(unscaled["w"], jnp.array([1.0, -0.75, 2.0**-100], dtype))


# --------------------------------------------------------------------------
# PyTorch's GradScaler: docs/migration/pytorch.md's recipe, followed to the
# letter (its code blocks are run here), against GradScaler's runs: golden
# (tests/golden/gradscaler.json) and live when torch is installed.

GOLDEN_DIR = pathlib.Path(__file__).resolve().parent / "golden"
GRADSCALER = json.loads((GOLDEN_DIR / "gradscaler.json").read_text())
RUNS = {run["name"]: run for run in GRADSCALER["runs"]}
PAGE = "migration/pytorch.md"


@functools.cache
def page_recipes() -> dict[int, dict]:
  """The optaxclip blocks of the page's "Loss scaling" section, by the
  micro-batches per optimizer step they set up: each block's namespace (run
  on a copy of the one before, so that a later ``tx`` does not rebind an
  earlier block's)."""
  text = (test_docs.DOCS / PAGE).read_text().splitlines()
  start = text.index("## Loss scaling") + 1
  end = next((i for i in range(start, len(text)) if text[i].startswith("## ")),
             len(text)) + 1
  namespace: dict = {"__name__": "docs.loss_scaling"}
  recipes = {}
  for block in test_docs.parse(test_docs.DOCS / PAGE):
    if block.skip is None and start <= block.line <= end:
      namespace = dict(namespace)
      with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block.code, f"docs/{PAGE}:{block.line}", "exec"), namespace)  # noqa: S102
      if "train_step" in namespace and 1 not in recipes:
        recipes[1] = namespace
      if "micro_step" in namespace and namespace.get("k") not in recipes:
        recipes[namespace["k"]] = namespace
  return recipes


def run_page_recipe(run: dict) -> dict:
  """The page's recipe trained on a golden run's data, recorded as the
  golden run is: the scale after each optimizer step, Adam's step count,
  the final params."""
  k = run["k"]
  recipe = page_recipes()[k]
  step = recipe["train_step" if k == 1 else "micro_step"]
  x = np.asarray(run["x"], np.float32)
  y = np.asarray(run["y"], np.float32)
  y[run["nan"]] = np.nan
  params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
  opt_state = recipe["tx"].init(params)
  scales, adam_steps = [], []
  for t in range(len(x)):
    params, opt_state = step(params, opt_state, x[t], y[t])
    if t % k == k - 1:
      scales.append(float(oc.loss_scale(opt_state)))
      adam_steps.append(int(adam_state(opt_state).count))
  return {"scales": scales, "adam_steps": adam_steps, "params": params}


def assert_same_run(ours: dict, torch_run: dict, name: str) -> None:
  """Scales and skipped steps equal, step by step; params to float32
  rounding (PyTorch's Adam and clip_grad_norm_ round elsewhere)."""
  np.testing.assert_array_equal(ours["scales"], torch_run["scales"], err_msg=name)
  np.testing.assert_array_equal(ours["adam_steps"], torch_run["adam_steps"],
                                err_msg=name)
  for key in ("w", "b"):
    np.testing.assert_allclose(np.asarray(ours["params"][key]).ravel(),
                               np.ravel(torch_run["params"][key]),
                               rtol=1e-4, atol=2e-5, err_msg=f"{name}: {key}")


@pytest.mark.parametrize("name", RUNS)
def test_page_recipe_reproduces_gradscaler(name):
  """recipe: the scale passes 2**16 (to 2**19), where a float16 scale (the
  old docstring's recipe) made every step at 65536 overflow; nan_steps: 25
  NaN steps in a row take GradScaler's scale to 2**-8, which the page's
  min_scale=2.0**-126 follows; accumulation: 4 micro-batches per step, one
  back-off per window, growth counted in optimizer steps."""
  run = RUNS[name]
  ours = run_page_recipe(run)
  assert_same_run(ours, run, name)
  print(f"\n{name}: {len(run['scales'])} optimizer steps, scales 2**"
        f"{int(np.log2(min(run['scales'])))} .. 2**{int(np.log2(max(run['scales'])))}, "
        f"{len(run['scales']) - run['adam_steps'][-1]} skipped: equal to GradScaler's")


def test_page_recipe_reproduces_live_gradscaler():
  """The same against GradScaler run now (torch installed): the golden file
  is what the generator gives today."""
  pytest.importorskip("torch")
  spec = importlib.util.spec_from_file_location("generate", GOLDEN_DIR / "generate.py")
  generate = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(generate)
  for name, seed, steps, outliers, nan, k in generate.GRADSCALER_RUNS:
    x, y = generate.gradscaler_data(seed, steps, outliers)
    np.testing.assert_array_equal(x, np.asarray(RUNS[name]["x"], np.float32))
    live = generate.gradscaler_run(x, y, nan, k)
    assert_same_run(run_page_recipe(RUNS[name]), live, name)


def test_default_floor_is_not_gradscalers():
  """Without the page's min_scale the NaN run stops backing off at 1 and
  differs from GradScaler from there on (the documented difference)."""
  run = RUNS["nan_steps"]
  tx = dynamic_loss_scale(2.0**16, period=4, inner=optax.sgd(0.0))
  state = tx.init(PARAMS)
  scales = []
  for t in range(len(run["scales"])):
    overflow = t in run["nan"]
    grads = jax.tree.map(lambda p: p * (jnp.nan if overflow else 1.0), PARAMS)
    _, state = tx.update(grads, state, PARAMS)
    scales.append(float(loss_scale(state)))
  assert min(scales) == 1.0 and min(run["scales"]) == 2.0**-8
  # From 2**17 (the scale before the NaN run), 17 back-offs reach 1.
  assert run["scales"][4] == 2.0**17
  assert int(state.loss_scale.min_scale_overflow_count) == 25 - 17


def test_documented_scaling_lines_pass_2_to_the_16():
  """Every documented ``jax.grad(lambda p: loss_fn(p)... * scale)`` line
  (docstrings) gives finite gradients at scale 2**19 for a float32 loss of
  float16 maths, as GradScaler does; ``scale.astype(jnp.float16)`` gave Inf."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32) * 0.1

  def loss_fn(p):
    return jnp.mean((x.astype(jnp.float16) @ p.astype(jnp.float16)).astype(
        jnp.float32) ** 2)

  params, scale = jnp.ones(4) * 0.1, jnp.float32(2.0**19)
  lines = [line.strip() for line in dynamic_loss_scale.__doc__.splitlines()
           if "jax.grad(lambda p:" in line]
  assert lines
  want = jax.grad(lambda p: loss_fn(p) * scale)(params)
  for line in lines:
    namespace = {"jax": jax, "jnp": jnp, "loss_fn": loss_fn, "scale": scale,
                 "params": params}
    exec(line, namespace)  # noqa: S102
    assert np.all(np.isfinite(namespace["grads"])), line
    np.testing.assert_array_equal(namespace["grads"], want)


# --------------------------------------------------------------------------
# Accumulation: every_k_steps

K = 3
SEQUENCE = [1.0, 2.0, 0.5, 1.0, jnp.inf, 1.0, jnp.nan, jnp.inf, 2.0, 1.0, 1.0, 3.0,
            1.0, 1.0, 1.0, 0.5, 0.25, 2.0]


def accumulate_run(tx, sequence=SEQUENCE):
  """Micro-batch t's gradient is ``(p - 0.5) * factor_t * scale`` (Inf/NaN
  factors overflow); returns per micro-batch the scale used, the updates,
  the state after."""
  @jax.jit
  def step(params, state, factor):
    grads = jax.tree.map(lambda p: (p - 0.5) * factor * loss_scale(state), params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  params, state, rows = PARAMS, tx.init(PARAMS), []
  for factor in sequence:
    used = float(loss_scale(state))
    params, state, updates = step(params, state, jnp.float32(factor))
    rows.append((used, updates, state))
  return params, rows


def test_every_k_steps_is_a_hand_written_accumulation_loop():
  """Scale fixed per window, each micro-batch unscaled and summed, one check
  per window, the optimizer (clip + Adam) stepped on the finite windows
  only, GradScaler's schedule on the windows' outcomes."""
  inner = lambda: optax.chain(oc.clip_by_global_norm(1.0), optax.adam(0.1))  # noqa: E731
  tx = dynamic_loss_scale(2.0**10, period=2, inner=inner(), every_k_steps=K)
  params, rows = accumulate_run(tx)
  # The loop, by hand.
  opt = inner()
  ref, opt_state, scale, good = PARAMS, opt.init(PARAMS), 2.0**10, 0
  scales = []
  for w in range(len(SEQUENCE) // K):
    factors = SEQUENCE[w * K:(w + 1) * K]
    scaled = [jax.tree.map(lambda p, f=f: (p - 0.5) * f * jnp.float32(scale), ref)
              for f in factors]
    unscaled = [jax.tree.map(lambda g: g * (1 / jnp.float32(scale)), g) for g in scaled]
    finite = all(bool(jnp.all(jnp.isfinite(x))) for g in unscaled for x in jax.tree.leaves(g))
    scales += [scale] * K
    if finite:
      total = jax.tree.map(lambda *g: sum(g[1:], g[0]), *unscaled)
      updates, opt_state = opt.update(total, opt_state, ref)
      ref = optax.apply_updates(ref, updates)
      good += 1
      if good == 2:
        scale, good = scale * 2, 0
    else:
      scale, good = scale / 2, 0
  assert [used for used, _, _ in rows] == scales
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               params, ref)
  assert float(loss_scale(rows[-1][2])) == scale


def test_a_window_with_an_overflow_is_skipped_whole():
  tx = dynamic_loss_scale(2.0**10, period=100, inner=optax.adam(0.1), every_k_steps=K)
  _, rows = accumulate_run(tx)
  states = [state for _, _, state in rows]
  # Window 1 (micro-batches 3..5) has an Inf, window 2 (6..8) a NaN and an
  # Inf: every update is zero, Adam's state is what window 0 left, bit for
  # bit, and each window backs off once.
  after_first = adam_state(states[2])
  for t in range(3, 9):
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(rows[t][1]))
    for a, b in zip(jax.tree.leaves(adam_state(states[t])), jax.tree.leaves(after_first)):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert [used for used, _, _ in rows[:12]] == [2.0**10] * 6 + [2.0**9] * 3 + [2.0**8] * 3
  assert int(states[8].loss_scale.overflow_count) == 3  # micro-batches
  assert int(adam_state(states[-1]).count) == len(SEQUENCE) // K - 2
  # Only the last micro-batch of a finite window moves the params; the
  # accumulator is empty after each window.
  assert not all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(rows[11][1]))
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(rows[10][1]))
  assert all(np.all(np.asarray(a) == 0) for a in jax.tree.leaves(states[11].accumulated))
  assert int(states[10].loss_scale.micro_step) == 2
  assert int(states[11].loss_scale.micro_step) == 0


def test_period_counts_optimizer_steps():
  tx = dynamic_loss_scale(2.0**4, period=2, inner=optax.sgd(0.1), every_k_steps=4)
  _, rows = accumulate_run(tx, [1.0] * 16)
  assert [used for used, _, _ in rows] == [16.0] * 8 + [32.0] * 8
  assert int(rows[-1][2].loss_scale.good_steps) == 0


def test_every_k_steps_state_is_fixed_checkpointable_and_injectable():
  tx = dynamic_loss_scale(2.0**4, inner=optax.adam(0.1), every_k_steps=2)
  specs = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float16), PARAMS)
  state = tx.init(specs)
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state.accumulated))
  state = tx.init(PARAMS)
  before = signature(state)
  _, rows = accumulate_run(tx, [1.0, jnp.inf, 1.0])
  assert signature(rows[-1][2]) == before
  restored = pickle.loads(pickle.dumps(jax.tree.map(np.asarray, rows[-1][2])))
  assert type(restored) is oc.LossScaleWrapperState
  # Injected, every_k_steps is an array that may change: the accumulator
  # stays and the window follows the new value.
  injected = optax.inject_hyperparams(dynamic_loss_scale)(
      2.0**4, inner=optax.sgd(1.0), every_k_steps=2)
  state = injected.init(PARAMS)
  state.hyperparams["every_k_steps"] = jnp.asarray(3, jnp.int32)
  update = jax.jit(injected.update)
  grads = jax.tree.map(lambda p: p * 16.0, PARAMS)
  for t in range(3):
    updates, state = update(grads, state, PARAMS)
    moved = not all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    assert moved == (t == 2)
  jax.tree.map(lambda u, p: np.testing.assert_allclose(u, -3 * p), updates, PARAMS)


def test_every_k_steps_needs_the_optimizer_and_params():
  with pytest.raises(ValueError, match=r"`dynamic_loss_scale\(every_k_steps=4\)` "
                     r"needs the optimizer.*dynamic_loss_scale\(optimizer, every_k_steps=4\)"):
    dynamic_loss_scale(every_k_steps=4)
  with pytest.raises(ValueError, match=r"every_k_steps=...\)` must be an int >= 1, got 0"):
    dynamic_loss_scale(optax.sgd(1.0), every_k_steps=0)
  with pytest.raises(ValueError, match=r"`init` needs the params"):
    dynamic_loss_scale(optax.sgd(1.0), every_k_steps=2).init(None)
  # 1 is no accumulation: the state is that of the plain wrapper.
  one = dynamic_loss_scale(optax.sgd(1.0), every_k_steps=1).init(PARAMS)
  assert one.accumulated is None


# A window whose sum overflows (issue 27): what the optimizer gets is checked.

def finite_leaves(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact))


@functools.cache
def compiled_step(tx):
  @jax.jit
  def step(params, state, g):
    updates, state = tx.update({"w": g}, state, params)
    return optax.apply_updates(params, updates), state
  return step


def run_micro_batches(tx, params, gradients):
  """Each gradient in turn (one compiled step per ``tx``); the params and
  state after each."""
  state, rows = tx.init(params), []
  for g in gradients:
    params, state = compiled_step(tx)(params, state, jnp.asarray(g, params["w"].dtype))
    rows.append((params, state))
  return rows


def test_a_window_sum_past_float32_is_skipped_as_gradscaler_does():
  """Two finite micro-batches of 2e38 sum to Inf in float32. GradScaler's
  ``.grad`` holds that Inf sum: it skips the step and backs off to 0.5.
  The next window (at 0.5) is finite and steps."""
  tx = dynamic_loss_scale(1.0, min_scale=2.0**-126, every_k_steps=2, inner=optax.adam(1e-2))
  params = {"w": jnp.zeros(2)}
  fresh = tx.init(params).inner_state
  rows = run_micro_batches(tx, params, [[2e38, 1.0]] * 2 + [[0.5, 0.5]] * 2)
  (after, state), (last_params, last) = rows[1], rows[3]
  assert np.asarray(after["w"]).tolist() == [0.0, 0.0]
  for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(fresh)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  s = state.loss_scale
  assert (float(s.scale), int(s.overflow_count), int(s.good_steps)) == (0.5, 1, 0)
  assert (int(s.micro_step), float(s.window_norm)) == (0, 0.0)
  assert all(np.all(np.asarray(a) == 0) for a in jax.tree.leaves(state.accumulated))
  np.testing.assert_allclose(last_params["w"], [-1e-2, -1e-2], rtol=1e-5)
  assert int(last.inner_state[0].count) == 1 and int(last.loss_scale.overflow_count) == 1


def test_float16_accumulation_recipe_never_lets_an_inf_sum_through():
  """docs/migration/pytorch.md's recipe (loss / k) with float16 params: each
  micro-batch's gradient is 17500, the window's mean 70000 is past
  float16's 65504. The scale backs off while each scaled micro-batch
  overflows (4 per window), then the float32 sum cast to float16 overflows
  (1 per window); Adam never steps and nothing is ever NaN."""
  k = 4
  tx = dynamic_loss_scale(8.0, min_scale=2.0**-126, every_k_steps=k, inner=optax.adam(1e-2))

  @jax.jit
  def micro_step(params, opt_state):
    scale = loss_scale(opt_state)
    grads = jax.grad(lambda p: jnp.sum(p["w"].astype(jnp.float32) * 7e4) / k * scale)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = {"w": jnp.zeros(3, jnp.float16)}
  opt_state = tx.init(params)
  scales, counts = [], []
  for t in range(6 * k):
    params, opt_state = micro_step(params, opt_state)
    assert finite_leaves(params) and finite_leaves(opt_state.inner_state)
    if t % k == k - 1:
      scales.append(float(loss_scale(opt_state)))
      counts.append(int(opt_state.loss_scale.overflow_count))
  assert scales == [4.0, 2.0, 1.0, 0.5, 0.25, 0.125]
  assert counts == [4, 8, 9, 10, 11, 12]
  assert int(opt_state.inner_state[0].count) == 0
  assert params["w"].dtype == jnp.float16 and not np.any(np.asarray(params["w"]))


def adam():
  return optax.adam(1e-2, eps=1e-3)  # eps normal in float16


F32, F16 = jnp.float32, jnp.float16
TWICE = [[2e38, 1.0]] * 2
# Every path by which a value that is not finite in the optimizer's dtype
# could reach it: (transformation, params' dtype, micro-batches, whether the
# optimizer steps).
WINDOW = dynamic_loss_scale(1.0, every_k_steps=2, inner=adam())  # compiled once for both
PATHS = {
    "window sum cast to float16": (lambda: WINDOW, F16, [[4e4, 1.0]] * 2, False),
    "window sum past the bound, finite": (
        lambda: WINDOW, F16, [[4e4, 1.0], [-4e4, 1.0]], True),
    "window of micro-batches unscaled below 1": (
        lambda: dynamic_loss_scale(0.25, min_scale=2.0**-126, every_k_steps=2, inner=adam()),
        F16, [[2e4, 1.0], [1.0, 1.0]], False),
    "skip_step(MultiSteps(sum))": (
        lambda: skip_step(optax.MultiSteps(adam(), 2, use_grad_mean=False)),
        F32, TWICE, False),
    "skip_step(MultiSteps(sum, microbatch_guard))": (
        lambda: skip_step(optax.MultiSteps(adam(), 2, use_grad_mean=False,
                                           should_skip_update_fn=oc.microbatch_guard())),
        F32, TWICE + [[-2e38, 1.0]], True),  # the second dropped, then [0, 2]
    # MultiSteps' running mean overflows in `grad - acc` (-4e38) although
    # the mean is finite: that micro-batch is dropped (every_k_steps sums it
    # right); the next one makes the mean [0, 1].
    "dynamic_loss_scale(MultiSteps(mean))": (
        lambda: dynamic_loss_scale(1.0, inner=optax.MultiSteps(adam(), 2)),  # at the floor
        F32, [[1.5e38, 1.0], [-2.5e38, 1.0], [-1.5e38, 1.0]], True),
    "dynamic_loss_scale(MultiSteps(float16 sum))": (
        lambda: dynamic_loss_scale(1.0, inner=optax.MultiSteps(
            adam(), 2, use_grad_mean=False)),
        F16, [[4e4, 1.0]] * 2, False),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_no_path_lets_a_non_finite_value_reach_the_optimizer(name):
  """Finite micro-batches whose window (or unscaled value) is not finite in
  the optimizer's dtype: params and optimizer state stay finite; an
  overflowed window leaves the params as they were."""
  build, dtype, gradients, steps = PATHS[name]
  params = {"w": jnp.zeros(2, dtype)}
  rows = run_micro_batches(build(), params, gradients)
  final, state = rows[-1]
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
  moments = [x for x in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(x)]
  assert len(moments) == 1
  assert finite_leaves(final) and finite_leaves(moments)
  assert bool(np.any(np.asarray(final["w"]) != 0)) == steps


def test_an_overflowing_multisteps_accumulator_is_counted_and_backed_off():
  """Around MultiSteps, a finite micro-batch whose sum overflows its
  accumulator is dropped like an overflow: the loss scale counts it and
  backs off, skip_step counts a skip; the window waits for the next one."""
  loss_scaled = dynamic_loss_scale(1.0, min_scale=2.0**-126,
                                   inner=optax.MultiSteps(adam(), 2, use_grad_mean=False))
  skipped = skip_step(optax.MultiSteps(adam(), 2, use_grad_mean=False))
  params = {"w": jnp.zeros(2)}
  # 2e38 twice at scale 1 (Inf summed), then -2e38 at scale 0.5: sum [0, 2].
  rows = run_micro_batches(loss_scaled, params, TWICE + [[-1e38, 0.5]])
  states = [state for _, state in rows]
  assert np.asarray(rows[-1][0]["w"])[1] < 0 and float(rows[-1][0]["w"][0]) == 0
  assert [float(s.loss_scale.scale) for s in states] == [1.0, 0.5, 0.5]
  assert [int(s.loss_scale.overflow_count) for s in states] == [0, 1, 1]
  assert [int(s.inner_state.mini_step) for s in states] == [1, 1, 0]
  rows = run_micro_batches(skipped, params, TWICE + [[-2e38, 1.0]])
  assert [int(s.stats.skipped_count) for _, s in rows] == [0, 1, 1]
  assert [int(s.stats.nonfinite_count) for _, s in rows] == [0, 1, 1]
  assert [int(s.inner_state.gradient_step) for _, s in rows] == [0, 0, 1]


def test_every_k_steps_around_multisteps_is_refused():
  tx = dynamic_loss_scale(optax.MultiSteps(optax.sgd(1.0), 2), every_k_steps=2)
  with pytest.raises(ValueError, match=r"must not be an optax.MultiSteps too"):
    tx.init({"w": jnp.zeros(2)})


# --------------------------------------------------------------------------
# Hysteresis: DeepSpeed's and Megatron-LM's schedules, restated from their
# code, against dynamic_loss_scale on long runs where overflows depend on the
# scale (above a threshold that moves) or come at random (spikes, NaN bursts).

def deepspeed_reference(overflow_at, steps, *, init_scale, scale_window,
                        min_scale, delayed_shift, consecutive_hysteresis):
  """``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/
  loss_scaler.py, scale_factor 2; raise_error_at_min_scale=False: where it
  would raise, ``at_floor``). Per step: (scale, cur_hysteresis, at_floor)."""
  cur_scale, cur_iter, last_overflow_iter = init_scale, 0, -1
  cur_hysteresis, rows = delayed_shift, []
  for t in range(steps):
    overflow, at_floor = overflow_at(t, cur_scale), False
    if overflow:
      if delayed_shift == 1 or cur_hysteresis == 1:
        at_floor = cur_scale == min_scale
        cur_scale = max(cur_scale / 2.0, min_scale)
      else:
        cur_hysteresis -= 1
      last_overflow_iter = cur_iter
    else:
      if consecutive_hysteresis:
        cur_hysteresis = delayed_shift
      stable_interval = (cur_iter - last_overflow_iter) - 1
      if stable_interval > 0 and stable_interval % scale_window == 0:
        if not consecutive_hysteresis:
          cur_hysteresis = delayed_shift
        cur_scale *= 2.0
    cur_iter += 1
    rows.append((cur_scale, cur_hysteresis, at_floor))
  return np.asarray(rows, np.float64)


def megatron_reference(overflow_at, steps, *, initial_scale, min_scale,
                       growth_interval, hysteresis):
  """``DynamicGradScaler.update`` (megatron/core/optimizer/grad_scaler.py,
  growth 2, back-off 0.5 as Megatron builds it). Per step: (scale, growth
  tracker, whether the next overflow backs off)."""
  scale, growth_tracker, hysteresis_tracker, rows = initial_scale, 0, hysteresis, []
  for t in range(steps):
    if overflow_at(t, scale):
      growth_tracker = 0
      hysteresis_tracker -= 1
      if hysteresis_tracker <= 0:
        scale = max(scale * 0.5, min_scale)
    else:
      growth_tracker += 1
      if growth_tracker == growth_interval:
        growth_tracker = 0
        hysteresis_tracker = hysteresis
        scale = scale * 2.0
    rows.append((scale, growth_tracker, hysteresis_tracker - 1 <= 0))
  return np.asarray(rows, np.float64)


LONG = 3000


@functools.cache
def environment(seed: int):
  """Overflow above ``2**threshold[t]`` (a level that moves every 100 steps),
  plus random spikes and two bursts of 40 NaN steps (down to the floor)."""
  rng = np.random.default_rng(seed)
  threshold = np.repeat(rng.integers(12, 20, LONG // 100), 100).astype(np.float32)
  spikes = rng.random(LONG) < 0.03
  spikes[1000:1040] = spikes[2200:2240] = True
  return threshold, spikes


def overflow_at(seed):
  threshold, spikes = environment(seed)
  return lambda t, scale: bool(spikes[t] or scale > 2.0 ** threshold[t])


def run_environment(tx, seed):
  """dynamic_loss_scale (chain form) fed BASE * scale, Inf where the
  environment overflows; the states after each step."""
  threshold, spikes = environment(seed)

  def step(state, inputs):
    level, spike = inputs
    overflow = spike | (state.scale > 2.0 ** level)
    grads = jax.tree.map(lambda g: g * state.scale, BASE)
    grads["b"] = jnp.where(overflow, grads["b"].at[1].set(jnp.inf), grads["b"])
    _, state = tx.update(grads, state)
    return state, state

  run = jax.jit(lambda s: jax.lax.scan(step, s, (jnp.asarray(threshold),
                                                 jnp.asarray(spikes)))[1])
  return run(tx.init(BASE))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("window,shift,consecutive", [
    (3, 2, False), (3, 2, True), (1, 3, False), (7, 1, False), (2, 4, True)])
def test_hysteresis_matches_deepspeed(window, shift, consecutive, seed):
  tx = dynamic_loss_scale(2.0**16, period=window, min_scale=1.0, hysteresis=shift,
                          consecutive_hysteresis=consecutive, growth_delay=1)
  states = run_environment(tx, seed)
  ref = deepspeed_reference(overflow_at(seed), LONG, init_scale=2.0**16,
                            scale_window=window, min_scale=1.0,
                            delayed_shift=shift, consecutive_hysteresis=consecutive)
  np.testing.assert_array_equal(states.scale, ref[:, 0])
  np.testing.assert_array_equal(states.hysteresis, ref[:, 1])
  np.testing.assert_array_equal(states.min_scale_overflow_count, np.cumsum(ref[:, 2]))
  backoffs = int(np.sum(np.diff(ref[:, 0]) < 0))
  print(f"\nDeepSpeed window={window} hysteresis={shift} consecutive={consecutive}: "
        f"{LONG} steps, {int(states.overflow_count[-1])} overflows, {backoffs} "
        f"back-offs, {int(ref[:, 2].sum())} at the floor: equal step by step")
  assert backoffs > 50 and ref[:, 2].sum() > 0


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("interval,hysteresis", [(3, 2), (1, 3), (7, 1), (2, 5)])
def test_hysteresis_matches_megatron(interval, hysteresis, seed):
  tx = dynamic_loss_scale(2.0**16, period=interval, min_scale=1.0,
                          hysteresis=hysteresis)
  states = run_environment(tx, seed)
  ref = megatron_reference(overflow_at(seed), LONG, initial_scale=2.0**16,
                           min_scale=1.0, growth_interval=interval,
                           hysteresis=hysteresis)
  np.testing.assert_array_equal(states.scale, ref[:, 0])
  np.testing.assert_array_equal(states.good_steps, ref[:, 1])
  np.testing.assert_array_equal(states.hysteresis <= 1, ref[:, 2].astype(bool))
  assert int(np.sum(np.diff(ref[:, 0]) < 0)) > 50


def test_hysteresis_one_is_gradscaler():
  """hysteresis=1, growth_delay=0 (the defaults): torch's
  ``_amp_update_scale_`` (restated: growth tracker reset on an overflow,
  growth when it reaches the interval), with the floor far below."""
  tx = dynamic_loss_scale(2.0**16, period=3, min_scale=2.0**-126)
  states = run_environment(tx, 0)
  scale, tracker, decide, rows = 2.0**16, 0, overflow_at(0), []
  for t in range(LONG):
    if decide(t, scale):
      scale, tracker = scale * 0.5, 0
    else:
      tracker += 1
      if tracker == 3:
        scale, tracker = scale * 2.0, 0
    rows.append((scale, tracker))
  np.testing.assert_array_equal(states.scale, np.asarray(rows)[:, 0])
  np.testing.assert_array_equal(states.good_steps, np.asarray(rows)[:, 1])


# --------------------------------------------------------------------------
# The floor: an overflow at min_scale is counted, or raises on request.

def test_overflows_at_the_floor_are_counted():
  tx = optax.chain(dynamic_loss_scale(16.0, min_scale=4.0), optax.sgd(0.1))
  state = tx.init(PARAMS)
  inf = jax.tree.map(lambda p: p * jnp.inf, PARAMS)
  for _ in range(5):
    _, state = jax.jit(tx.update)(inf, state)
  found = oc.stats(state)
  assert found["loss_scale/scale"] == 4.0
  assert found["loss_scale/overflow_count"] == 5
  assert found["loss_scale/min_scale_overflow_count"] == 3


@pytest.mark.parametrize("inner", [None, optax.sgd(0.1)])
def test_raise_error_at_min_scale_eagerly_and_under_jit(inner):
  tx = dynamic_loss_scale(8.0, min_scale=4.0, raise_error_at_min_scale=True,
                          inner=inner)
  inf = jax.tree.map(lambda p: p * jnp.inf, PARAMS)
  message = (r"`dynamic_loss_scale`: the gradients overflowed \(NaN or Inf\) at "
             r"the smallest loss scale, min_scale=4.0, so the scale cannot back off.*"
             r"raise_error_at_min_scale=False")
  for update in (tx.update, jax.jit(tx.update)):
    state = tx.init(PARAMS)
    _, state = update(inf, state, PARAMS)  # 8 -> 4: a back-off, no error
    assert float(loss_scale(state)) == 4.0
    _, state = update(jax.tree.map(lambda p: p * 4.0, PARAMS), state, PARAMS)
    error = oc.NonFiniteGradientError if update is tx.update else RuntimeError
    with pytest.raises(error, match=message):
      _, state = update(inf, state, PARAMS)
      jax.block_until_ready(state)


def test_injected_schedule_settings_are_traced_and_clamped():
  """hysteresis and growth_delay injected (traced in a jitted update) give
  the static schedule; a traced bad value acts as its clamp (hysteresis 0
  as 1, growth_delay -3 as 0); the state keeps its dtypes."""
  overflows = np.array([t in OVERFLOWS for t in range(STEPS)])
  static = dynamic_loss_scale(2.0**9, period=3, hysteresis=2, growth_delay=1)
  injected = optax.inject_hyperparams(dynamic_loss_scale)(
      2.0**9, period=3, hysteresis=2, growth_delay=1)

  def states(tx, **values):
    state = tx.init(BASE)
    for arg, value in values.items():
      state.hyperparams[arg] = jnp.asarray(value, jnp.int32)
    update = jax.jit(tx.update)
    rows = []
    for overflow in overflows:
      grads = jax.tree.map(lambda g: g * loss_scale(state), BASE)
      grads["b"] = grads["b"].at[1].set(jnp.inf) if overflow else grads["b"]
      _, state = update(grads, state)
      rows.append(oc.stats(state))
    return rows, state

  want, _ = states(static)
  got, state = states(injected)
  assert got == want
  assert signature(state.inner_state) == signature(injected.init(BASE).inner_state)
  clamped, _ = states(optax.inject_hyperparams(dynamic_loss_scale)(
      2.0**9, period=3), hysteresis=0, growth_delay=-3)
  plain, _ = states(dynamic_loss_scale(2.0**9, period=3))
  assert [r["loss_scale/scale"] for r in clamped] == [r["loss_scale/scale"] for r in plain]


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
@example(exponent=127, unit=np.full(4, 0.5, np.float32))  # the largest scale reached
@given(exponent=st.integers(-24, 127), unit=hnp.arrays(
    np.float32, (4,), elements=st.floats(0.5, 2, width=32)))
def test_loss_scale_unscales_exactly_at_every_power_of_two(exponent, unit):
  # Every scale the schedule can reach (up to 2**127, whose reciprocal is
  # subnormal) divides exactly: gradients come back as they were.
  scale = 2.0**exponent
  tx = oc.dynamic_loss_scale(scale, min_scale=min(scale, 1.0))
  true = jnp.asarray(unit)
  scaled = true * jnp.float32(scale)
  assume(bool(jnp.all(jnp.isfinite(scaled))))
  # A norm past float32's range is an overflow (docs/migration/pytorch.md).
  assume(bool(jnp.isfinite(oc.functional.global_norm(scaled))))
  out, state = tx.update({"g": scaled}, tx.init(None))
  np.testing.assert_array_equal(out["g"], true, err_msg=f"unscaled by 2**{exponent}")
  assert int(state.overflow_count) == 0


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("wrapped", [False, True])
def test_a_scale_below_one_that_overflows_the_dtype_is_an_overflow(
    dtype, wrapped):
  # Dividing by a scale below 1 can take a finite entry past its dtype's
  # range while the float32 norm stays finite: that step is an overflow
  # (its unscaled update would carry Inf), never an Inf passed on.
  top = float(jnp.finfo(dtype).max)
  scale = 2.0**-20
  inner = optax.sgd(1.0) if wrapped else None
  tx = oc.dynamic_loss_scale(scale, inner=inner, min_scale=scale)
  params = {"w": jnp.zeros(3, dtype), "b": jnp.zeros(2, jnp.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  near_top = {"w": jnp.array([top / 2, 1.0, 0.0], dtype),
              "b": jnp.ones(2, jnp.float32)}
  out, state = update(near_top, state, params)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(out))
  scale_state = state.loss_scale if wrapped else state
  assert int(scale_state.overflow_count) == 1
  # Entries whose unscaled value fits pass on, exactly unscaled.
  fits = {"w": jnp.array([top * scale / 4, -scale, 0.0], dtype),
          "b": jnp.ones(2, jnp.float32)}
  out, state = update(fits, state, params)
  scale_state = state.loss_scale if wrapped else state
  assert int(scale_state.overflow_count) == 1
  expected = (fits["w"].astype(jnp.float32) / scale).astype(dtype)
  got = -out["w"] if wrapped else out["w"]
  np.testing.assert_array_equal(got, expected)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))


def test_the_range_check_costs_nothing_at_the_default_floor():
  # With min_scale >= 1 the scale never drops below 1, so unscaling cannot
  # overflow: no reduction beyond the norm's is compiled.
  grads = {"w": jnp.ones((64, 64), jnp.float16)}

  def reductions(tx):
    hlo = jax.jit(tx.update).lower(grads, tx.init(grads)).as_text()
    return hlo.count("reduce(") + hlo.count("stablehlo.reduce")

  assert reductions(oc.dynamic_loss_scale(2.0**15)) < reductions(
      oc.dynamic_loss_scale(2.0**15, min_scale=2.0**-126))


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
