"""Under x64, float64 gradients beyond float32's range are finite numbers.

Every transform keeps its statistics in the dtype the norms of the
parameters given to ``init`` accumulate in: float64 when x64 is on and a
parameter is float64, float32 otherwise. A norm of 5e40 (inf in float32) is
then clipped, logged and fed to the statistics like any other.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_zclip import Reference

import optaxclip as oc

HUGE = [3e40, 4e40]  # norm 5e40: finite in float64, inf in float32


def run(tx, steps):
  """The updates and state after each of ``steps`` (lists of floats), under x64."""
  params = {"w": jnp.ones(2, jnp.float64)}
  state = tx.init(params)
  out = []
  for g in steps:
    updates, state = jax.jit(tx.update)({"w": jnp.asarray(g, jnp.float64)},
                                        state, params)
    out.append((np.asarray(updates["w"]), state))
  return out


def clipped_to(norm):
  return np.asarray(HUGE) * (norm / 5e40)


def zclip_expected():
  reference = Reference(warmup_steps=2, max_grad_norm=None)
  for g in (5e40, 5.5e40):
    reference.step(g)
  return clipped_to(5e42 * reference.step(5e42)["scale"])


# name -> (transform, gradient steps, expected last update)
CASES = {
    "clip_by_global_norm": (lambda: oc.clip_by_global_norm(1.0), [HUGE],
                            lambda: clipped_to(1.0)),
    "clip_by_norm": (lambda: oc.clip_by_norm(1.0), [HUGE], lambda: clipped_to(1.0)),
    "clip_grad_norm": (lambda: oc.clip_grad_norm(1.0), [HUGE],
                       lambda: clipped_to(1.0)),
    # An RMS of 5e40 / sqrt(2), clipped to 1.
    "clip_by_block_rms": (lambda: oc.clip_by_block_rms(1.0), [HUGE],
                          lambda: clipped_to(2 ** 0.5)),
    # The median of 5 and 5e40.
    "auto_clip": (lambda: oc.auto_clip(50.0), [[3.0, 4.0], HUGE],
                  lambda: clipped_to(2.5e40)),
    # Warm-up at 5e40 and 5.5e40, then a spike 100 times larger.
    "zclip": (lambda: oc.zclip(warmup_steps=2, max_grad_norm=None),
              [HUGE, [3.3e40, 4.4e40], [3e42, 4e42]], zclip_expected),
    # Warm-up clips to 1 (gamma = 1), then 1.05 * gamma.
    "adagc": (lambda: oc.adagc(warmup_steps=1), [HUGE, HUGE],
              lambda: clipped_to(1.05)),
    "skip_step": (lambda: oc.skip_step(optax.sgd(1.0), zscore=6.0, max_norm=1e50),
                  [HUGE], lambda: -np.asarray(HUGE)),
}


def float_fields(state):
  return [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]


@pytest.mark.parametrize("name", list(CASES))
def test_float64_norm_beyond_float32_is_clipped_and_logged(name):
  factory, steps, expected = CASES[name]
  with jax.enable_x64(True):
    results = run(factory(), steps)
    updates, state = results[-1]
    np.testing.assert_allclose(updates, expected(), rtol=1e-9)
    for _, state in results:
      assert all(np.all(np.isfinite(x)) for x in float_fields(state))
    found = oc.stats(state)
    assert int(found.get(f"{_prefix(found)}/nonfinite_count", 0)) == 0
    if name == "skip_step":
      assert int(state.stats.skipped_count) == 0
    norm = next((v for k, v in found.items() if k.endswith("/norm")), None)
    if norm is not None:  # logged in float64, not as inf
      assert norm.dtype == jnp.float64
      np.testing.assert_allclose(norm, 5e42 if name == "zclip" else 5e40,
                                 rtol=1e-12)


def _prefix(found):
  return next(iter(found)).split("/")[0]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e50 in float32
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("x64,param_dtype,grad_dtype,expected", [
    (True, jnp.float64, jnp.float32, jnp.float64),
    (True, jnp.float32, jnp.float64, jnp.float32),
    (False, np.float64, jnp.float32, jnp.float32)])
def test_state_dtype_follows_the_parameters(name, x64, param_dtype, grad_dtype,
                                            expected):
  factory = CASES[name][0]
  with jax.enable_x64(x64):
    tx = factory()
    params = {"w": np.ones(2, param_dtype), "n": np.zeros(3, np.int32)}
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state = tx.init(params)
    assert {x.dtype for x in float_fields(state)} == {jnp.dtype(expected)}
    assert jax.tree.map(lambda x: (x.shape, x.dtype), jax.eval_shape(tx.init, structs)) \
        == jax.tree.map(lambda x: (x.shape, x.dtype), state)
    # Updates of another float dtype keep the state's dtypes (no weak types).
    grads = {"w": jnp.full(2, 3.0, grad_dtype), "n": jnp.zeros(3, jnp.int32)}
    _, new_state = jax.jit(tx.update)(grads, state, params)
    assert jax.tree.map(lambda x: (x.shape, x.dtype, x.weak_type), new_state) \
        == jax.tree.map(lambda x: (x.shape, x.dtype, x.weak_type), state)


@pytest.mark.parametrize("make", [oc.auto_clip, lambda: oc.clip_by_global_norm(1.0)])
def test_float64_gradients_beyond_float32_statistics_never_give_nan(make):
  with jax.enable_x64(True):
    tx = make()
    state = tx.init({"w": jnp.zeros(2, jnp.float32)})
    for g in (1.0, 1.0, 5e40):
      updates, state = tx.update({"w": jnp.array([0.6 * g, 0.8 * g])}, state)
    assert bool(jnp.all(jnp.isfinite(updates["w"])))
    assert float(jnp.linalg.norm(updates["w"])) <= 1.0 + 1e-6
    assert int(state.nonfinite_count) == 0
