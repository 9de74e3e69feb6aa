"""adagc: AdaGC against a float64 numpy restatement, and the contract.

The reference follows the paper's Algorithm 1 step by step: global clipping
at ``lambda_abs`` with a running minimum of each tensor's clipped norm during
warm-up, then per-tensor clipping at ``lambda_rel * gamma_i`` with an EMA of
the clipped norms. Run with ``-s`` to see the largest relative differences.
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
  SPIKE,
  assert_finite,
  gradients_through_updates,
  ordinary_norms,
  outlier_step,
  over_outlier_sizes,
  scan_of,
)
from test_autoclip import STEPS, Largest, f64_leaves
from test_contract import tree_like, warm
from test_skip import CHECKED, adversarial, longest_run

import optaxclip as oc
from optaxclip._adaptive.adagc import adagc

SHAPES = {"b": (4,), "e": (6,), "w": (8, 4)}  # leaf order: b, e, w
BASES = {"b": 0.1, "e": 3.0, "w": 1.0}  # typical norm of each tensor
# step -> {tensor: multiplier}: spikes in one tensor, and in all at once.
SPIKES = {5: {"w": 20.0}, 60: {"w": 30.0}, 100: {"b": 100.0}, 101: {"e": 10.0},
          150: {"b": 50.0, "e": 50.0, "w": 50.0}}


def gradient_steps(seed=7):
  """Float32 gradient trees whose tensors have noisy norms and spikes."""
  rng = np.random.default_rng(seed)
  steps = []
  for t in range(STEPS):
    tree = {}
    for name, shape in SHAPES.items():
      x = rng.normal(size=shape)
      norm = BASES[name] * (1 + 0.1 * rng.standard_normal())
      norm *= SPIKES.get(t, {}).get(name, 1.0)
      tree[name] = np.float32(x * norm / np.sqrt(np.sum(x ** 2)))
    steps.append(tree)
  return steps


def reference(steps, lambda_abs=1.0, lambda_rel=1.05, beta=0.98,
              warmup_steps=100):
  """Algorithm 1 of the paper, with the first ``warmup_steps`` steps global."""
  gamma = None
  for t, tree in enumerate(steps):
    leaves = f64_leaves(tree)
    norms = np.array([np.sqrt(np.sum(x ** 2)) for x in leaves])
    total = np.sqrt(np.sum(norms ** 2))
    if t < warmup_steps:
      factors = np.full(len(leaves), min(lambda_abs / total, 1.0))
    else:
      factors = np.minimum(lambda_rel * gamma / norms, 1.0)
    clipped = [x * h for x, h in zip(leaves, factors)]
    clipped_norms = np.array([np.sqrt(np.sum(x ** 2)) for x in clipped])
    if t < warmup_steps:
      gamma = clipped_norms if gamma is None else np.minimum(gamma, clipped_norms)
    else:
      gamma = beta * gamma + (1 - beta) * clipped_norms
    yield {"norm": total, "factors": factors, "clipped": clipped,
           "gamma": gamma.copy()}


CONFIGS = {
    "defaults": {},  # warm-up 100 steps of the 200
    "short_warmup": {"warmup_steps": 20, "lambda_abs": 2.0, "beta": 0.9},
    "tight": {"warmup_steps": 10, "lambda_rel": 1.0, "lambda_abs": 0.5},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_the_reference_step_by_step(config):
  kwargs = CONFIGS[config]
  steps = gradient_steps()
  tx = adagc(**kwargs)
  step = jax.jit(tx.update)
  state = tx.init(steps[0])
  largest = Largest()
  clipped_steps = 0
  for t, (tree, want) in enumerate(zip(steps, reference(steps, **kwargs))):
    out, state = step(tree, state)
    largest.check("norm", state.norm, want["norm"])
    largest.check("gamma", state.gamma, want["gamma"])
    largest.check("scale", state.scale, want["factors"].min())
    for got, expected in zip(jax.tree.leaves(out), want["clipped"]):
      largest.check("clipped gradient", got, expected)
    assert int(state.clipped_tensors) == int(np.sum(want["factors"] < 1)), t
    clipped_steps += bool(np.any(want["factors"] < 1))
    assert (int(state.count), int(state.clipped_count)) == (t + 1, clipped_steps)
  assert int(state.nonfinite_count) == 0
  largest.report(f"adagc[{config}]")


# --------------------------------------------------------------------------
# Beyond the shared contract (tests/test_contract.py): this transform's
# own edge cases, statistics and argument errors.

def make(**overrides):
  return adagc(**{"warmup_steps": 2, "lambda_abs": 0.5, **overrides})


@pytest.mark.parametrize("kwargs", [{}, {"lambda_abs": 0.0, "lambda_rel": 0.0}])
def test_finite_at_zero(kwargs):
  tx = make(**kwargs)
  zeros = jax.tree.map(jnp.zeros_like, tree_like())
  state = tx.init(zeros)
  for _ in range(3):  # through the warm-up and after it
    out, state = jax.jit(tx.update)(zeros, state)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
  out, _ = jax.jit(tx.update)(tree_like(), state)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))
  loss = lambda g: sum(jnp.sum(x) for x in jax.tree.leaves(tx.update(g, state)[0]))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.jit(jax.grad(loss))(zeros)))


def test_nonfinite_norm_leaves_gamma_unchanged():
  tx = make()
  grads = tree_like()
  state = warm(tx, grads)
  bad = jax.tree.map(lambda x: x.at[0].set(jnp.inf), grads)
  _, after = jax.jit(tx.update)(bad, state)
  np.testing.assert_array_equal(after.gamma, state.gamma)
  assert int(after.nonfinite_count) == 1
  assert int(after.clipped_count) == int(state.clipped_count)


def test_stats_report_norm_thresholds_and_counts():
  tx = optax.chain(make(), optax.sgd(0.1))
  state = warm(tx, tree_like())
  found = jax.jit(oc.stats)(state)
  assert set(found) == {f"adagc/{k}" for k in (
      "norm", "scale", "clipped_tensors", "gamma_min", "gamma_max", "count",
      "clipped_count", "nonfinite_count", "clip_rate")}
  assert int(found["adagc/count"]) == 3
  assert 0 < float(found["adagc/gamma_min"]) <= float(found["adagc/gamma_max"])
  assert all(v.shape == () for v in found.values())


def test_shard_map_tensor_norms_are_global():
  from jax import shard_map
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(8)
  grads = {"w": rng.normal(size=(8, 12)).astype(np.float32),
           "v": rng.normal(size=(6, 16)).astype(np.float32),
           "b": rng.normal(size=(5,)).astype(np.float32)}
  specs = {"w": P("data", "model"), "v": P(None, "model"), "b": P()}
  tx = make(axis_name=("data", "model"), specs=specs)
  step = jax.jit(shard_map(tx.update, mesh=mesh, in_specs=(specs, P()),
                           out_specs=(specs, P())))
  state = jax.device_put(tx.init(grads), NamedSharding(mesh, P()))
  local = make()
  local_state = local.init(grads)
  for k in (3.0, 1.0, 1.0, 5.0):  # warm-up, then per-tensor clipping
    tree = jax.tree.map(lambda x: x * k, grads)
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                           tree, specs)
    out, state = step(sharded, state)
    expected, local_state = jax.jit(local.update)(tree, local_state)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
                 (out, state), (expected, local_state))


# --------------------------------------------------------------------------
# One outlier step of any size must not set the thresholds (the paper's
# warm-up minimum takes it in, and gamma then rises 0.1% a step), and
# gradients through the statistics stay finite.

ADAGC_WARMUP, ADAGC_STEPS = 6, 14
ADAGC = adagc(warmup_steps=ADAGC_WARMUP)


def two_tensor_steps(outlier_at=None, size=1.0, spike_at=ADAGC_STEPS - 1):
  """Tensor "w" (norm ~1) and "b" (norm ~0.5) over ADAGC_STEPS steps; "b"
  times ``size`` at ``outlier_at``, "w" times SPIKE at ``spike_at``."""
  rng = np.random.default_rng(5)
  w = rng.normal(size=(ADAGC_STEPS, 8))
  b = rng.normal(size=(ADAGC_STEPS, 4))
  w *= (ordinary_norms(ADAGC_STEPS, 1) / np.linalg.norm(w, axis=1))[:, None]
  b *= (0.5 * ordinary_norms(ADAGC_STEPS, 2) / np.linalg.norm(b, axis=1))[:, None]
  if outlier_at is not None:
    b[outlier_at] *= size
  w[spike_at] *= SPIKE
  return {"b": jnp.asarray(b, jnp.float32), "w": jnp.asarray(w, jnp.float32)}


@pytest.mark.parametrize("where", ["first", "warm-up", "after"])
@over_outlier_sizes
def test_one_outlier_of_any_size_does_not_set_the_thresholds(where, size):
  at = outlier_step(where, ADAGC_WARMUP)
  run = scan_of(ADAGC)
  updates, states = run(two_tensor_steps(at, size))
  _, clean = run(two_tensor_steps())
  assert_finite(states.gamma, states.norm_min, states.norm, states.scale)
  # From the end of the warm-up, every threshold is within 2x of the one
  # the same steps give without the outlier.
  ratio = np.asarray(states.gamma / clean.gamma)[ADAGC_WARMUP:]
  assert np.all((ratio > 0.5) & (ratio < 2)), ratio
  # And the spike in "w" (the last step) is cut to 1.05 * gamma_w.
  spike = float(np.linalg.norm(np.asarray(updates["w"][-1], np.float64)))
  assert spike <= 1.05 * float(states.gamma[-2, 1]) * (1 + 1e-5)


def test_gradient_is_finite_at_zero_and_after_a_constant_history():
  tx = adagc(warmup_steps=2, eps=1e-6)
  for history, grads in gradients_through_updates(tx).items():
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads)), history


@pytest.mark.parametrize("kwargs", [{}, {"lambda_rel": 0.0}, {"beta": 0.0}])
def test_nonfinite_warm_up_steps_do_not_count(kwargs):
  """A warm-up that saw only NaN steps left every threshold at +inf: the
  per-tensor clip was off for good, or 0 * inf made the update NaN."""
  tx = adagc(warmup_steps=1, **kwargs)
  params = {"w": jnp.ones(3), "b": jnp.ones(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  _, state = update({"w": jnp.full(3, jnp.nan), "b": jnp.ones(2)}, state)
  small = {"w": jnp.full(3, 0.1), "b": jnp.full(2, 0.1)}
  _, state = update(small, state)  # the warm-up's one finite step
  assert np.all(np.isfinite(state.gamma))
  big = {"w": jnp.full(3, 10.0), "b": jnp.full(2, 0.1)}
  updates, state = update(big, state)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
  assert float(jnp.linalg.norm(updates["w"])) < 1.0  # the spiking tensor is cut


# --------------------------------------------------------------------------
# layer_axis (issue 13 section 2): a threshold and history per layer slice,
# as if each slice were a tensor of its own.

def stacked_steps(seed=9, steps=60, spikes=True):
  """Trees {"b": [4], "w": [3 layers, 8, 4]}; layer 1 of "w" spikes."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(steps):
    w = rng.normal(size=(3, 8, 4)) * np.array([1.0, 0.3, 3.0])[:, None, None]
    if spikes and t in (25, 40):
      w[1] *= 50.0
    out.append({"b": np.float32(rng.normal(size=4) * 0.1), "w": np.float32(w)})
  return out


def unstacked(tree):
  return [tree["b"], *tree["w"]]  # gamma's order: leaf by leaf, layers in order


@pytest.mark.parametrize("kwargs", [{"warmup_steps": 10}, {"warmup_steps": 5, "beta": 0.9}])
def test_layer_axis_is_the_reference_on_unstacked_layers(kwargs):
  steps = stacked_steps()
  tx = adagc(layer_axis={"b": None, "w": 0}, **kwargs)
  update = jax.jit(tx.update)
  state = tx.init(steps[0])
  assert state.gamma.shape == (4,)
  largest = Largest()
  for t, (tree, want) in enumerate(zip(steps, reference(map(unstacked, steps), **kwargs))):
    out, state = update(tree, state)
    largest.check("gamma", state.gamma, want["gamma"])
    largest.check("norm", state.norm, want["norm"])
    for got, expected in zip(unstacked(out), want["clipped"]):
      largest.check("clipped gradient", got, expected)
    assert int(state.clipped_tensors) == int(np.sum(want["factors"] < 1)), t
  largest.report(f"adagc(layer_axis)[{kwargs}]")


def test_layer_axis_spike_in_one_layer_leaves_the_others_alone():
  stack = lambda steps: jax.tree.map(lambda *xs: jnp.stack(xs), *steps)
  spiky, calm = stack(stacked_steps()), stack(stacked_steps(spikes=False))
  per_layer = scan_of(adagc(warmup_steps=10, layer_axis={"b": None, "w": 0}))
  per_leaf = scan_of(adagc(warmup_steps=10))
  # Layers 0 and 2 get the updates they get without layer 1's spikes (steps
  # 25 and 40); with one threshold for the leaf they are cut with layer 1.
  layered, calm_layered = per_layer(spiky)[0]["w"], per_layer(calm)[0]["w"]
  whole = per_leaf(spiky)[0]["w"]
  for layer in (0, 2):
    np.testing.assert_array_equal(layered[:, layer], calm_layered[:, layer])
    assert np.linalg.norm(whole[25, layer]) < 0.5 * np.linalg.norm(layered[25, layer])


@pytest.mark.parametrize("split", [False, True])
def test_layer_axis_under_shard_map_equals_unsharded(split):
  from jax import shard_map
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from test_distributed import hlo_ops
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  steps = stacked_steps(steps=6)
  if split:
    # The layer axis split over the mesh: each device clips its own layers
    # and every device keeps every layer's threshold. Four layers (two per
    # "data" device): layer 1 spikes, layer 3 is quiet.
    specs = {"b": P(), "w": P("data", None, "model")}
    steps = [{**t, "w": np.concatenate([t["w"], 0.1 * t["w"][:1]])} for t in steps]
  else:
    specs = {"b": P(), "w": P(None, "data", "model")}  # layers on every device
  tx = adagc(warmup_steps=3, layer_axis=0, axis_name=("data", "model"), specs=specs)
  step = jax.jit(shard_map(tx.update, mesh=mesh, in_specs=(specs, P()),
                           out_specs=(specs, P())))
  local = adagc(warmup_steps=3, layer_axis=0)
  state, local_state = tx.init(steps[0]), local.init(steps[0])
  for tree in steps:
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                           tree, specs)
    out, state = step(sharded, state)
    expected, local_state = jax.jit(local.update)(tree, local_state)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
                 (out, state), (expected, local_state))
  assert int(local_state.clipped_tensors) > 0  # some layers were clipped
  main, _ = hlo_ops(step.lower(sharded, state).compile().as_text(), "all-reduce")
  assert main == 1, "one all-reduce on the main path (the rescue has its own)"

  # Initialized inside shard_map, from this device's layers only: the error
  # says where to initialize.
  inside = jax.jit(shard_map(lambda t: tx.update(t, tx.init(t)), mesh=mesh,
                             in_specs=(specs,), out_specs=(specs, P())))
  if split:
    with pytest.raises(ValueError, match="whole parameters, outside shard_map"):
      inside(sharded)
  else:  # every device holds every layer: the local init is the whole one
    jax.tree.map(np.testing.assert_array_equal, inside(sharded),
                 step(sharded, tx.init(steps[-1])))


def test_layer_axis_with_inject_hyperparams_as_a_static_arg():
  steps = stacked_steps(steps=4)
  plain = adagc(warmup_steps=2, layer_axis=0)
  injected = optax.inject_hyperparams(adagc, static_args=("layer_axis",))(
      warmup_steps=2, layer_axis=0)
  state, injected_state = plain.init(steps[0]), injected.init(steps[0])
  for tree in steps:
    out, state = jax.jit(plain.update)(tree, state)
    injected_out, injected_state = jax.jit(injected.update)(tree, injected_state)
    jax.tree.map(np.testing.assert_array_equal, out, injected_out)
  np.testing.assert_array_equal(injected_state.inner_state.gamma, state.gamma)


# --------------------------------------------------------------------------
# Guards never stall (docs/guards.md): no finite sequence sets the
# thresholds so low that the ordinary steps are clipped for thousands of
# steps.

def ripple_steps(steps, first=1.0, shift_at=None, shift=1.0):
  """Tensors "b" (norm ~0.5) and "w" (~1) with a 10% ripple; the first step
  times ``first``, and "w" times ``shift`` from ``shift_at`` on."""
  t = np.arange(steps)
  b = 0.5 * (1 + 0.1 * np.cos(t))
  w = 1 + 0.1 * np.sin(t)
  b[0] *= first
  w[0] *= first
  if shift_at is not None:
    w[shift_at:] *= shift
  return {"b": jnp.asarray(b[:, None] * np.array([1.0, 0.0]), jnp.float32),
          "w": jnp.asarray(w[:, None] * np.array([1.0, 0.0, 0.0]), jnp.float32)}


@pytest.mark.parametrize("warmup", [100, 6, 2, 1])
@pytest.mark.parametrize("first", [1e-6, 1e-30])
def test_a_tiny_first_global_norm_does_not_set_the_thresholds(warmup, first):
  """The report: every later warm-up step was kept out as an outlier
  against the tiny first one, and the per-tensor thresholds then rose
  0.1% a step: ~log(1e6) / 0.001 steps of over-clipping. Now the running
  minimum starts again after 3 outliers in a row, and after the warm-up a
  tensor clipped more than 100-fold 3 steps in a row restarts its gamma."""
  steps = 300
  run = scan_of(adagc(warmup_steps=warmup))
  updates, states = run(ripple_steps(steps, first))
  _, clean = run(ripple_steps(steps))
  norms = np.stack([np.linalg.norm(np.asarray(updates[k]), axis=1)
                    for k in ("b", "w")], 1)
  raw = np.stack([0.5 * (1 + 0.1 * np.cos(np.arange(steps))),
                  1 + 0.1 * np.sin(np.arange(steps))], 1)
  factors = norms[warmup:] / raw[warmup:]
  assert np.sum(factors < 0.01) <= 2 * 2, np.argwhere(factors < 0.01)
  ratio = np.asarray(states.gamma / clean.gamma)[warmup + 3:]
  assert np.all((ratio > 0.5) & (ratio < 2)), ratio


def test_a_lasting_rise_of_one_tensor_is_not_clipped_100_fold_for_ever():
  """A tensor whose norm rises 1e6-fold for good: 2 steps clipped by
  1e-6, then its threshold restarts from its norm (the paper's gamma would
  take log(1e6) / 0.001 steps to catch up)."""
  steps = 200
  updates, states = scan_of(adagc(warmup_steps=20))(
      ripple_steps(steps, shift_at=100, shift=1e6))
  w = np.linalg.norm(np.asarray(updates["w"], np.float64), axis=1)
  raw = (1 + 0.1 * np.sin(np.arange(steps))) * np.where(
      np.arange(steps) >= 100, 1e6, 1.0)
  factor = w / raw
  assert np.flatnonzero(factor < 0.01).tolist() == [100, 101]
  assert np.all(factor[102:] > 0.5)


@functools.cache
def pure_adagc_run():
  """``_adagc.step`` alone over two tensors' norms (traced settings)."""
  from optaxclip._adaptive import adagc as _adagc

  @jax.jit
  def run(norms, warmup):
    def body(state, n):
      top = jnp.maximum(jnp.max(n), jnp.finfo(n.dtype).tiny)  # no overflow
      norm = top * jnp.sqrt(jnp.sum(jnp.square(n / top)))
      factors, state = _adagc.step(state, n, norm, lambda_abs=1.0,
                                   lambda_rel=1.05, beta=0.98,
                                   warmup_steps=warmup, eps=0.0)
      return state, (factors, state)
    return jax.lax.scan(body, _adagc.AdaGCState.fresh(jnp.float32, 2),
                        norms)[1]

  return run


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(w=adversarial(), b=adversarial(), warmup=st.sampled_from([1, 2, 3, 6]))
def test_no_finite_sequence_sets_the_thresholds_for_good(w, b, warmup):
  """Adversarial norms for each tensor (test_skip.adversarial): after the
  warm-up no tensor is clipped more than 100-fold 3 steps in a row, the
  final level's last steps are clipped at most 100-fold, and the spike
  after it is clipped."""
  norms = np.stack([w[0], 0.5 * b[0]], 1)
  factors, states = pure_adagc_run()(jnp.asarray(norms, jnp.float32), warmup)
  factors = np.asarray(factors)
  assert_finite(states.gamma, states.norm_min, states.norm)
  for i in range(2):
    over = factors[warmup:, i] < 1 / 100
    assert longest_run(over) <= 2, (i, np.flatnonzero(over) + warmup)
    assert np.all(factors[-1 - CHECKED:-1, i] >= 1 / 100), i
    assert factors[-1, i] < 1, "the spike after the final level was not clipped"


def test_traced_float_integers_are_rounded():
  grads = {"w": jnp.array([3.0, 4.0])}
  # warmup_steps 1.6 rounds to 2: the second step is still global clipping.
  tx = optax.inject_hyperparams(oc.adagc)(warmup_steps=2.0, lambda_abs=1.0)
  state = tx.init(grads)
  step = jax.jit(tx.update)
  state = state._replace(hyperparams={**state.hyperparams,
                                      "warmup_steps": jnp.float32(1.6)})
  for _ in range(2):
    updates, state = step(grads, state)
  assert int(state.inner_state.count) == 2
  np.testing.assert_allclose(jnp.linalg.norm(updates["w"]), 1.0, rtol=1e-6)
