"""optaxclip.stats finds every optaxclip state inside any optax state and
names its statistics: flat, unique keys of scalars (per leaf and per layer
for ``leaf_norms``), the same at init, after updates and under jit.

The statistics of each transform's own state are checked in its file (each
``test_stats_report_*``); inside Flax, Equinox and optax's wrappers in
test_integrations.py.
"""

import collections
import dataclasses
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  CLIP_KEYS,
  LAYER_AXIS,
  SKIP_KEYS,
  ZCLIP_KEYS,
  keys,
  np_leaf_norm,
  stacked_gradients,
)
from helpers import run as run_once

import optaxclip as oc

PARAMS = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}


def run(tx, steps=2):
  state = tx.init(PARAMS)
  step = jax.jit(tx.update)
  for _ in range(steps):
    _, state = step(PARAMS, state, PARAMS)
  return state


def test_single_clipper_in_a_chain():
  found = oc.stats(run(optax.chain(oc.clip_by_global_norm(1.0), optax.adam(1e-3))))
  assert set(found) == {f"clip/{f}" for f in CLIP_KEYS}
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
  assert set(found) == {f"clip/{f}" for f in CLIP_KEYS}
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


# --------------------------------------------------------------------------
# Keys of leaf_norms: by tree path (and layer), for every kind of node

def test_stats_keys_name_every_leaf_and_layer():
  grads = stacked_gradients()
  tx = optax.chain(oc.clip_by_global_norm(1.0, leaf_norms=True,
                                          layer_axis=LAYER_AXIS), optax.sgd(0.1))
  _, state = run_once(tx, grads)
  found = oc.stats(state)
  leaf_keys = sorted(k for k in found if "_norm/" in k)
  stacks = ["layers/attn/kernel", "layers/mlp/0", "layers/mlp/1"]
  assert leaf_keys == sorted(
      [f"clip/layer_norm/{stack}/{i}" for stack in stacks for i in range(4)]
      + [f"clip/leaf_norm/{stack}" for stack in stacks]  # the whole stack's
      + ["clip/leaf_norm/emb", "clip/leaf_norm/bias"])
  kernel = np_leaf_norm(grads["layers"]["attn"]["kernel"], 2, 0)
  np.testing.assert_allclose(found["clip/layer_norm/layers/attn/kernel/3"], kernel[3],
                             rtol=1e-6)
  assert all(v.shape == () for v in found.values())


@dataclasses.dataclass
class Block:
  kernel: jax.Array
  scale: jax.Array


jax.tree_util.register_dataclass(Block, data_fields=["kernel", "scale"], meta_fields=[])


class Pair(NamedTuple):
  first: jax.Array
  second: jax.Array


def test_stats_keys_of_attributes_and_named_tuples():
  grads = {"block": Block(jnp.ones((2, 3)), jnp.ones(3)),
           "pair": Pair(jnp.ones(2), jnp.ones(2)), "list": [jnp.ones(2)]}
  tx = oc.clip_by_norm(1.0, leaf_norms=True, layer_axis={"block": Block(0, None),
                                                         "pair": None, "list": None})
  _, state = run_once(tx, grads)
  assert sorted(k for k in oc.stats(state) if "_norm/" in k) == [
      "clip/layer_norm/block/kernel/0", "clip/layer_norm/block/kernel/1",
      "clip/leaf_norm/block/kernel",
      "clip/leaf_norm/block/scale", "clip/leaf_norm/list/0",
      "clip/leaf_norm/pair/first", "clip/leaf_norm/pair/second"]


def test_stats_keys_of_a_flax_nnx_state():
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.attn = nnx.Linear(2, 3, rngs=rngs)
      self.out = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
      return self.out(self.attn(x))

  model = Model(nnx.Rngs(0))
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((4, 2))) ** 2))(model)
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  optimizer.update(model, grads)
  found = oc.stats(optimizer.opt_state)
  # A Variable's `.value` is left out of the key.
  assert sorted(k for k in found if "leaf_norm" in k) == [
      "clip/leaf_norm/attn/bias", "clip/leaf_norm/attn/kernel",
      "clip/leaf_norm/out/bias", "clip/leaf_norm/out/kernel"]
  np.testing.assert_allclose(found["clip/leaf_norm/attn/kernel"],
                             np_leaf_norm(grads["attn"]["kernel"][...], 2), rtol=1e-6)


# --------------------------------------------------------------------------
# Key sets: every key of every state, at init and after updates, under jit

def _inject_clip():
  return optax.inject_hyperparams(oc.clip_by_global_norm)(max_norm=1.0)


STATS_CASES = {
    "chain": (
        lambda: optax.chain(oc.clip_by_global_norm(1.0),
                            oc.clip_by_global_norm(2.0), optax.adam(1e-3)),
        keys("clip", CLIP_KEYS) | keys("clip_1", CLIP_KEYS)),
    "named_chain": (
        lambda: optax.named_chain(("clipping", oc.clip_by_global_norm(1.0)),
                                  ("spikes", oc.zclip(warmup_steps=2)),
                                  ("opt", optax.adam(1e-3))),
        keys("clipping/clip", CLIP_KEYS) | keys("spikes/zclip", ZCLIP_KEYS)),
    "masked": (
        lambda: optax.masked(optax.chain(oc.clip_by_global_norm(1.0),
                                         optax.sgd(0.1)),
                             {"a": True, "b": False}),
        keys("clip", CLIP_KEYS)),
    "partition": (
        lambda: optax.partition(
            {"x": optax.chain(oc.clip_by_global_norm(1.0), optax.sgd(0.1)),
             "y": oc.zclip(warmup_steps=2)},
            {"a": "x", "b": "y"}),
        keys("x/clip", CLIP_KEYS) | keys("y/zclip", ZCLIP_KEYS)),
    "multisteps": (
        lambda: optax.MultiSteps(
            optax.chain(oc.clip_by_global_norm(1.0), optax.sgd(0.1)), 2),
        keys("clip", CLIP_KEYS)),
    "inject_hyperparams": (
        lambda: optax.chain(_inject_clip(), optax.sgd(0.1)),
        keys("clip", CLIP_KEYS)),
    "skip_step": (
        lambda: oc.skip_step(optax.chain(oc.clip_by_global_norm(1.0),
                                         optax.adam(1e-3)), max_norm=10.0),
        keys("skip", SKIP_KEYS) | keys("clip", CLIP_KEYS)),
    "skip_step_named_chain": (
        lambda: oc.skip_step(optax.named_chain(
            ("z", oc.zclip(warmup_steps=2)), ("c", oc.clip_grad_norm(1.0)),
            ("opt", optax.adamw(1e-3)))),
        keys("skip", SKIP_KEYS) | keys("z/zclip", ZCLIP_KEYS)
        | keys("c/clip", CLIP_KEYS)),
    "multisteps_of_skip_step": (
        lambda: optax.MultiSteps(oc.skip_step(optax.chain(
            oc.clip_by_global_norm(1.0), oc.clip_by_value(0.5),
            optax.sgd(0.1)), zscore=6.0), 2),
        keys("skip", SKIP_KEYS) | keys("clip", CLIP_KEYS)),
}


@pytest.mark.parametrize("case", sorted(STATS_CASES))
def test_stats_key_sets(case):
  make, expected = STATS_CASES[case]
  tx = make()
  params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  grads = {"a": jnp.array([3.0, 0.0, 4.0]), "b": jnp.array([1.0, -1.0])}
  state = tx.init(params)
  assert set(oc.stats(state)) == expected  # at init
  update = jax.jit(tx.update)
  for _ in range(3):
    _, state = update(grads, state, params)
    stats = oc.stats(state)
    assert set(stats) == expected
    assert set(jax.jit(oc.stats)(state)) == expected
    for v in stats.values():
      assert isinstance(v, jax.Array) and v.shape == ()


# --------------------------------------------------------------------------
# Leaf-norm keys: unique, field names kept, stacks' whole norms (issue 20)

def test_leaf_norm_keys_are_unique_with_slashes_in_keys():
  grads = {"a/b": jnp.array([3.0]), "a": {"b": jnp.array([4.0])}}
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True)
  _, state = tx.update(grads, tx.init(grads))
  stats = oc.stats(state)
  assert float(stats["clip/leaf_norm/a%2Fb"]) == 3.0
  assert float(stats["clip/leaf_norm/a/b"]) == 4.0


class ValuePair(NamedTuple):
  value: jax.Array
  other: jax.Array


def test_a_field_named_value_keeps_its_name():
  grads = {"layer": ValuePair(jnp.array([3.0]), jnp.array([4.0]))}
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True)
  _, state = tx.update(grads, tx.init(grads))
  keys = {k for k in oc.stats(state) if "leaf_norm" in k}
  assert keys == {"clip/leaf_norm/layer/value", "clip/leaf_norm/layer/other"}


def test_an_nnx_variable_value_is_left_out():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  grads = nnx.state(model, nnx.Param)
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True)
  _, state = tx.update(grads, tx.init(grads))
  keys = {k for k in oc.stats(state) if "leaf_norm" in k}
  assert keys == {"clip/leaf_norm/bias", "clip/leaf_norm/kernel"}


@pytest.mark.parametrize("make", [
    lambda: oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis={"w": 0, "b": None}),
    lambda: oc.clip_by_norm(1.0, leaf_norms=True, layer_axis={"w": 0, "b": None}),
    lambda: oc.clip_by_global_norm({"x": 1.0}, groups="x", leaf_norms=True,
                                   layer_axis={"w": 0, "b": None}),
    lambda: oc.zclip(leaf_norms=True, layer_axis={"w": 0, "b": None}),
    lambda: oc.skip_step(optax.sgd(0.1), leaf_norms=True, layer_axis={"w": 0, "b": None}),
])
@pytest.mark.parametrize("ord_scale", [1.0, 1e30])
def test_stacked_leaves_keep_their_whole_norm_beside_each_layer(make, ord_scale):
  rng = np.random.default_rng(0)
  w = rng.standard_normal((3, 4, 5)).astype(np.float32) * ord_scale
  grads = {"w": jnp.asarray(w), "b": jnp.ones(3)}
  tx = make()
  _, state = tx.update(grads, tx.init(grads), grads)
  stats = oc.stats(state)
  name = next(k for k in stats if k.endswith("/layer_norm/w/0"))[:-len("/layer_norm/w/0")]
  exact = np.linalg.norm(w.astype(np.float64))
  np.testing.assert_allclose(float(stats[f"{name}/leaf_norm/w"]), exact, rtol=1e-6)
  for i in range(3):
    np.testing.assert_allclose(float(stats[f"{name}/layer_norm/w/{i}"]),
                               np.linalg.norm(w[i].astype(np.float64)), rtol=1e-6)
  assert f"{name}/leaf_norm/b" in stats and f"{name}/layer_norm/b/0" not in stats


def test_layers_of_list_held_stacks_are_never_read_from_list_indices():
  # Issue 27: two stacks in a list. Their whole norms sat at
  # `leaf_norm/layers/w/<list index>` beside `.../<list index>/<layer>`, and
  # docs/logging.md's recipe counted stack 1's whole norm as layer 1 (and
  # stack 0's as layer 0): {0: 5.48, 1: 9.49}. Layers now have keys of their own.
  stacks = [np.array([[1.0, 1.0], [2.0, 2.0]]), np.array([[3.0, 3.0], [4.0, 4.0]])]
  grads = {"layers": {"w": [jnp.asarray(s, jnp.float32) for s in stacks]}}
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=0)
  _, state = tx.update(grads, tx.init(grads))
  stats = oc.stats(state)
  assert sorted(k for k in stats if "_norm/" in k) == [
      "clip/layer_norm/layers/w/0/0", "clip/layer_norm/layers/w/0/1",
      "clip/layer_norm/layers/w/1/0", "clip/layer_norm/layers/w/1/1",
      "clip/leaf_norm/layers/w/0", "clip/leaf_norm/layers/w/1"]
  squares = collections.Counter()
  for key, value in stats.items():  # docs/logging.md's recipe
    found = re.fullmatch(r"clip/layer_norm/.+/(\d+)", key)
    if found:
      squares[int(found[1])] += float(value) ** 2
  layers = {i: math.sqrt(squares[i]) for i in sorted(squares)}
  np.testing.assert_allclose(list(layers), [0, 1])
  np.testing.assert_allclose(list(layers.values()), [math.sqrt(20), math.sqrt(40)],
                             rtol=1e-6)  # 4.47, 6.32
  np.testing.assert_allclose(float(stats["clip/leaf_norm/layers/w/1"]), math.sqrt(50),
                             rtol=1e-6)
