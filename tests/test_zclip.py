"""zclip: ZClip against a float64 numpy restatement, and the contract.

The reference restates github.com/bluorion-com/ZClip step by step: warm-up
norms in a list (clipped by ``torch.nn.utils.clip_grad_norm_`` at
``max_grad_norm``), then mean and population variance, z-scores, the
``adaptive_scaling``/``mean``/``percentile`` thresholds, the coefficient
``thr / (g + 1e-6)`` and the EMA update. Run with ``-s`` to see the largest
relative differences.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from outliers import (
  assert_finite,
  gradients_through_updates,
  norms_with_outlier,
  outlier_step,
  over_outlier_sizes,
  scan_of,
  trees_with_norms,
)
from test_autoclip import Largest, f64_leaves, gradient_steps, norm_sequence
from test_contract import tree_like, warm
from test_skip import CHECKED, TAIL, adversarial, longest_run

import optaxclip as oc
from optaxclip._adaptive.zclip import zclip

# A spike inside the warm-up too: it inflates the initial mean and variance.
SPIKES = {10: 30.0, 40: 10.0, 77: 100.0, 150: 50.0, 151: 20.0, 152: 10.0}


class Reference:
  """ZClip, one step at a time, in float64."""

  def __init__(self, alpha=0.97, z_thresh=2.5, max_grad_norm=1.0, eps=1e-6,
               warmup_steps=25, mode="zscore", clip_option="adaptive_scaling",
               clip_factor=1.0, skip_update_on_spike=False):
    self.__dict__.update(locals())
    self.buffer, self.mean, self.var = [], 0.0, 0.0

  def step(self, g):
    """The threshold, factor and statistics for a step of norm ``g``."""
    if len(self.buffer) < self.warmup_steps:  # warm-up
      self.buffer.append(g)
      if len(self.buffer) == self.warmup_steps:
        self.mean = sum(self.buffer) / len(self.buffer)
        self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
      if self.max_grad_norm is None:
        return {"threshold": g, "scale": 1.0, "z": 0.0, "spike": False}
      scale = min(1.0, self.max_grad_norm / (g + 1e-6))  # clip_grad_norm_
      return {"threshold": min(g, self.max_grad_norm), "scale": scale,
              "z": 0.0, "spike": False}
    std = self.var ** 0.5
    z = (g - self.mean) / (std + self.eps)
    clip_val = None
    if self.mode == "percentile":
      if g > self.mean + self.z_thresh * std:
        clip_val = self.mean + self.z_thresh * std
    elif z > self.z_thresh:
      if self.clip_option == "adaptive_scaling":
        eta = z / self.z_thresh
        clip_val = (self.mean + self.z_thresh * std / eta) * self.clip_factor
      else:
        clip_val = self.mean
    threshold = g if clip_val is None else clip_val
    if self.max_grad_norm is not None:
      threshold = min(threshold, self.max_grad_norm)
    scale = threshold / (g + 1e-6) if g > threshold else 1.0
    if clip_val is None or not self.skip_update_on_spike:
      x = g if clip_val is None else clip_val
      self.mean = self.alpha * self.mean + (1 - self.alpha) * x
      self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
    return {"threshold": threshold, "scale": scale, "z": z,
            "spike": clip_val is not None}


CONFIGS = {
    "defaults": ({}, 0.5),  # (zclip arguments, base norm)
    "defaults_capped": ({}, 1.0),  # max_grad_norm=1 bites often
    "no_cap": ({"max_grad_norm": None}, 1.0),
    "mean": ({"max_grad_norm": None, "clip_option": "mean"}, 1.0),
    "percentile": ({"max_grad_norm": None, "mode": "percentile", "alpha": 0.9},
                   1.0),
    "skip_factor": ({"max_grad_norm": 20.0, "skip_update_on_spike": True,
                     "clip_factor": 0.8, "warmup_steps": 5, "z_thresh": 2.0},
                    1.0),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_the_reference_step_by_step(config):
  kwargs, base = CONFIGS[config]
  steps = gradient_steps(norm_sequence(seed=5, base=base, spikes=SPIKES), seed=6)
  reference = Reference(**kwargs)
  tx = zclip(**kwargs)
  step = jax.jit(tx.update)
  state = tx.init(steps[0])
  largest = Largest()
  spikes = clipped = 0
  for t, tree in enumerate(steps):
    leaves = f64_leaves(tree)
    g = float(np.sqrt(sum(np.sum(x ** 2) for x in leaves)))
    want = reference.step(g)
    out, state = step(tree, state)
    largest.check("norm", state.norm, g)
    largest.check("threshold", state.threshold, want["threshold"])
    largest.check("scale", state.scale, want["scale"])
    largest.check("z", state.z, want["z"], floor=1.0)
    largest.check("ema mean", state.mean, reference.mean)
    largest.check("ema std", state.std, reference.var ** 0.5)
    for got, x in zip(jax.tree.leaves(out), leaves):
      largest.check("clipped gradient", got, x * want["scale"])
    spikes += want["spike"]
    clipped += want["scale"] < 1
    assert (int(state.count), int(state.spike_count), int(state.clipped_count)) \
        == (t + 1, spikes, clipped), t
  assert spikes >= 4  # the injected spikes after the warm-up were found
  largest.report(f"zclip[{config}]")


# --------------------------------------------------------------------------
# Beyond the shared contract (tests/test_contract.py): this transform's
# own edge cases, statistics and argument errors.

def make(**overrides):
  return zclip(**{"warmup_steps": 3, "max_grad_norm": 0.5, **overrides})


@pytest.mark.parametrize("kwargs", [{}, {"max_grad_norm": 0.0},
                                    {"max_grad_norm": None, "eps": 0.0}])
def test_finite_at_zero(kwargs):
  # Zero gradients through the warm-up and after it (std = 0 there).
  tx = make(**kwargs)
  zeros = jax.tree.map(jnp.zeros_like, tree_like())
  state = tx.init(zeros)
  for _ in range(5):
    out, state = jax.jit(tx.update)(zeros, state)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
  out, _ = jax.jit(tx.update)(tree_like(), state)  # after zeros: a spike
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))
  loss = lambda g: sum(jnp.sum(x) for x in jax.tree.leaves(tx.update(g, state)[0]))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.jit(jax.grad(loss))(zeros)))


def test_nonfinite_norm_is_kept_out_of_the_statistics():
  tx = make()
  grads = tree_like()
  bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), grads)
  step = jax.jit(tx.update)
  state = tx.init(grads)
  _, state = step(grads, state)
  _, during = step(bad, state)  # in warm-up: not collected
  assert int(during.collected) == 1 and int(during.nonfinite_count) == 1
  state = warm(tx, grads)
  out, after = step(bad, state)  # after it: the EMA is unchanged
  assert np.isnan(np.asarray(out["norm"][0])).any()
  assert (float(after.mean), float(after.std)) == (float(state.mean), float(state.std))
  assert int(after.nonfinite_count) == 1


def test_stats_report_threshold_norm_and_counts():
  tx = optax.chain(make(), optax.sgd(0.1))
  state = warm(tx, tree_like())
  found = jax.jit(oc.stats)(state)
  assert set(found) == {f"zclip/{k}" for k in (
      "norm", "mean", "std", "z", "threshold", "scale", "count",
      "clipped_count", "spike_count", "nonfinite_count", "clip_rate")}
  assert int(found["zclip/count"]) == 3 and float(found["zclip/mean"]) > 0
  assert all(v.shape == () for v in found.values())


# --------------------------------------------------------------------------
# One outlier of any size must not disable spike detection (the reference's
# statistics overflow or stay dominated by it), and gradients through the
# statistics stay finite.

ZCLIPS = {w: zclip(warmup_steps=w, max_grad_norm=None) for w in (1, 2, 5)}


@pytest.mark.parametrize("warmup", list(ZCLIPS))
@pytest.mark.parametrize("where", ["first", "warm-up", "after"])
@over_outlier_sizes
def test_one_outlier_of_any_size_does_not_disable_spike_detection(
    warmup, where, size):
  at = outlier_step(where, warmup)
  # The bound of zclip's docstring.
  if at >= warmup:
    probe = at + 1
  elif warmup >= 3:
    probe = warmup
  else:
    probe = 2 * warmup + 3
  _, states = scan_of(ZCLIPS[warmup])(trees_with_norms(
      norms_with_outlier(size, at, probe)))
  assert_finite(states.mean, states.std, states.warmup_norms, states.norm,
                states.threshold, states.scale)
  spikes = np.diff(np.concatenate([[0], states.spike_count]))
  assert spikes[probe] == 1, (spikes, states.mean, states.std)
  assert float(states.scale[probe]) < 1e-4


ZCLIP_GRADIENT_CONFIGS = [
    {}, {"max_grad_norm": None, "eps": 0.0},
    {"max_grad_norm": None, "mode": "percentile"},
    {"max_grad_norm": None, "clip_option": "mean",
     "skip_update_on_spike": True}]


@pytest.mark.parametrize("config", range(len(ZCLIP_GRADIENT_CONFIGS)))
def test_gradient_is_finite_at_zero_and_after_a_constant_history(config):
  # The warm-up's variance is 0: the reference's sqrt has an infinite slope.
  tx = zclip(warmup_steps=3, **ZCLIP_GRADIENT_CONFIGS[config])
  for history, grads in gradients_through_updates(tx).items():
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads)), history


def test_a_warm_up_of_zero_norms_starts_again():
  """The reference zeroes every update for good after a warm-up of zeros
  (mean and std 0 make every later norm a spike cut to 0)."""
  tx = zclip(warmup_steps=3, max_grad_norm=None)
  state = tx.init({"w": jnp.zeros(2)})
  update = jax.jit(tx.update)
  for _ in range(3):
    _, state = update({"w": jnp.zeros(2)}, state)
  grads = {"w": jnp.array([3.0, 4.0])}
  for _ in range(6):  # a new warm-up of norms 5, then the EMA
    updates, state = update(grads, state)
    np.testing.assert_allclose(updates["w"], grads["w"], rtol=1e-6)
  assert float(state.mean) == 5.0 and int(state.spike_count) == 0
  updates, state = update({"w": jnp.array([3e3, 4e3])}, state)  # a spike
  assert int(state.spike_count) == 1
  assert float(np.linalg.norm(updates["w"])) < 5e3


def test_step_is_the_transforms_statistics_update():
  """``step`` is a pure function of (state, norm) that tests can call: the
  transform's update is the step's factor applied to the gradients."""
  from optaxclip._adaptive import zclip as _zclip
  settings = {"alpha": 0.9, "z_thresh": 2.5, "max_grad_norm": 1.0, "eps": 1e-6,
              "mode": "zscore", "clip_option": "adaptive_scaling",
              "clip_factor": 1.0, "skip_update_on_spike": False}
  tx = zclip(warmup_steps=2, **settings)
  state = expected = tx.init(None)
  for g in [1.0, 2.0, 30.0, 0.5]:
    grads = {"w": jnp.array([g, 0.0])}
    updates, state = tx.update(grads, state)
    factor, expected = _zclip.step(expected, jnp.float32(g), **settings)
    np.testing.assert_array_equal(updates["w"], np.array([g, 0.0], np.float32) * factor)
    for got, want in zip(state, expected):
      np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------
# Guards never stall (docs/guards.md): a lasting rise is cut at most
# max_consecutive_spikes times in a row, then let through and learned.

@pytest.mark.parametrize("skip_update_on_spike", [False, True])
@pytest.mark.parametrize("factor", [10.0, 1e6])
def test_a_lasting_rise_is_cut_at_most_max_consecutive_spikes_times(
    skip_update_on_spike, factor):
  """The reference cuts every later norm for ever: its EMA is fed the
  threshold (about its mean), or nothing with skip_update_on_spike."""
  norms = 1 + 0.01 * np.sin(np.arange(300))
  norms[100:] *= factor
  tx = zclip(max_grad_norm=None, skip_update_on_spike=skip_update_on_spike)
  _, states = scan_of(tx)(trees_with_norms(norms))
  cut = np.flatnonzero(np.asarray(states.scale) < 1)
  assert cut.tolist() == [100, 101, 102, 103]
  assert int(states.spike_count[-1]) == 4
  np.testing.assert_allclose(states.mean[-1], norms[-1], rtol=0.02)
  # None: the reference's rule.
  _, states = scan_of(zclip(max_grad_norm=None, max_consecutive_spikes=None,
                            skip_update_on_spike=skip_update_on_spike))(
      trees_with_norms(norms))
  assert np.all(np.asarray(states.scale)[100:] < 1)


@functools.cache
def pure_zclip_run(warmup, skip_update_on_spike, mode):
  """``_zclip.step`` alone over a sequence of norms (traced bound)."""
  from optaxclip._adaptive import zclip as _zclip
  settings = {"alpha": 0.97, "z_thresh": 2.5, "max_grad_norm": None,
              "eps": 1e-6, "mode": mode, "clip_option": "adaptive_scaling",
              "clip_factor": 1.0, "skip_update_on_spike": skip_update_on_spike}

  @jax.jit
  def run(norms, bound):
    def body(state, norm):
      factor, state = _zclip.step(state, norm, max_consecutive_spikes=bound,
                                  **settings)
      return state, (factor, state)
    return jax.lax.scan(body, _zclip.ZClipState.fresh(jnp.float32, warmup),
                        norms)[1]

  return run


@pytest.mark.parametrize("skip_update_on_spike, mode", [
    (False, "zscore"), (True, "zscore"), (False, "percentile")])
@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(case=adversarial(), warmup=st.sampled_from([1, 2, 5]),
       bound=st.sampled_from([1, 2, 4]))
def test_no_finite_sequence_stalls_zclip(skip_update_on_spike, mode, case,
                                         warmup, bound):
  """Adversarial sequences (test_skip.adversarial) ending at a final level
  of exact repeats: at most ``bound`` norms cut in a row, the final level
  passes again, and a spike after it is still cut."""
  values, _ = case
  values = values.copy()
  values[-1 - TAIL // 2:-1] = values[-2]  # exact repeats (no ripple)
  factors, states = pure_zclip_run(warmup, skip_update_on_spike, mode)(
      jnp.asarray(values, jnp.float32), bound)
  cut = np.asarray(factors) < 1
  assert_finite(states.mean, states.std, states.warmup_norms)
  assert longest_run(cut) <= bound, np.flatnonzero(cut)
  assert not cut[-1 - CHECKED:-1].any(), np.flatnonzero(cut)
  assert cut[-1], "the spike after the final level was not cut"


# Moved from test_granular.py: leaf_norms and layer_axis (per-leaf and
# per-layer norms in the state and the statistics)

from helpers import (  # noqa: E402
  LAYER_AXIS,
  assert_norm_tree,
  expected_norm_tree,
  norm_of_named,
  run,
  stacked_gradients,
)


@pytest.mark.parametrize("layer_axis", [None, LAYER_AXIS], ids=["leaf", "layer"])
def test_zclip_keeps_leaf_norms(layer_axis):
  grads = stacked_gradients()
  tx = oc.zclip(leaf_norms=True, layer_axis=layer_axis)
  state = run(tx, grads)[1]
  assert_norm_tree(state.leaf_norms, expected_norm_tree(grads, 2, layer_axis is not None))
  np.testing.assert_allclose(state.norm, norm_of_named(grads), rtol=2e-6)
  keys = [k for k in oc.stats(state) if "_norm/" in k]
  assert keys and all(k.startswith(("zclip/leaf_norm/", "zclip/layer_norm/")) for k in keys)
  assert any("/layer_norm/" in k for k in keys) == (layer_axis is not None)
  # Off by default: nothing kept.
  assert oc.zclip().init(grads).leaf_norms is None
