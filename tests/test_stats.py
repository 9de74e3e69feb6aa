"""optaxclip.stats finds every optaxclip state inside any optax state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip as oc

FIELDS = {"norm", "scale", "count", "clipped_count", "nonfinite_count", "clip_rate"}
PARAMS = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}


def run(tx, steps=2):
  state = tx.init(PARAMS)
  step = jax.jit(tx.update)
  for _ in range(steps):
    _, state = step(PARAMS, state, PARAMS)
  return state


def test_single_clipper_in_a_chain():
  found = oc.stats(run(optax.chain(oc.clip_by_global_norm(1.0), optax.adam(1e-3))))
  assert set(found) == {f"clip/{f}" for f in FIELDS}
  np.testing.assert_allclose(found["clip/norm"], 13.0, rtol=1e-6)
  np.testing.assert_allclose(found["clip/scale"], 1 / 13.0, rtol=1e-6)
  assert found["clip/count"] == 2 and found["clip/clipped_count"] == 2
  assert found["clip/nonfinite_count"] == 0 and found["clip/clip_rate"] == 1.0
  assert all(v.shape == () for v in found.values())


def test_repeats_get_numbered_in_order():
  tx = optax.chain(oc.clip_by_norm(5.0), oc.clip_by_global_norm(100.0), optax.sgd(0.1))
  found = oc.stats(run(tx, steps=1))
  assert found["clip/norm"] == 12.0  # largest leaf norm
  np.testing.assert_allclose(found["clip_1/norm"], np.sqrt(5.0**2 + 5.0**2), rtol=1e-6)
  assert found["clip/clip_rate"] == 1.0 and found["clip_1/clip_rate"] == 0.0


def test_named_chain_and_partition_labels_lead_the_keys():
  tx = optax.named_chain(("clipping", oc.clip_by_global_norm(1.0)), ("opt", optax.sgd(0.1)))
  assert "clipping/clip/norm" in oc.stats(run(tx))
  tx = optax.partition({"a": oc.clip_by_global_norm(1.0), "b": oc.clip_grad_norm(2.0)},
                       {"w": "a", "b": "b"})
  found = oc.stats(run(tx, steps=1))
  np.testing.assert_allclose(found["a/clip/norm"], 5.0, rtol=1e-6)
  np.testing.assert_allclose(found["b/clip/norm"], 12.0, rtol=1e-6)


@pytest.mark.parametrize("wrap", [
    lambda tx: optax.MultiSteps(tx, every_k_schedule=1),
    lambda tx: optax.masked(tx, {"w": True, "b": False}),
    lambda tx: optax.apply_if_finite(tx, 3),
    lambda tx: optax.chain(optax.identity(), optax.chain(tx, optax.identity())),
])
def test_found_through_wrappers(wrap):
  found = oc.stats(run(wrap(optax.chain(oc.clip_by_global_norm(1.0), optax.sgd(0.1))), 1))
  assert set(found) == {f"clip/{f}" for f in FIELDS}
  assert found["clip/count"] == 1


def test_found_through_inject_hyperparams_and_under_jit():
  tx = optax.inject_hyperparams(oc.clip_by_global_norm)(max_norm=1.0)
  state = run(tx, steps=3)
  found = jax.jit(oc.stats)(state)
  assert found["clip/count"] == 3
  np.testing.assert_allclose(found["clip/norm"], 13.0, rtol=1e-6)


def test_nothing_to_report():
  assert oc.stats(run(optax.adam(1e-3))) == {}
  assert oc.stats(run(optax.chain(oc.clip_by_value(1.0), optax.sgd(0.1)))) == {}
