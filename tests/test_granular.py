"""Per-leaf and per-layer norms (``leaf_norms``, ``layer_axis``) and norm
groups (``groups``), against float64 numpy and separate clippers.

References are independent of the library: numpy norms of each leaf and of
each layer slice, ``clip_by_norm`` on an unstacked twin of a stacked tree,
and one ``clip_by_global_norm`` per group on the group's own sub-tree.
Distributed cases run on the 8 host devices of ``conftest.py``.
"""

import dataclasses
import functools
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_distributed import AXIS_TYPES, hlo_ops, make_mesh, shard

import optaxclip as oc

F = oc.functional
ORDS = [1, 2, 3, math.inf]


# --------------------------------------------------------------------------
# References

def f64(x) -> np.ndarray:
  return np.asarray(np.asarray(x, np.float32), np.float64)


def np_norm(x, ord, layer_axis=None):
  """The float64 ``ord``-norm of ``x``, or of each slice along ``layer_axis``."""
  a = np.abs(f64(x))
  if layer_axis is None:
    a = a.reshape(1, -1)
  else:
    a = np.moveaxis(a, layer_axis, 0).reshape(a.shape[layer_axis], -1)
  if ord == math.inf:
    out = a.max(axis=1, initial=0.0)
  else:
    out = np.sum(a ** ord, axis=1) ** (1 / ord)
  return out[0] if layer_axis is None else out


def np_norm_of_tree(tree, ord=2):
  """The float64 ``ord``-norm of all floating leaves of ``tree`` together."""
  leaves = [x for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)]
  return np_norm(np.concatenate([f64(x).ravel() for x in leaves]), ord)


def np_factor(norm, max_norm, eps=0.0):
  norm = np.asarray(norm)
  return np.where(norm + eps <= max_norm, 1.0, max_norm / (norm + eps))


def gradients(dtype=jnp.float32, scale=1.0, seed=0):
  """A tree with stacked layers (axis 0 and, for one leaf, the last axis),
  plain leaves, an int leaf, a None and a MaskedNode."""
  rng = np.random.default_rng(seed)

  def leaf(*shape):
    return jnp.asarray(rng.normal(size=shape) * scale, dtype)

  return {"layers": {"attn": {"kernel": leaf(4, 3, 5)},
                     "mlp": [leaf(4, 5), leaf(5, 4)]},
          "emb": leaf(6, 2), "bias": leaf(3),
          "step": jnp.int32(7), "frozen": None, "masked": optax.MaskedNode()}


LAYER_AXIS = {"layers": {"attn": 0, "mlp": [0, -1]}, "emb": None, "bias": None,
              "step": None, "frozen": None, "masked": None}
# Per float leaf in tree order (attn/kernel, mlp/0, mlp/1, bias, emb):
# the axis its norm keeps.
LEAF_AXES = {"kernel": 0, "mlp0": 0, "mlp1": 1, "bias": None, "emb": None}


def named_leaves(tree):
  return {"kernel": tree["layers"]["attn"]["kernel"],
          "mlp0": tree["layers"]["mlp"][0], "mlp1": tree["layers"]["mlp"][1],
          "bias": tree["bias"], "emb": tree["emb"]}


def expected_norm_tree(tree, ord, layer_axis=True):
  """The state's leaf-norm tree, in numpy: None at the int leaf."""
  leaves = named_leaves(tree)
  axes = LEAF_AXES if layer_axis else dict.fromkeys(LEAF_AXES)
  n = {k: np_norm(x, ord, axes[k]) for k, x in leaves.items()}
  return {"layers": {"attn": {"kernel": n["kernel"]},
                     "mlp": [n["mlp0"], n["mlp1"]]},
          "emb": n["emb"], "bias": n["bias"], "step": None, "frozen": None,
          "masked": optax.MaskedNode()}


def assert_norm_tree(got, want, rtol=1e-6):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == jnp.float32 and g.shape == np.shape(w)
    np.testing.assert_allclose(f64(g), w, rtol=rtol, atol=0)


def assert_scaled(out, tree, factors, rtol=1e-6):
  """Each float leaf of ``out`` is its leaf of ``tree`` times its factor
  (a number, or per layer a vector along the leaf's layer axis)."""
  for name, x in named_leaves(tree).items():
    y = named_leaves(out)[name]
    assert y.dtype == x.dtype and y.shape == x.shape
    s = np.asarray(factors[name])
    if s.ndim:
      s = np.expand_dims(s, [a for a in range(x.ndim) if a != LEAF_AXES[name]])
    tol = rtol if x.dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(f64(y), f64(x) * s, rtol=tol, atol=0)
  np.testing.assert_array_equal(out["step"], tree["step"])
  assert out["frozen"] is None and out["masked"] == optax.MaskedNode()


def run(tx, grads, jit=True, state=None):
  update = jax.jit(tx.update) if jit else tx.update
  return update(grads, tx.init(grads) if state is None else state)


GLOBAL_CLIPPERS = {
    "clip_by_global_norm": lambda **k: oc.clip_by_global_norm(1.0, **k),
    "clip_grad_norm": lambda **k: oc.clip_grad_norm(
        1.0, **{("norm_type" if a == "ord" else a): v for a, v in k.items()}),
}


# --------------------------------------------------------------------------
# 1. leaf_norms=True

@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("name", list(GLOBAL_CLIPPERS))
def test_leaf_norms_equal_numpy_per_leaf_and_per_layer(name, ord, jit):
  grads = gradients()
  for layer_axis in (None, LAYER_AXIS):
    tx = GLOBAL_CLIPPERS[name](ord=ord, leaf_norms=True, layer_axis=layer_axis)
    _, state = run(tx, grads, jit)
    assert_norm_tree(state.leaf_norms,
                     expected_norm_tree(grads, ord, layer_axis is not None))


@pytest.mark.parametrize("layer_axis", [None, LAYER_AXIS], ids=["leaf", "layer"])
@pytest.mark.parametrize("name", ["skip_step", "zclip"])
def test_skip_step_and_zclip_keep_leaf_norms(name, layer_axis):
  grads = gradients()
  if name == "skip_step":
    tx = oc.skip_step(optax.sgd(1.0), leaf_norms=True, layer_axis=layer_axis)
    state = jax.jit(tx.update)(grads, tx.init(grads), grads)[1]
    leaf_state, prefix, norm = state.stats, "skip", state.stats.norm
  else:
    tx = oc.zclip(leaf_norms=True, layer_axis=layer_axis)
    state = run(tx, grads)[1]
    leaf_state, prefix, norm = state, "zclip", state.norm
  assert_norm_tree(leaf_state.leaf_norms,
                   expected_norm_tree(grads, 2, layer_axis is not None))
  np.testing.assert_allclose(norm, np_norm_of_tree(grads), rtol=2e-6)
  keys = [k for k in oc.stats(state) if "/leaf_norm/" in k]
  assert keys and all(k.startswith(f"{prefix}/leaf_norm/") for k in keys)
  # Off by default: nothing kept.
  plain = oc.skip_step(optax.sgd(1.0)) if name == "skip_step" else oc.zclip()
  plain_state = plain.init(grads)
  stats = plain_state.stats if name == "skip_step" else plain_state
  assert stats.leaf_norms is None


def test_skip_step_leaf_norms_are_unscaled_under_loss_scaling():
  grads = gradients()
  tx = oc.skip_step(optax.chain(oc.dynamic_loss_scale(2.0 ** 10), optax.sgd(1.0)),
                    leaf_norms=True)
  state = tx.init(grads)
  scaled = jax.tree.map(lambda x: x * 2.0 ** 10
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, grads)
  state = jax.jit(tx.update)(scaled, state, grads)[1]
  assert_norm_tree(state.stats.leaf_norms,
                   expected_norm_tree(grads, 2, False), rtol=2e-6)


@pytest.mark.parametrize("ord", ORDS)
def test_clip_by_norm_keeps_its_leaf_norms(ord):
  grads = gradients()
  for layer_axis in (None, LAYER_AXIS):
    tx = oc.clip_by_norm(1.0, ord=ord, leaf_norms=True, layer_axis=layer_axis)
    _, state = run(tx, grads)
    want = expected_norm_tree(grads, ord, layer_axis is not None)
    assert_norm_tree(state.leaf_norms, want)
    np.testing.assert_allclose(state.norm, max(np.max(w) for w in jax.tree.leaves(want)),
                               rtol=1e-6)


def test_leaf_norm_tree_has_the_gradients_structure():
  grads = gradients()
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=LAYER_AXIS)
  state = tx.init(grads)
  # None where a leaf is not clippable (the int step), as for None and
  # MaskedNode subtrees; zeros of each norm's shape before the first step.
  assert state.leaf_norms["step"] is None and state.leaf_norms["frozen"] is None
  assert state.leaf_norms["masked"] == optax.MaskedNode()
  assert jax.tree.map(np.shape, state.leaf_norms) == jax.tree.map(
      np.shape, expected_norm_tree(grads, 2))
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(state.leaf_norms))
  _, new_state = run(tx, grads)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)


def test_leaf_norms_under_an_injected_traced_order():
  grads = gradients()
  tx = optax.inject_hyperparams(oc.clip_by_global_norm)(
      max_norm=1.0, ord=3.0, leaf_norms=True, layer_axis=LAYER_AXIS)
  state = tx.init(grads)
  for ord in (3.0, 1.0, 2.0, math.inf, 0.5):
    state.hyperparams["ord"] = jnp.asarray(ord, jnp.float32)
    _, new_state = jax.jit(tx.update)(grads, state)
    want = expected_norm_tree(grads, ord)
    assert_norm_tree(new_state.inner_state.leaf_norms, want, rtol=2e-6)
    np.testing.assert_allclose(
        new_state.inner_state.norm,
        np_norm(np.concatenate([f64(x).ravel() for x in named_leaves(grads).values()]), ord),
        rtol=2e-6)


def ulps(a, b) -> int:
  """How many float32 values lie between ``a`` and ``b``."""
  a, b = np.float32(a), np.float32(b)
  return abs(int(a.view(np.int32)) - int(b.view(np.int32)))


@pytest.mark.parametrize("scale", [1.0, 1e30, 1e-30])
@pytest.mark.parametrize("ord", ORDS)
def test_global_norm_is_the_norm_of_the_leaf_norms(ord, scale):
  # Same partial sums: the global norm is the norm of what the state keeps
  # (to the rounding of one root), and what leaf_norms=False gives (a few
  # ulps: the leaves' norms are rounded to float32 first).
  grads = gradients(scale=scale, seed=2)
  tx = oc.clip_by_global_norm(1.0, ord=ord, leaf_norms=True, layer_axis=LAYER_AXIS)
  _, state = run(tx, grads)
  kept = np.concatenate([np.ravel(f64(x)) for x in jax.tree.leaves(state.leaf_norms)])
  assert ulps(state.norm, np_norm(kept, ord)) <= 2
  _, plain = run(oc.clip_by_global_norm(1.0, ord=ord), grads)
  assert ulps(state.norm, plain.norm) <= 4
  want = np_norm(np.concatenate([f64(x).ravel() for x in named_leaves(grads).values()]), ord)
  np.testing.assert_allclose(f64(state.norm), want, rtol=2e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("ord", ORDS)
def test_a_nonfinite_leaf_shows_in_its_own_entry_only(ord, bad):
  grads = gradients(seed=3)
  # One bad value in layer 2 of the stacked kernel, and one in `emb`.
  grads["layers"]["attn"]["kernel"] = grads["layers"]["attn"]["kernel"].at[2, 1, 1].set(bad)
  grads["emb"] = grads["emb"].at[0, 0].set(bad)
  tx = oc.clip_by_global_norm(1.0, ord=ord, leaf_norms=True, layer_axis=LAYER_AXIS)
  _, state = run(tx, grads)
  kernel = np.asarray(state.leaf_norms["layers"]["attn"]["kernel"])
  want_bad = np.isnan if math.isnan(bad) else np.isposinf
  assert want_bad(kernel[2]) and want_bad(state.leaf_norms["emb"])
  good = expected_norm_tree(gradients(seed=3), ord)
  np.testing.assert_allclose(np.delete(kernel, 2),
                             np.delete(good["layers"]["attn"]["kernel"], 2), rtol=1e-6)
  for path in (("bias",), ("layers", "mlp", 0), ("layers", "mlp", 1)):
    got, want = state.leaf_norms, good
    for key in path:
      got, want = got[key], want[key]
    np.testing.assert_allclose(f64(got), want, rtol=1e-6)


@pytest.mark.parametrize("make", [
    lambda **k: oc.clip_by_global_norm(1.0, **k),
    lambda **k: oc.clip_grad_norm(1.0, **k),
    lambda **k: oc.clip_by_norm(1.0, **k)], ids=["global", "grad_norm", "per_leaf"])
def test_leaf_norms_off_by_default_compiles_the_same_program(make):
  grads = gradients()
  default, off = make(), make(leaf_norms=False)
  assert default.init(grads).leaf_norms is None
  assert off.init(grads).leaf_norms is None

  def lowered(tx):
    return jax.jit(tx.update).lower(grads, tx.init(grads)).as_text()

  assert lowered(off) == lowered(default)


def test_layer_axis_may_be_a_callable_of_the_gradients():
  grads = gradients()
  as_callable = lambda tree: jax.tree.map(  # noqa: E731
      lambda _: None, tree) | {"layers": {"attn": 0, "mlp": [0, -1]}}
  for tx in (oc.clip_by_global_norm(1.0, leaf_norms=True,
                                    layer_axis=as_callable),
             oc.clip_by_norm(1.0, leaf_norms=True, layer_axis=as_callable)):
    _, state = run(tx, grads)
    assert_norm_tree(state.leaf_norms, expected_norm_tree(grads, 2, True))


def test_layer_axis_without_leaf_norms_leaves_the_global_norm_alone():
  # clip_by_global_norm takes layer_axis for logging only.
  grads = gradients()
  tx = oc.clip_by_global_norm(1.0, layer_axis=LAYER_AXIS)
  assert jax.jit(tx.update).lower(grads, tx.init(grads)).as_text() == \
      jax.jit(oc.clip_by_global_norm(1.0).update).lower(
          grads, oc.clip_by_global_norm(1.0).init(grads)).as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_leaf_norms_of_half_precision_leaves(dtype):
  # fp16 squares overflow above 256: the norms accumulate in float32.
  grads = gradients(dtype, scale=300.0, seed=4)
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=LAYER_AXIS)
  out, state = run(tx, grads)
  assert_norm_tree(state.leaf_norms, expected_norm_tree(grads, 2), rtol=1e-5)
  assert all(np.isfinite(f64(x)).all() for x in jax.tree.leaves(state.leaf_norms))
  assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, grads)


# --------------------------------------------------------------------------
# stats keys

def test_stats_keys_name_every_leaf_and_layer():
  grads = gradients()
  tx = optax.chain(oc.clip_by_global_norm(1.0, leaf_norms=True,
                                          layer_axis=LAYER_AXIS), optax.sgd(0.1))
  _, state = run(tx, grads)
  found = oc.stats(state)
  leaf_keys = sorted(k for k in found if "/leaf_norm/" in k)
  assert leaf_keys == sorted(
      [f"clip/leaf_norm/layers/attn/kernel/{i}" for i in range(4)]
      + [f"clip/leaf_norm/layers/mlp/0/{i}" for i in range(4)]
      + [f"clip/leaf_norm/layers/mlp/1/{i}" for i in range(4)]
      + ["clip/leaf_norm/emb", "clip/leaf_norm/bias"])
  kernel = np_norm(grads["layers"]["attn"]["kernel"], 2, 0)
  np.testing.assert_allclose(found["clip/leaf_norm/layers/attn/kernel/3"], kernel[3],
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
  _, state = run(tx, grads)
  assert sorted(k for k in oc.stats(state) if "leaf_norm" in k) == [
      "clip/leaf_norm/block/kernel/0", "clip/leaf_norm/block/kernel/1",
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
                             np_norm(grads["attn"]["kernel"][...], 2), rtol=1e-6)


# --------------------------------------------------------------------------
# 2. layer_axis in clip_by_norm

@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clip_by_norm_clips_each_layer_by_its_own_norm(ord, dtype):
  grads = gradients(dtype, scale=2.0, seed=5)
  max_norm = 3.0
  tx = oc.clip_by_norm(max_norm, ord=ord, layer_axis=LAYER_AXIS)
  out, state = run(tx, grads)
  norms = {k: np_norm(x, ord, LEAF_AXES[k]) for k, x in named_leaves(grads).items()}
  factors = {k: np_factor(n, max_norm) for k, n in norms.items()}
  assert 0 < min(np.min(f) for f in factors.values()) < 1  # some layers clip
  assert max(np.max(f) for f in factors.values()) == 1  # and some do not
  assert_scaled(out, grads, factors)
  np.testing.assert_allclose(state.norm, max(np.max(n) for n in norms.values()),
                             rtol=1e-5)
  np.testing.assert_allclose(state.scale, min(np.min(f) for f in factors.values()),
                             rtol=1e-5)
  functional = F.clip_by_norm(grads, max_norm, ord=ord, layer_axis=LAYER_AXIS)
  assert_scaled(functional, grads, factors)


def unstack(tree):
  """The twin of ``gradients()`` with each stacked leaf split into layers."""
  leaves = named_leaves(tree)
  return {name: (list(np.moveaxis(np.asarray(x), LEAF_AXES[name], 0))
                 if LEAF_AXES[name] is not None else x)
          for name, x in leaves.items()}


@pytest.mark.parametrize("ord", ORDS)
def test_layer_axis_equals_clip_by_norm_on_the_unstacked_twin(ord):
  grads = gradients(scale=2.0, seed=6)
  stacked, _ = run(oc.clip_by_norm(3.0, ord=ord, layer_axis=LAYER_AXIS), grads)
  twin, _ = run(oc.clip_by_norm(3.0, ord=ord), jax.tree.map(jnp.asarray, unstack(grads)))
  for name, x in named_leaves(stacked).items():
    axis = LEAF_AXES[name]
    want = twin[name] if axis is None else np.stack(twin[name], axis)
    np.testing.assert_allclose(np.asarray(x), np.asarray(want), rtol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_any_layer_axis_of_a_leaf(axis):
  x = jnp.asarray(np.random.default_rng(7).normal(size=(3, 4, 5)), jnp.float32)
  out = F.clip_by_norm([x], 1.0, layer_axis=axis)[0]
  factor = np_factor(np_norm(x, 2, axis), 1.0)
  shape = [1, 1, 1]
  shape[axis] = -1
  np.testing.assert_allclose(np.asarray(out), f64(x) * factor.reshape(shape), rtol=1e-6)
  tx = oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=axis)
  _, state = run(tx, [x])
  np.testing.assert_allclose(state.leaf_norms[0], np_norm(x, 2, axis), rtol=1e-6)


@pytest.mark.parametrize("call", ["init", "update", "functional"])
def test_layer_axis_errors_name_the_leaf(call):
  grads = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
  run_it = {
      "init": lambda la: oc.clip_by_norm(1.0, layer_axis=la).init(grads),
      "update": lambda la: oc.clip_by_norm(1.0, layer_axis=la).update(grads, None),
      "functional": lambda la: F.clip_by_norm(grads, 1.0, layer_axis=la)}[call]
  with pytest.raises(ValueError, match=re.escape(
      "`clip_by_norm(layer_axis=1)` is out of range for leaf ['b'] of shape (3,)")):
    run_it({"w": 1, "b": 1})
  with pytest.raises(ValueError, match=r"does not match the gradient tree"):
    run_it({"w": 0})
  with pytest.raises(TypeError, match=r"must hold ints .* got 'w'"):
    run_it({"w": "w", "b": None})


# --------------------------------------------------------------------------
# 3. groups

LABELS = {"layers": {"attn": "attn", "mlp": "mlp"}, "emb": "embed", "bias": "mlp",
          "step": "attn", "frozen": "attn", "masked": "attn"}
GROUP_LEAVES = {"attn": ["kernel"], "mlp": ["mlp0", "mlp1", "bias"], "embed": ["emb"]}


def by_path(tree):
  """The same labels from the tree, by a callable (as optax.partition)."""
  def label(path, _):
    keys = [getattr(k, "key", None) for k in path]
    return "embed" if "emb" in keys else "attn" if "attn" in keys else "mlp"
  return jax.tree_util.tree_map_with_path(label, tree)


@pytest.mark.parametrize("groups", [LABELS, by_path], ids=["tree", "callable"])
@pytest.mark.parametrize("ord", ORDS)
def test_groups_equal_one_clipper_per_group(ord, groups):
  grads = gradients(scale=3.0, seed=8)
  max_norm = {"attn": 1.0, "mlp": 100.0, "embed": 0.5}
  tx = oc.clip_by_global_norm(max_norm, ord=ord, groups=groups)
  out, state = run(tx, grads)
  leaves, clipped = named_leaves(grads), named_leaves(out)
  for label, names in GROUP_LEAVES.items():
    sub = {name: leaves[name] for name in names}
    want, alone = run(oc.clip_by_global_norm(max_norm[label], ord=ord), sub)
    for name in names:
      np.testing.assert_allclose(np.asarray(clipped[name]), np.asarray(want[name]),
                                 rtol=2e-6)
    group = state.groups[label]
    np.testing.assert_allclose(group.norm, alone.norm, rtol=2e-6)
    np.testing.assert_allclose(group.scale, alone.scale, rtol=2e-6)
    assert int(group.clipped_count) == int(alone.clipped_count)
  assert int(state.groups["mlp"].clipped_count) == 0  # a group left alone
  np.testing.assert_array_equal(out["step"], grads["step"])
  found = oc.stats(state)
  for label in GROUP_LEAVES:
    for field in ("norm", "scale", "count", "clipped_count", "nonfinite_count",
                  "clip_rate"):
      assert f"clip/{label}/{field}" in found


def test_groups_with_one_number_and_leaf_norms():
  grads = gradients(scale=3.0, seed=9)
  tx = oc.clip_by_global_norm(1.0, groups=LABELS, leaf_norms=True, layer_axis=LAYER_AXIS)
  out, state = run(tx, grads)
  assert_norm_tree(state.leaf_norms, expected_norm_tree(grads, 2))
  for label, names in GROUP_LEAVES.items():
    norm = np_norm(np.concatenate([f64(named_leaves(grads)[n]).ravel()
                                   for n in names]), 2)
    np.testing.assert_allclose(state.groups[label].norm, norm, rtol=2e-6)
    for name in names:
      np.testing.assert_allclose(f64(named_leaves(out)[name]),
                                 f64(named_leaves(grads)[name]) * np_factor(norm, 1.0),
                                 rtol=2e-6)
  assert "clip/leaf_norm/layers/attn/kernel/3" in oc.stats(state)


def test_a_group_without_a_limit_fails_at_init_naming_it():
  tx = oc.clip_by_global_norm({"attn": 1.0, "mlp": 1.0}, groups=LABELS)
  with pytest.raises(ValueError, match=r"no limit for group 'embed'"):
    tx.init(gradients())


def test_nonfinite_zero_zeroes_only_the_bad_group():
  grads = gradients(scale=3.0, seed=10)
  grads["emb"] = grads["emb"].at[1, 1].set(jnp.nan)
  tx = oc.clip_by_global_norm(1.0, groups=LABELS, nonfinite="zero")
  out, state = run(tx, grads)
  np.testing.assert_array_equal(out["emb"], np.zeros_like(grads["emb"]))
  assert int(state.groups["embed"].nonfinite_count) == 1
  clean = gradients(scale=3.0, seed=10)
  want, _ = run(oc.clip_by_global_norm(1.0, groups=LABELS), clean)
  for name in ("kernel", "mlp0", "mlp1", "bias"):
    np.testing.assert_array_equal(named_leaves(out)[name], named_leaves(want)[name])
  assert int(state.groups["attn"].nonfinite_count) == 0


def test_nonfinite_raise_names_the_leaf():
  grads = gradients(seed=11)
  grads["bias"] = grads["bias"].at[0].set(jnp.inf)
  tx = oc.clip_by_global_norm(1.0, groups=LABELS, nonfinite="raise")
  with pytest.raises(oc.NonFiniteGradientError, match=r"\['bias'\]"):
    tx.update(grads, tx.init(grads))


@pytest.mark.parametrize("make", [
    lambda: oc.clip_by_global_norm(1.0, nonfinite="raise"),
    lambda: oc.clip_by_global_norm(1.0, nonfinite="raise", leaf_norms=True),
    lambda: oc.clip_by_norm(1.0, nonfinite="raise", layer_axis=0),
    lambda: oc.clip_grad_norm(1.0, error_if_nonfinite=True)],
    ids=["global", "leaf_norms", "per_layer", "grad_norm"])
def test_nonfinite_raise_names_only_the_leaves_that_hold_it(make):
  # Not the clipped leaves: a NaN factor makes every one of them NaN.
  bad = {"decoder": jnp.ones((2, 2)), "encoder": jnp.array([[1.0, jnp.nan]])}
  tx = make()
  with pytest.raises(oc.NonFiniteGradientError,
                     match=r"Leaves holding NaN or Inf: \['encoder'\]\. Pass"):
    tx.update(bad, tx.init(bad))


def test_groups_on_a_tree_without_floating_leaves():
  tree = {"step": jnp.int32(3), "frozen": None}
  for nonfinite in ("propagate", "zero", "raise"):
    tx = oc.clip_by_global_norm(1.0, groups="all", leaf_norms=True, nonfinite=nonfinite)
    out, state = run(tx, tree)
    assert state.groups == {} and out["step"] == 3


# --------------------------------------------------------------------------
# 4. Distributed: shard_map with specs, sharded jit, vmap

AXES = ("data", "model")
# On a 2x4 mesh: a stacked kernel whose layer axis is split over "data", a
# stacked leaf whose layers are whole on every device, a leaf replicated
# over "data", one replicated everywhere, and an int leaf.
SM_LEAVES = {"kernel": ((8, 4, 8), P("data", None, "model")),
             "stacked": ((4, 8), P(None, "model")),
             "w": ((6, 12), P(None, "model")), "b": ((5,), P())}
SM_SPECS = {name: spec for name, (_, spec) in SM_LEAVES.items()} | {"step": P()}
SM_LAYER_AXIS = {"kernel": 0, "stacked": 0, "w": None, "b": None, "step": None}
SM_UNSPLIT = {**SM_LAYER_AXIS, "kernel": None}  # no layer axis split
SM_LABELS = {"kernel": "a", "stacked": "b", "w": "a", "b": "b", "step": "a"}


def sm_host(seed=12, scale=1.0):
  rng = np.random.default_rng(seed)
  tree = {name: np.asarray(rng.normal(size=shape) * scale, np.float32)
          for name, (shape, _) in SM_LEAVES.items()}
  return {**tree, "step": np.int32(3)}


# Per order, a layer limit some of the kernel's layers are above.
PER_LAYER = {1: 25.0, 2: 5.0, math.inf: 2.2}


def sm_transforms(ord=2, **dist):
  return {
      "global": oc.clip_by_global_norm(1.0, ord=ord, leaf_norms=True,
                                       layer_axis=SM_LAYER_AXIS, **dist),
      "per_layer": oc.clip_by_norm(PER_LAYER[ord], ord=ord, leaf_norms=True,
                                   layer_axis=SM_LAYER_AXIS, **dist),
      "groups": oc.clip_by_global_norm({"a": 1.0, "b": 2.0}, ord=ord, groups=SM_LABELS,
                                       leaf_norms=True, layer_axis=SM_UNSPLIT, **dist),
  }


def state_specs(name, state):
  """out_specs of a state: the layer norms of the split kernel along "data"."""
  specs = jax.tree.map(lambda _: P(), state)
  if name == "groups":  # its kernel has no layer axis
    return specs
  return specs._replace(leaf_norms={**specs.leaf_norms, "kernel": P("data")})


def sm_step(txs, tree):
  return {name: tx.update(tree, tx.init(tree)) for name, tx in txs.items()}


def assert_same_results(got, want, rtol=2e-6):
  for name in want:
    jax.tree.map(lambda g, w, name=name: np.testing.assert_allclose(
        np.asarray(g), np.asarray(w), rtol=rtol, err_msg=name), got[name], want[name])


@pytest.mark.parametrize("ord", [1, 2, math.inf])
def test_shard_map_layer_norms_and_clipping_equal_the_unsharded(ord):
  host = sm_host()
  want = sm_step(sm_transforms(ord), jax.tree.map(jnp.asarray, host))
  txs = sm_transforms(ord, axis_name=AXES, specs=SM_SPECS)
  mesh = make_mesh((2, 4), AXES)
  out_specs = {name: (SM_SPECS, state_specs(name, want[name][1])) for name in txs}
  step = jax.jit(shard_map(functools.partial(sm_step, txs), mesh=mesh,
                           in_specs=(SM_SPECS,), out_specs=out_specs))
  got = step(shard(host, mesh, SM_SPECS))
  assert_same_results(got, want)
  # And against numpy: each layer of the split kernel, each clipped by its own.
  np.testing.assert_allclose(got["global"][1].leaf_norms["kernel"],
                             np_norm(host["kernel"], ord, 0), rtol=2e-6)
  factors = np_factor(np_norm(host["kernel"], ord, 0), PER_LAYER[ord])
  assert 0 < factors.min() < factors.max() == 1
  np.testing.assert_allclose(got["per_layer"][0]["kernel"],
                             f64(host["kernel"]) * factors[:, None, None], rtol=2e-6)


def hlo_all_reduces(tx, host):
  mesh = make_mesh((2, 4), AXES)
  tree = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      np.shape(x), x.dtype, sharding=NamedSharding(mesh, s)), host, SM_SPECS)
  f = shard_map(lambda t: tx.update(t, tx.init(t))[1], mesh=mesh,
                in_specs=(SM_SPECS,), out_specs=P(), check_vma=False)
  return hlo_ops(jax.jit(f).lower(tree).compile().as_text(), "all-reduce")


@pytest.mark.parametrize("layer_axis", ["unsplit", "split"])
@pytest.mark.parametrize("name", ["leaf_norms", "clip_by_norm", "groups", "block_rms",
                                  "agc"])
def test_one_all_reduce_with_or_without_split_layer_axes(name, layer_axis):
  # A layer axis split over the mesh too: each device writes its layers at
  # their place among all devices' layers, so one all-reduce still does.
  axes = {"unsplit": SM_UNSPLIT, "split": SM_LAYER_AXIS}[layer_axis]
  dist = dict(axis_name=AXES, specs=SM_SPECS, layer_axis=axes)
  tx = {"leaf_norms": lambda: oc.clip_by_global_norm(1.0, leaf_norms=True, **dist),
        "clip_by_norm": lambda: oc.clip_by_norm(1.0, leaf_norms=True, **dist),
        "groups": lambda: oc.clip_by_global_norm(1.0, groups=SM_LABELS, leaf_norms=True,
                                                 **dist),
        "block_rms": lambda: oc.clip_by_block_rms(0.1, **dist),
        "agc": lambda: with_params(oc.adaptive_grad_clip(0.01, **dist))}[name]()
  main, _ = hlo_all_reduces(tx, sm_host())
  assert main == 1, f"{name}: {main} all-reduces on the main path"


def with_params(tx):
  """``tx`` with the gradients as its params too (AGC needs params)."""
  return optax.GradientTransformation(
      tx.init, lambda updates, state, params=None: tx.update(updates, state, updates))


def test_groups_with_a_split_layer_axis_equal_the_unsharded():
  host = sm_host(seed=15)
  labels = {**SM_LABELS, "kernel": "b"}  # the split kernel shares a group
  make = lambda **kw: oc.clip_by_global_norm(  # noqa: E731
      {"a": 1.0, "b": 2.0}, groups=labels, leaf_norms=True, layer_axis=SM_LAYER_AXIS,
      **kw)
  want = sm_step({"groups": make()}, jax.tree.map(jnp.asarray, host))
  tx = make(axis_name=AXES, specs=SM_SPECS)
  mesh = make_mesh((2, 4), AXES)
  specs = state_specs("global", jax.tree.map(lambda _: P(), want["groups"][1]))
  step = jax.jit(shard_map(functools.partial(sm_step, {"groups": tx}), mesh=mesh,
                           in_specs=(SM_SPECS,), out_specs={"groups": (SM_SPECS, specs)}))
  got = step(shard(host, mesh, SM_SPECS))
  assert_same_results(got, want)
  # Group "b" by hand: the kernel's and the others' norms together.
  members = [host[k] for k, label in labels.items() if label == "b" and k != "step"]
  norm = np.sqrt(sum(np.sum(f64(x) ** 2) for x in members))
  np.testing.assert_allclose(got["groups"][1].groups["b"].norm, norm, rtol=2e-6)


def layer_clippers():
  """Every per-layer clipper on the split-kernel tree (AGC's params: the
  gradients; its kernel units are split over both mesh axes)."""
  return {"agc": with_params(oc.adaptive_grad_clip(0.01, layer_axis=SM_LAYER_AXIS)),
          "block_rms": oc.clip_by_block_rms(0.1, layer_axis=SM_LAYER_AXIS),
          "adagc": oc.adagc(layer_axis=SM_LAYER_AXIS)}


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_sharded_jit_equals_the_unsharded(axis_type):
  host = sm_host(seed=13)
  mesh = make_mesh((2, 4), AXES, axis_type)
  tree = shard(host, mesh, SM_SPECS)
  txs = {**sm_transforms(), **layer_clippers()}
  want = sm_step(txs, jax.tree.map(jnp.asarray, host))
  got = jax.jit(functools.partial(sm_step, txs))(tree)
  assert_same_results(got, want)
  # The updates keep their input's layout: on an Auto mesh, XLA would give
  # the unsplit `stacked` the split kernel's layout along "data" through a
  # vector of factors the two share, were each leaf's factors not whole.
  for name in txs:
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(got[name][0])):
      assert y.sharding.is_equivalent_to(x.sharding, x.ndim), name


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
def test_vmap_over_trees_sharded_on_a_mesh(axis_type):
  # A batch of split-kernel trees (the batch axis first, whole): each
  # tree's decision to rescue is one for the batch, so no select runs over
  # the split leaves (which an Explicit mesh refuses).
  mesh = make_mesh((2, 4), AXES, axis_type)
  hosts = [sm_host(seed=s) for s in (16, 17, 18)]
  host = {k: np.stack([h[k] for h in hosts]) for k in hosts[0]}
  specs = {k: P(None, *spec) for k, spec in SM_SPECS.items()}
  tree = shard(host, mesh, specs)
  txs = {"global": oc.clip_by_global_norm(1.0), **sm_transforms(), **layer_clippers()}
  step = lambda t: {name: tx.update(t, tx.init(t), t)[0]  # noqa: E731
                    for name, tx in txs.items()}
  got = jax.jit(jax.vmap(step))(tree)
  want = jax.vmap(step)(jax.tree.map(jnp.asarray, host))
  for name in txs:
    jax.tree.map(lambda g, w, name=name: np.testing.assert_allclose(
        g, w, rtol=2e-6, err_msg=name), got[name], want[name])
    for k in host:
      assert got[name][k].sharding.is_equivalent_to(tree[k].sharding, host[k].ndim), (
          name, k)


def test_vmap_over_a_batch_of_trees():
  batch = [gradients(scale=s, seed=14) for s in (0.5, 1.0, 4.0)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batch)
  for tx in (oc.clip_by_global_norm(1.0, leaf_norms=True, layer_axis=LAYER_AXIS),
             oc.clip_by_norm(1.0, leaf_norms=True, layer_axis=LAYER_AXIS),
             oc.clip_by_global_norm(1.0, groups=LABELS, leaf_norms=True,
                                    layer_axis=LAYER_AXIS)):
    out, state = jax.jit(jax.vmap(lambda t, tx=tx: tx.update(t, tx.init(t))))(stacked)
    for i, grads in enumerate(batch):
      want_out, want_state = run(tx, grads)
      jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(
          np.asarray(a)[i], np.asarray(b), rtol=1e-6), (out, state), (want_out, want_state))
