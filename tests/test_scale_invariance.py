"""Decisions taken from running statistics do not depend on the scale.

Every transform that judges a value against statistics of its past
(``skip_step``'s norm, loss and update z-scores in EMA and window mode,
``zclip``, ``adagc``, ``auto_clip``) takes the same decisions, step for
step, for a sequence and the same sequence times ``2**k``: the flags and
factors are the same bits, and the statistics and thresholds are the
first run's times ``2**k`` exactly. Settings with a unit (``adagc``'s
``lambda_abs``) scale with the values; additive ``eps`` are 0 (with an
absolute ``eps`` the decisions depend on the scale by definition, and so
does ``zclip``'s factor ``threshold / (norm + 1e-6)``, the reference's: its
thresholds are compared instead). Each transform's pure statistics step
runs under one ``lax.scan`` compiled once.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from optaxclip._adaptive import adagc, autoclip, zclip
from optaxclip._guards import skip_stats

STEPS = 64
WARMUP = 8
TENSORS = 3
# Levels within 2**+-5, shifts, spikes and noise keep the values within
# [2**-10, 2**18]: times 2**k for |k| <= 100 they and their spread are
# normal floats, and 100 times them finite.
K = st.integers(-100, 100)
EXAMPLES = settings(max_examples=30, deadline=None, derandomize=True,
                    database=None)


def sequence(seed, shape=(), *, signed=False, zeros=False):
  """``STEPS`` float32 values: a level with multiplicative noise, spikes
  (x2-100), a lasting shift, a few NaN (and zeros), negative if ``signed``
  and the draw says so."""
  rng = np.random.default_rng(seed)
  size = (STEPS, *shape)
  noise = rng.choice([0.01, 0.05, 0.3])
  values = 2.0 ** rng.uniform(-5, 5, shape) * np.exp(
      noise * rng.standard_normal(size))
  values[rng.integers(STEPS // 2, STEPS):] *= rng.choice([0.1, 3.0, 20.0])
  spikes = rng.random(size) < 0.1
  values[spikes] *= rng.uniform(2, 100, spikes.sum())
  if signed and rng.random() < 0.5:
    values = -values
  if zeros:
    values[rng.random(size) < 0.03] = 0.0
  values[rng.random(size) < 0.02] = np.nan
  return values.astype(np.float32)


def times(values, k):
  """``values * 2**k``, exact: every finite non-zero one stays normal."""
  scaled = np.ldexp(values, k).astype(np.float32)
  finite = np.isfinite(values) & (values != 0)
  magnitude = np.abs(scaled[finite])
  assert np.all(magnitude >= 2.0 ** -112) and np.all(magnitude <= 2.0 ** 120)
  return scaled


def assert_same(first, scaled, k, scaled_keys=()):
  """The flags and dimensionless outputs are the same bits; those in
  ``scaled_keys`` are ``first``'s times ``2**k`` exactly."""
  for key, a in first.items():
    b = np.asarray(scaled[key])
    a = np.asarray(a)
    if key in scaled_keys:
      a = np.ldexp(a, k).astype(a.dtype) if a.dtype.kind == "f" else a
    np.testing.assert_array_equal(b, a, err_msg=key)


# --------------------------------------------------------------------------
# skip_step: the norm, loss and update guards at once, each scaled alone.

def _skip_program(window, two_sided):
  @jax.jit
  def run(norms, losses, updates):
    def body(stats, x):
      norm, loss, update = x
      skip, stats = skip_stats.step(
          stats, norm, loss=loss, update_norm=update, nonfinite=True,
          max_norm=None, zscore=3.0, loss_zscore=3.0, update_zscore=3.0,
          ema_decay=0.9, warmup_steps=WARMUP, two_sided=two_sided)
      out = {"skip": skip, "by_norm": stats.skipped_by_norm,
             "by_loss": stats.skipped_by_loss,
             "by_update": stats.skipped_by_update,
             "forced": stats.forced_count, "loss_z": stats.loss_zscore,
             "zscore_count": stats.zscore_count}
      for name in ("norm", "loss", "update"):
        running = getattr(stats, f"{name}_stats")
        out[f"{name}_mean"], out[f"{name}_std"] = running.mean, running.std
      return stats, out

    fresh = skip_stats.SkipStats.fresh(jnp.float32, window=window, update=True)
    return jax.lax.scan(body, fresh, (norms, losses, updates))[1]
  return run


SKIP = {"ema": _skip_program(None, False), "window": _skip_program(16, True)}


@EXAMPLES
@given(seed=st.integers(0, 2**16), k_norm=K, k_loss=K, k_update=K)
def test_skip_step_decides_the_same_at_any_scale(seed, k_norm, k_loss,
                                                 k_update):
  norms = sequence(seed, zeros=True)
  losses = sequence(seed + 1, signed=True)
  updates = sequence(seed + 2, zeros=True)
  for mode, run in SKIP.items():
    first = run(norms, losses, updates)
    assert np.asarray(first["skip"]).any(), f"{mode}: no decision to compare"
    scaled = run(times(norms, k_norm), times(losses, k_loss),
                 times(updates, k_update))
    for name, k in (("norm", k_norm), ("loss", k_loss), ("update", k_update)):
      part = {key: first[key] for key in (f"{name}_mean", f"{name}_std")}
      assert_same(part, scaled, k, scaled_keys=part)
    flags = {key: v for key, v in first.items() if not key.endswith(
        ("_mean", "_std"))}
    assert_same(flags, scaled, 0)


# --------------------------------------------------------------------------
# zclip, adagc, auto_clip

ZCLIP_CONFIGS = ({"mode": "zscore", "clip_option": "adaptive_scaling"},
                 {"mode": "zscore", "clip_option": "mean"},
                 {"mode": "percentile", "clip_option": "adaptive_scaling"})


@jax.jit
def _zclip_run(norms):
  outs = []
  for config in ZCLIP_CONFIGS:
    def body(state, norm, config=config):
      factor, state = zclip.step(
          state, norm, alpha=0.9, z_thresh=2.5, max_grad_norm=None, eps=0.0,
          clip_factor=1.0, skip_update_on_spike=False, **config)
      return state, {"clipped": factor < 1, "spikes": state.spike_count,
                     "z": state.z, "threshold": state.threshold,
                     "mean": state.mean, "std": state.std}
    fresh = zclip.ZClipState.fresh(jnp.float32, WARMUP)
    outs.append(jax.lax.scan(body, fresh, norms)[1])
  return outs


@jax.jit
def _adagc_run(norms, lambda_abs):
  def step(state, x):
    tensors, total = x
    factors, state = adagc.step(
        state, tensors, total, lambda_abs=lambda_abs, lambda_rel=1.05,
        beta=0.9, warmup_steps=WARMUP, eps=0.0)
    return state, {"factors": factors, "clipped": state.clipped_tensors,
                   "gamma": state.gamma}
  fresh = adagc.AdaGCState.fresh(jnp.float32, TENSORS)
  return jax.lax.scan(step, fresh, norms)[1]


@jax.jit
def _auto_clip_run(norms, percentile):
  def body(state, norm):
    factor, state = autoclip.step(state, norm, percentile=percentile, eps=0.0)
    return state, {"factor": factor, "threshold": state.threshold}
  fresh = autoclip.AutoClipState.fresh(jnp.float32, 16)
  return jax.lax.scan(body, fresh, norms)[1]


@EXAMPLES
@given(seed=st.integers(0, 2**16), k=K)
def test_zclip_decides_the_same_at_any_scale(seed, k):
  norms = sequence(seed, zeros=True)
  for first, scaled in zip(_zclip_run(norms), _zclip_run(times(norms, k))):
    assert np.asarray(first["clipped"]).any(), "no decision to compare"
    assert_same(first, scaled, k, scaled_keys=("threshold", "mean", "std"))


@EXAMPLES
@given(seed=st.integers(0, 2**16), k=K)
def test_adagc_decides_the_same_at_any_scale(seed, k):
  tensors = sequence(seed, (TENSORS,), zeros=True)
  # The global norm as the transform takes it, then scaled: exact.
  total = np.sqrt(np.sum(np.square(tensors.astype(np.float64)), axis=1))
  total = total.astype(np.float32)
  lambda_abs = np.float32(np.nanmedian(total))
  first = _adagc_run((tensors, total), lambda_abs)
  assert np.asarray(first["clipped"]).any(), "no decision to compare"
  scaled = _adagc_run((times(tensors, k), times(total, k)),
                      np.ldexp(lambda_abs, k).astype(np.float32))
  assert_same(first, scaled, k, scaled_keys=("gamma",))


@EXAMPLES
@given(seed=st.integers(0, 2**16), k=K,
       percentile=st.sampled_from([10.0, 50.0, 90.0]))
def test_auto_clip_decides_the_same_at_any_scale(seed, k, percentile):
  norms = sequence(seed, zeros=True)
  first = _auto_clip_run(norms, percentile)
  assert (np.asarray(first["factor"]) < 1).any(), "no decision to compare"
  assert_same(first, _auto_clip_run(times(norms, k), percentile), k,
              scaled_keys=("threshold",))
