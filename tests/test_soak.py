"""Soak: a small model trained for thousands of steps through each
recommended composition, with NaN, Inf and spike batches at known steps.

A 2-layer MLP learns a synthetic regression under one ``jax.lax.scan`` (one
compile per composition). Each step's batch is drawn up front as ``ok``,
``nan`` (a NaN input), ``inf`` (an Inf target: an overflow for loss scaling)
or ``spike`` (targets times 1e6). Every composition must keep the parameters
finite at every step, still train (the clean loss falls), and count every bad
batch exactly, at the step it came: the counters of ``optaxclip.stats``
step up at the bad batches and nowhere else.

A composition with no spike guard (no clipper, no z-score) gets clean
batches in place of the spikes: one 1e6x gradient would ruin Adam's second
moment for thousands of steps whatever comes before it.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import longest_run

import optaxclip as oc

STEPS = 3000
BATCH, INPUTS, HIDDEN = 16, 4, 16
RATES = {"nan": 0.01, "inf": 0.01, "spike": 0.01}
QUIET = 300  # no spikes before: skip_step's z-score needs 100 accepted steps
ACCUMULATE = 4  # micro-batches per MultiSteps window


def mlp(params, x):
  hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
  return (hidden @ params["w2"] + params["b2"])[..., 0]


def mse(params, x, y):
  return jnp.mean(jnp.square(mlp(params, x) - y))


def init_params(seed: int):
  rng = np.random.default_rng(seed)
  return {"w1": jnp.asarray(rng.normal(size=(INPUTS, HIDDEN)) / INPUTS**0.5, jnp.float32),
          "b1": jnp.zeros(HIDDEN, jnp.float32),
          "w2": jnp.asarray(rng.normal(size=(HIDDEN, 1)) / HIDDEN**0.5, jnp.float32),
          "b2": jnp.zeros(1, jnp.float32)}


@functools.cache
def dataset(seed: int = 0):
  """Batches for every step (bad ones corrupted), their kinds, a clean set."""
  rng = np.random.default_rng(seed)
  teacher = init_params(seed + 1)

  def batch(n):
    x = rng.normal(size=(n, BATCH, INPUTS)).astype(np.float32)
    return x, np.asarray(mlp(teacher, x)) + 0.01 * rng.normal(size=(n, BATCH))

  x, y = batch(STEPS)
  kinds = np.full(STEPS, "ok", dtype=object)
  draw = rng.random(STEPS)
  edges = np.cumsum(list(RATES.values()))
  for kind, low, high in zip(RATES, np.concatenate([[0], edges[:-1]]), edges):
    kinds[(draw >= low) & (draw < high)] = kind
  kinds[:QUIET][kinds[:QUIET] == "spike"] = "ok"
  x[kinds == "nan", 0, 0] = np.nan
  y[kinds == "inf", 0] = np.inf
  calm = y.copy()
  y[kinds == "spike"] *= 1e6
  clean_x = rng.normal(size=(1024, INPUTS)).astype(np.float32)
  clean_y = jnp.asarray(mlp(teacher, clean_x), jnp.float32)
  return (jnp.asarray(x), {True: jnp.asarray(y, jnp.float32),
                           False: jnp.asarray(calm, jnp.float32)},
          kinds, (clean_x, clean_y))


def _clip_adamw():
  return optax.chain(oc.clip_by_global_norm(1.0), optax.adamw(1e-3))


def _clip_adam():
  return optax.chain(oc.clip_by_global_norm(1.0), optax.adam(1e-3))


NONFINITE = {"nan", "inf"}
LOSS_SCALED = {"loss_scale/overflow_count": NONFINITE}


@dataclasses.dataclass(frozen=True)
class Composition:
  build: Callable[[], Any]
  counters: dict[str, set[str]]  # stats key -> the kinds of batch it counts
  flags: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # stats
  #                 key -> the kinds of batch it is set for (a per-step flag)
  scaled: bool = False  # the loss is multiplied by loss_scale(state)
  spikes: bool = True  # it guards against spikes, and is fed them
  skips: bool = True  # counted batches never reach the inner optimizer
  windows: bool = False  # MultiSteps inside: one Adam step per good window


COMPOSITIONS = {
    # clip + adamw
    "chain(clip(nonfinite=zero), adamw)": Composition(
        lambda: optax.chain(oc.clip_by_global_norm(1.0, nonfinite="zero"),
                            optax.adamw(1e-3)),
        {"clip/nonfinite_count": NONFINITE}, skips=False),
    "skip_step(chain(clip, adamw), zscore=6)": Composition(
        lambda: oc.skip_step(_clip_adamw(), zscore=6.0),
        {"skip/nonfinite_count": NONFINITE, "skip/zscore_count": {"spike"},
         "skip/skipped_count": NONFINITE | {"spike"}, "skip/max_norm_count": set()}),
    # loss scaling + skip
    "skip_step(chain(dynamic_loss_scale, adamw))": Composition(
        lambda: oc.skip_step(optax.chain(oc.dynamic_loss_scale(2.0**15),
                                         optax.adamw(1e-3))),
        {**LOSS_SCALED, "skip/nonfinite_count": NONFINITE,
         "skip/skipped_count": NONFINITE}, scaled=True, spikes=False),
    "skip_step(chain(dynamic_loss_scale, adamw), zscore=6)": Composition(
        lambda: oc.skip_step(optax.chain(oc.dynamic_loss_scale(2.0**15),
                                         optax.adamw(1e-3)), zscore=6.0),
        {**LOSS_SCALED, "skip/nonfinite_count": NONFINITE,
         "skip/zscore_count": {"spike"}, "skip/skipped_count": NONFINITE | {"spike"}},
        scaled=True),
    # New form: the inner optimizer wrapped, untouched on an overflow.
    "dynamic_loss_scale(adamw)": Composition(
        lambda: oc.dynamic_loss_scale(optax.adamw(1e-3)), LOSS_SCALED,
        scaled=True, spikes=False),
    "dynamic_loss_scale(chain(clip, adamw))": Composition(
        lambda: oc.dynamic_loss_scale(_clip_adamw()),
        {**LOSS_SCALED, "clip/nonfinite_count": set()}, scaled=True),
    # The obvious chain (issue 11, item 1): an overflow must not reach adamw.
    "chain(dynamic_loss_scale, adamw)": Composition(
        lambda: optax.chain(oc.dynamic_loss_scale(2.0**15), optax.adamw(1e-3)),
        LOSS_SCALED, scaled=True, spikes=False, skips=False),
    # accumulation + skip
    "skip_step(MultiSteps(chain(clip, adam)))": Composition(
        lambda: oc.skip_step(optax.MultiSteps(_clip_adam(), ACCUMULATE)),
        {"skip/nonfinite_count": NONFINITE, "skip/skipped_count": NONFINITE},
        windows=True),
    # New: a should_skip_update_fn that drops NaN/Inf micro-batches.
    "MultiSteps(chain(clip, adam), microbatch_guard)": Composition(
        lambda: optax.MultiSteps(_clip_adam(), ACCUMULATE,
                                 should_skip_update_fn=oc.microbatch_guard()),
        {"clip/nonfinite_count": set()}, flags={"microbatch/skipped": NONFINITE},
        windows=True),
    # loss scaling + accumulation: the scaling wraps MultiSteps
    "dynamic_loss_scale(MultiSteps(chain(clip, adam), microbatch_guard))": Composition(
        lambda: oc.dynamic_loss_scale(optax.MultiSteps(
            _clip_adam(), ACCUMULATE, should_skip_update_fn=oc.microbatch_guard())),
        {**LOSS_SCALED, "clip/nonfinite_count": set()}, scaled=True, windows=True),
}


def schedule(name: str) -> np.ndarray:
  """Each step's kind of batch as ``name`` is fed it."""
  kinds = dataset()[2].copy()
  if not COMPOSITIONS[name].spikes:
    kinds[kinds == "spike"] = "ok"
  return kinds


def _is_adam(x: Any) -> bool:
  return isinstance(x, optax.ScaleByAdamState)


def adam_count(state) -> int:
  """The step count of the (one) Adam state inside ``state``."""
  found = [x for x in jax.tree.leaves(state, is_leaf=_is_adam) if _is_adam(x)]
  assert len(found) == 1, found
  return int(found[0].count)


def _is_multi(x: Any) -> bool:
  return isinstance(x, optax.MultiStepsState)


def gradient_steps(state) -> int:
  found = [x for x in jax.tree.leaves(state, is_leaf=_is_multi) if _is_multi(x)]
  assert len(found) == 1, found
  return int(found[0].gradient_step)


@functools.cache
def soak(name: str):
  """Trains through ``name``: final params and state, per-step stats."""
  composition = COMPOSITIONS[name]
  tx = composition.build()
  scaled = composition.scaled
  x, y, _, _ = dataset()
  y = y[composition.spikes]

  def step(carry, batch):
    params, state = carry
    scale = oc.loss_scale(state) if scaled else jnp.ones([], jnp.float32)
    grads = jax.grad(lambda p: mse(p, *batch) * scale)(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(p))
                                for p in jax.tree.leaves(params)]))
    return (params, state), (finite, oc.stats(state))

  @jax.jit
  def run(params):
    return jax.lax.scan(step, (params, tx.init(params)), (x, y))

  (params, state), (finite, stats) = run(init_params(0))
  return params, state, np.asarray(finite), jax.tree.map(np.asarray, stats)


NAMES = list(COMPOSITIONS)


@pytest.mark.parametrize("name", NAMES)
def test_params_stay_finite_and_training_works(name):
  params, _, finite, _ = soak(name)
  kinds, (clean_x, clean_y) = schedule(name), dataset()[3]
  assert finite.all(), (
      f"params not finite from step {int(np.argmin(finite))} "
      f"(a {kinds[int(np.argmin(finite))]} batch)")
  start, end = (float(mse(p, clean_x, clean_y)) for p in (init_params(0), params))
  print(f"\n{name}: clean loss {start:.4f} -> {end:.4f} in {STEPS} steps, "
        f"{int(np.sum(kinds != 'ok'))} bad batches")
  assert end < 0.5 * start, f"no training: clean loss {start} -> {end}"


@pytest.mark.parametrize("name", NAMES)
def test_every_bad_batch_is_counted_at_its_step(name):
  _, _, _, stats = soak(name)
  kinds = schedule(name)
  composition = COMPOSITIONS[name]
  for key, counted in [*composition.counters.items(), *composition.flags.items()]:
    assert key in stats, f"{key} not in oc.stats: {sorted(stats)}"
    if key in composition.flags:  # set at a step for that step's batch
      marks = stats[key].astype(np.int64)
    else:  # a running count: steps up at the batches it counts
      marks = np.diff(np.concatenate([[0], stats[key]]))
    expected = np.isin(kinds, list(counted)).astype(marks.dtype)
    wrong = np.flatnonzero(marks != expected)
    assert wrong.size == 0, (
        f"{key} marks {int(marks.sum())} steps, {int(expected.sum())} bad batches; "
        f"first wrong steps {wrong[:5].tolist()} are {kinds[wrong[:5]].tolist()}")
  if name.startswith("chain(clip"):  # every spike is clipped
    clipped = np.diff(np.concatenate([[0], stats["clip/clipped_count"]]))
    assert clipped[kinds == "spike"].all(), "a spike was not clipped"


@pytest.mark.parametrize("name", [n for n, c in COMPOSITIONS.items()
                                  if c.skips and not c.windows])
def test_skipped_batches_never_reach_the_optimizer(name):
  _, state, _, _ = soak(name)
  skipped = set().union(*(v for k, v in COMPOSITIONS[name].counters.items()
                          if not k.startswith("clip")))
  assert adam_count(state) == STEPS - int(np.isin(schedule(name), list(skipped)).sum())


@pytest.mark.parametrize("name", [n for n, c in COMPOSITIONS.items() if c.windows])
def test_accumulation_drops_bad_micro_batches_only(name):
  _, state, _, _ = soak(name)
  good = int(np.sum(~np.isin(schedule(name), list(NONFINITE))))
  assert gradient_steps(state) == good // ACCUMULATE
  assert adam_count(state) == good // ACCUMULATE


# ---------------------------------------------------------------------------
# Guards never stall (docs/guards.md): the step guards over thousands of
# steps of a synthetic norm and loss with NaN, Inf, spikes and lasting level
# shifts, each guard under one lax.scan. Counters are exact, the statistics
# finite, no more than the documented bound of ordinary steps is skipped
# (or cut) in a row, and every spike is still caught.

GUARD_STEPS = 3000
LEVEL_SHIFTS = {600: 10.0, 1200: 0.1, 1800: 1e3, 2400: 1e-2}  # step -> factor
SETTLE = 40  # steps after a shift without spikes (the guards relearn)


@functools.cache
def guard_data(seed: int = 0):
  """Per step: the kind ("ok", "nan", "inf", "spike"), a norm and a loss
  (5% noise on a level that shifts for good at LEVEL_SHIFTS, spikes 1e3
  times it), and the mask of steps far from the start and the shifts."""
  rng = np.random.default_rng(seed)
  steps = np.arange(GUARD_STEPS)
  level = np.ones(GUARD_STEPS)
  for at, factor in LEVEL_SHIFTS.items():
    level[at:] *= factor
  draw = rng.random(GUARD_STEPS)
  kinds = np.where(draw < 0.01, "nan", np.where(draw < 0.015, "inf", np.where(
      draw < 0.025, "spike", "ok"))).astype(object)
  settled = steps >= 200
  for at in LEVEL_SHIFTS:
    settled &= (steps < at) | (steps >= at + SETTLE)
  kinds[~settled & (kinds == "spike")] = "ok"
  values = {}
  for name, offset in (("norm", 0.0), ("loss", 2.0)):
    v = level * (1 + 0.05 * rng.standard_normal(GUARD_STEPS))
    v[kinds == "spike"] *= 1e3
    v[kinds == "nan"] = np.nan
    v[kinds == "inf"] = np.inf
    values[name] = v + offset * level
  return kinds, values, settled


@functools.cache
def guard_soak(name: str):
  """Each step's state of the guard ``name`` over guard_data()."""
  kinds, values, _ = guard_data()
  norms = jnp.asarray(values["norm"], jnp.float32)
  losses = jnp.asarray(values["loss"], jnp.float32)
  direction = {"w": jnp.asarray([0.6, -0.8]), "b": jnp.asarray([1.0])}
  tx = {"skip_step": oc.skip_step(optax.sgd(0.1), zscore=6.0, loss_zscore=6.0),
        "skip_step window": oc.skip_step(optax.sgd(0.1), zscore=6.0,
                                         loss_zscore=6.0, window=128),
        "skip_step update": oc.skip_step(optax.sgd(0.1), update_zscore=6.0,
                                         loss_zscore=6.0, window=128),
        "zclip": oc.zclip(max_grad_norm=None),
        "adagc": oc.adagc(warmup_steps=100)}[name]

  def step(state, x):
    norm, loss = x
    grads = {"w": direction["w"] * norm, "b": direction["b"] * 0.5 * norm}
    extra = {"loss": loss} if name.startswith("skip_step") else {}
    updates, state = tx.update(grads, state, grads, **extra)
    return state, (state, jnp.abs(updates["w"][0]) / jnp.abs(grads["w"][0]))

  run = jax.jit(lambda n, losses: jax.lax.scan(step, tx.init(direction), (n, losses))[1])
  states, factors = run(norms, losses)
  return jax.tree.map(np.asarray, states), np.asarray(factors)


def _marks(counter) -> np.ndarray:
  return np.diff(np.concatenate([[0], counter])) > 0


def _exact_skip_counters(stats, kinds):
  """The counters of skip_step agree with each other at every step: a
  finite step the guards would skip is skipped or let through (forced)."""
  bad = np.isin(kinds, ["nan", "inf"])
  np.testing.assert_array_equal(_marks(stats.nonfinite_count), bad)
  np.testing.assert_array_equal(_marks(stats.loss_nonfinite_count), bad)
  skipped = _marks(stats.skipped_count)
  by_update = (False if stats.skipped_by_update is None  # not measured
               else stats.skipped_by_update)
  np.testing.assert_array_equal(
      skipped, stats.skipped_by_norm | stats.skipped_by_loss | by_update)
  would = _marks(stats.zscore_count) | _marks(stats.loss_zscore_count)
  if stats.update_zscore_count is not None:
    would = would | _marks(stats.update_zscore_count)
  np.testing.assert_array_equal(_marks(stats.forced_count), would & ~skipped & ~bad)
  assert skipped[bad].all()
  assert longest_run(skipped & ~bad) <= 4
  return skipped, bad


@pytest.mark.parametrize("name", ["skip_step window", "skip_step update"])
def test_skip_step_windows_never_stall_over_thousands_of_steps(name):
  """Window mode (OLMo-core's rule) and the update-norm guard: exact
  counters, finite statistics, at most 4 finite skips in a row. (A window
  keeps every spike: several in one window hide the next, as theirs do.)"""
  kinds, values, settled = guard_data()
  states, _ = guard_soak(name)
  stats = states.stats
  measured = [stats.norm_stats, stats.loss_stats]
  if name == "skip_step update":
    measured.append(stats.update_stats)
  else:  # the update's norm costs passes: absent unless asked for
    assert stats.update_stats is None
  for running in measured:
    for x in (running.mean, running.std, running.window):
      assert np.all(np.isfinite(x))
  skipped, _ = _exact_skip_counters(stats, kinds)
  assert np.mean(skipped[kinds == "spike"]) > 0.9
  assert np.mean(skipped[settled & (kinds == "ok")]) < 0.005
  if name == "skip_step update":  # the update's norm is lr times the norm
    np.testing.assert_allclose(stats.update_norm[kinds == "ok"],
                               0.1 * values["norm"][kinds == "ok"] * np.sqrt(1.25),
                               rtol=1e-5)
    assert stats.skipped_by_update[kinds == "spike"].mean() > 0.9


def test_skip_step_never_stalls_over_thousands_of_steps():
  kinds, values, settled = guard_data()
  states, _ = guard_soak("skip_step")
  stats = states.stats
  _exact_skip_counters(stats, kinds)
  for running in (stats.norm_stats, stats.loss_stats):
    assert np.all(np.isfinite(running.mean)) and np.all(np.isfinite(running.std))
  bad = np.isin(kinds, ["nan", "inf"])
  np.testing.assert_array_equal(_marks(stats.nonfinite_count), bad)
  np.testing.assert_array_equal(_marks(stats.loss_nonfinite_count), bad)
  skipped = _marks(stats.skipped_count)
  np.testing.assert_array_equal(skipped, stats.skipped_by_norm | stats.skipped_by_loss)
  assert skipped[bad].all() and skipped[kinds == "spike"].all()
  # Ordinary steps are skipped only at the level shifts, at most 4 in a row.
  ordinary = skipped & (kinds == "ok")
  assert longest_run(skipped & ~bad) <= 4
  assert not ordinary[settled].any(), np.flatnonzero(ordinary & settled)
  assert int(stats.forced_count[-1]) == int(np.sum(_marks(stats.forced_count)))
  assert int(stats.forced_count[-1]) >= 2  # the two rises were let through
  final = np.prod(list(LEVEL_SHIFTS.values()))  # the last level
  assert 0.5 < stats.norm_stats.mean[-1] / final < 2


def test_zclip_never_stalls_over_thousands_of_steps():
  kinds, _, settled = guard_data()
  states, factors = guard_soak("zclip")
  assert np.all(np.isfinite(states.mean)) and np.all(np.isfinite(states.std))
  bad = np.isin(kinds, ["nan", "inf"])
  np.testing.assert_array_equal(_marks(states.nonfinite_count), bad)
  cut = np.asarray(states.scale) < 1
  assert cut[kinds == "spike"].all()
  assert longest_run(cut & ~bad) <= 4
  assert np.mean(cut[settled & (kinds == "ok")]) < 0.02  # z > 2.5: rare


def test_adagc_never_stalls_over_thousands_of_steps():
  kinds, _, settled = guard_data()
  states, factors = guard_soak("adagc")
  assert np.all(np.isfinite(states.gamma))
  bad = np.isin(kinds, ["nan", "inf"])
  np.testing.assert_array_equal(_marks(states.nonfinite_count), bad)
  assert np.all(factors[kinds == "spike"] < 0.01)
  after = np.arange(GUARD_STEPS) >= 100
  assert longest_run(after & ~bad & (factors < 0.01) & (kinds == "ok")) <= 2
