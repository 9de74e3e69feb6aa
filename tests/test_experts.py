"""Mixture-of-experts gradients: ``expert_axis`` (per expert, per layer x
expert norms and clipping) and ``mask`` (leaves kept out of the norm and the
clip: a frozen router), against float64 numpy written from the definitions;
sharded experts (``shard_map`` with specs, sharded ``jit``) on the 8 host
CPU devices against the unsharded result, with one all-reduce.

A small MoE tree, stacked (``[layers, experts, ...]``, as ``nn.scan`` over
MoE blocks gives) or not (``[experts, ...]``). Each test compiles one step
computing every transform it checks.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import f64, hlo_ops, make_mesh, np_factor, np_norm, shard
from jax import shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxclip as oc

L, E, D, H = 2, 4, 4, 2  # layers, experts, model and expert hidden widths


def moe_tree(stacked: bool, seed: int = 0) -> dict:
  """Router (large: a frozen router's gradients would dominate the norm),
  experts' in and out kernels, a dense leaf, and an int step."""
  rng = np.random.default_rng(seed)
  lead = (L,) if stacked else ()

  def leaf(*shape, scale=1.0):
    return np.asarray(rng.normal(size=lead + shape) * scale, np.float32)
  return {"router": leaf(D, E, scale=50.0),
          "moe": {"w_in": leaf(E, D, H), "w_out": leaf(E, H, D)},
          "dense": leaf(D, D), "step": np.int32(7)}


def axes(stacked: bool) -> tuple[dict, dict | None]:
  """``(expert_axis, layer_axis)`` of ``moe_tree(stacked)``."""
  experts = {"router": None, "moe": 1 if stacked else 0, "dense": None,
             "step": None}
  layers = {"router": 0, "moe": 0, "dense": 0, "step": None}
  return experts, (layers if stacked else None)


FROZEN = {"router": False, "moe": True, "dense": True, "step": True}


def np_units(x, kept: tuple[int, ...], ord=2) -> np.ndarray:
  """Each unit's float64 ``ord``-norm: reduced over every axis not kept."""
  x = np.abs(f64(x))
  reduced = tuple(a for a in range(x.ndim) if a not in kept)
  if ord == math.inf:
    return x.max(axis=reduced)
  return np.sum(x ** ord, axis=reduced) ** (1 / ord)


def kept_axes(stacked: bool) -> dict:
  """Per leaf name, the axes its units keep (per layer x expert, per expert,
  per layer)."""
  if stacked:
    return {"w_in": (0, 1), "w_out": (0, 1), "router": (0,), "dense": (0,)}
  return {"w_in": (0,), "w_out": (0,), "router": (), "dense": ()}


def leaves_of(tree) -> dict:
  return {"router": tree["router"], "dense": tree["dense"], **tree["moe"]}


def expert_limit(stacked: bool, ord) -> float:
  """A limit half of the experts' units are above: some clipped, not all."""
  kept = kept_axes(stacked)["w_in"]
  return float(np.median(np_units(moe_tree(stacked)["moe"]["w_in"], kept, ord)))


def expert_transforms(stacked: bool, ord=2, guards=False, **dist) -> dict:
  """The global clip and per-expert clipping (with ``guards``, zclip and
  skip_step too), keeping per-expert leaf norms, the router masked out of
  the global ones."""
  experts, layers = axes(stacked)
  units = {"expert_axis": experts, "layer_axis": layers, "leaf_norms": True}
  txs = {"global": oc.clip_by_global_norm(1.0, ord=ord, mask=FROZEN, **units, **dist),
         "each": oc.clip_by_norm(expert_limit(stacked, ord), ord=ord, **units, **dist)}
  if guards:
    txs["zclip"] = oc.zclip(mask=FROZEN, max_grad_norm=1.0, **units, **dist)
    txs["skip"] = oc.skip_step(optax.sgd(1.0), max_norm=1e9, mask=FROZEN, **units,
                               **dist)
  return txs


def step(txs, tree):
  return {name: tx.update(tree, tx.init(tree), tree) for name, tx in txs.items()}


@functools.cache
def expert_results(stacked: bool, ord=2):
  host = moe_tree(stacked)
  txs = expert_transforms(stacked, ord, guards=stacked and ord == 2)
  return host, jax.jit(functools.partial(step, txs))(host)


# --------------------------------------------------------------------------
# Per expert and per layer x expert, against numpy

@pytest.mark.parametrize(("stacked", "ord"), [(False, 2), (True, 2), (True, 1), (True, math.inf)],
                         ids=["experts", "layers_x_experts", "layers_x_experts-1",
                              "layers_x_experts-inf"])
def test_expert_norms_and_clipping_match_numpy(stacked, ord):
  host, got = expert_results(stacked, ord)
  named, kept = leaves_of(host), kept_axes(stacked)
  units = {k: np_units(x, kept[k], ord) for k, x in named.items()}
  # Per-expert clipping: each (layer's) expert scaled by its own factor.
  out, state = got["each"]
  limit = expert_limit(stacked, ord)
  for k, x in named.items():
    factor = np_factor(units[k], limit)
    shape = [x.shape[a] if a in kept[k] else 1 for a in range(x.ndim)]
    np.testing.assert_allclose(leaves_of(out)[k], f64(x) * factor.reshape(shape),
                               rtol=3e-6, err_msg=k)
    np.testing.assert_allclose(leaves_of(state.leaf_norms)[k], units[k], rtol=3e-6)
  factors = np_factor(units["w_in"], limit)
  assert 0 < factors.min() < factors.max() == 1, "some experts clipped, not all"
  np.testing.assert_allclose(state.norm, max(u.max() for u in units.values()), rtol=3e-6)
  # The global clip (the router masked out) keeps per-expert norms of the rest.
  rest = [x for k, x in named.items() if k != "router"]
  norm = np_norm(rest, ord)
  for name in [name for name in ("global", "zclip", "skip") if name in got]:
    stats = got[name][1] if name != "skip" else got[name][1].stats
    np.testing.assert_allclose(stats.norm, norm, rtol=3e-6, err_msg=name)
    norms = stats.leaf_norms
    assert norms["router"] == optax.MaskedNode(), name
    np.testing.assert_allclose(norms["moe"]["w_out"], units["w_out"], rtol=3e-6)
    np.testing.assert_allclose(stats.stack_norms["moe"]["w_in"],
                               np_norm([host["moe"]["w_in"]], ord), rtol=3e-6)
  np.testing.assert_allclose(got["global"][0]["moe"]["w_in"],
                             f64(host["moe"]["w_in"]) * np_factor(norm, 1.0), rtol=3e-6)


@pytest.mark.parametrize("stacked", [False, True], ids=["experts", "layers_x_experts"])
def test_stats_name_each_expert(stacked):
  host, got = expert_results(stacked, 2)
  stats = oc.stats(got["each"][1])
  w_in = np_units(host["moe"]["w_in"], kept_axes(stacked)["w_in"])
  if stacked:
    want = {f"clip/layer_norm/moe/w_in/{i}/{j}": w_in[i, j]
            for i in range(L) for j in range(E)}
  else:
    want = {f"clip/layer_norm/moe/w_in/{j}": w_in[j] for j in range(E)}
  for key, value in want.items():
    np.testing.assert_allclose(stats[key], value, rtol=3e-6, err_msg=key)
  np.testing.assert_allclose(stats["clip/leaf_norm/moe/w_in"],
                             np_norm([host["moe"]["w_in"]]), rtol=3e-6)
  per_expert = [k for k in stats if k.startswith("clip/layer_norm/moe/w_in/")]
  assert len(per_expert) == len(want)  # one entry per (layer's) expert, no more
  if stacked:  # the masked router keeps no leaf norm
    skip_stats = oc.stats(got["skip"][1])
    assert "skip/leaf_norm/dense" in skip_stats
    assert not any(k.startswith("skip/leaf_norm/router") for k in skip_stats)


# --------------------------------------------------------------------------
# The mask: a frozen router

def mask_transforms() -> dict:
  """Each clipper with ``mask=`` and as ``optax.masked`` (the same numbers)."""
  experts, _ = axes(False)
  made = {"global": lambda **kw: oc.clip_by_global_norm(1.0, **kw),
          "torch": lambda **kw: oc.clip_grad_norm(1.0, **kw),
          "each": lambda **kw: oc.clip_by_norm(2.0, expert_axis=experts, **kw),
          "zclip": lambda **kw: oc.zclip(max_grad_norm=1.0, **kw),
          "auto": lambda **kw: oc.auto_clip(50.0, **kw)}
  callable_mask = lambda tree: jax.tree.map(lambda _: True, tree) | {"router": False}  # noqa: E731
  txs = {}
  for name, make in made.items():
    txs[name] = make(mask=FROZEN)
    txs[name + "/optax.masked"] = optax.masked(make(), FROZEN)
  txs["global/callable"] = made["global"](mask=callable_mask)
  return txs


@functools.cache
def mask_results():
  host = moe_tree(False, seed=3)
  return host, jax.jit(functools.partial(step, mask_transforms()))(host)


def test_masked_leaves_are_out_of_the_norm_and_passed_through_bit_for_bit():
  host, got = mask_results()
  rest = [x for k, x in leaves_of(host).items() if k != "router"]
  norm = np_norm(rest)
  assert norm < 0.1 * np_norm([host["router"]])  # the router would dominate
  for name, (out, state) in got.items():
    assert out["router"].dtype == host["router"].dtype
    np.testing.assert_array_equal(out["router"], host["router"], err_msg=name)
    np.testing.assert_array_equal(out["step"], host["step"])
    state = getattr(state, "inner_state", state)
    if not name.startswith("each"):
      np.testing.assert_allclose(state.norm, norm, rtol=3e-6, err_msg=name)
  # The unmasked leaves clipped by the norm of the rest.
  np.testing.assert_allclose(got["global"][0]["dense"],
                             f64(host["dense"]) * np_factor(norm, 1.0), rtol=3e-6)
  np.testing.assert_allclose(got["torch"][0]["dense"],
                             f64(host["dense"]) * np_factor(norm, 1.0, 1e-6), rtol=3e-6)


def test_mask_and_optax_masked_give_the_same_numbers():
  _, got = mask_results()
  for name in ("global", "torch", "each", "zclip", "auto"):
    ours, theirs = got[name], got[name + "/optax.masked"]
    for a, b in zip(jax.tree.leaves(ours),
                    jax.tree.leaves((theirs[0], theirs[1].inner_state)), strict=True):
      np.testing.assert_array_equal(a, b, err_msg=name)
    assert oc.stats(ours[1]).keys() == oc.stats(theirs[1]).keys()
  for a, b in zip(jax.tree.leaves(got["global"]), jax.tree.leaves(got["global/callable"]),
                  strict=True):
    np.testing.assert_array_equal(a, b)


def test_masked_skip_step_judges_the_rest():
  # The router's spike alone does not skip the step: it is out of the norm.
  tree = moe_tree(False, seed=4)
  txs = {"masked": oc.skip_step(optax.sgd(1.0), max_norm=20.0, mask=FROZEN),
         "whole": oc.skip_step(optax.sgd(1.0), max_norm=20.0)}
  got = jax.jit(functools.partial(step, txs))(tree)
  for name, skipped in (("masked", False), ("whole", True)):
    out, state = got[name]
    assert bool(state.stats.skipped_by_norm) is skipped, name
    assert bool((np.asarray(out["dense"]) == 0).all()) is skipped, name


@pytest.mark.parametrize("build", [
    lambda **kw: oc.clip_by_global_norm(1.0, **kw),
    lambda **kw: oc.clip_by_norm(1.0, **kw),
    lambda **kw: oc.clip_grad_norm(1.0, **kw),
    lambda **kw: oc.zclip(**kw),
    lambda **kw: oc.auto_clip(**kw),
    lambda **kw: oc.skip_step(optax.sgd(1.0), **kw),
], ids=["global", "each", "torch", "zclip", "auto", "skip"])
def test_a_traced_or_non_bool_mask_is_refused(build):
  with pytest.raises(TypeError, match=r"\(mask=\.\.\.\)` must be static Python values"):
    build(mask={"w": jnp.array(True)})
  with pytest.raises(TypeError, match=r"mask=\.\.\.\)` must hold Python bools"):
    build(mask={"w": 1})
  tx = build(mask=lambda tree: {"w": jnp.array(True)})
  tree = {"w": jnp.ones(2)}
  with pytest.raises(TypeError, match="must be static"):
    tx.update(tree, tx.init(tree), tree)


def test_a_callable_mask_scheduled_by_inject_hyperparams_is_refused():
  tx = optax.inject_hyperparams(oc.clip_by_global_norm)(
      1.0, mask=lambda tree: {"w": False})
  with pytest.raises(TypeError, match=r"static_args=\('mask',\)"):
    tx.init({"w": jnp.ones(2)})
  tx = optax.inject_hyperparams(oc.clip_by_global_norm, static_args=("mask",))(
      1.0, mask=lambda tree: {"w": False, "b": True})
  out, _ = jax.jit(tx.update)({"w": jnp.full(2, 9.0), "b": jnp.full(2, 3.0)},
                              tx.init({"w": jnp.ones(2), "b": jnp.ones(2)}))
  np.testing.assert_array_equal(out["w"], 9.0)
  np.testing.assert_allclose(out["b"], 1 / math.sqrt(2), rtol=1e-6)


def test_bad_expert_axes():
  tree = {"w": jnp.ones((2, 3, 4))}
  with pytest.raises(ValueError, match=r"expert_axis=5\)` is out of range for leaf \['w'\]"):
    oc.clip_by_norm(1.0, expert_axis=5).update(tree, None)
  with pytest.raises(ValueError, match="expert_axis and layer_axis both 0"):
    oc.clip_by_global_norm(1.0, leaf_norms=True, expert_axis=0, layer_axis=0).init(tree)
  with pytest.raises(TypeError, match=r"expert_axis=\.\.\.\)` must hold ints \(the axis "
                                      r"that stacks experts\)"):
    oc.clip_by_norm(1.0, expert_axis="experts")
  with pytest.raises(TypeError, match=r"expert_axis=\.\.\.\)` must be static .*static_args"):
    oc.zclip(leaf_norms=True, expert_axis={"w": jnp.int32(1)})


# --------------------------------------------------------------------------
# Sharded experts on a 2 x 4 mesh: experts split over "expert"; w_out's
# hidden axis over "data" too; the router replicated; the dense leaf split
# over "data" (its layers whole).

AXES = ("data", "expert")
SPECS = {"router": P(), "moe": {"w_in": P(None, "expert"),
                                "w_out": P(None, "expert", "data")},
         "dense": P(None, "data"), "step": P()}


def state_specs(state):
  """out_specs of a state: per-expert norms split along "expert"."""
  def spec(path, x):
    names = jax.tree_util.keystr(path)
    split = "leaf_norms" in names and "moe" in names
    return P(None, "expert") if split else P()
  return jax.tree_util.tree_map_with_path(spec, state)


def test_shard_map_sharded_experts_equal_the_unsharded():
  host, want = expert_results(True, 2)
  txs = expert_transforms(True, axis_name=AXES, specs=SPECS)
  mesh = make_mesh((2, 4), AXES)
  out_specs = {name: (SPECS, state_specs(want[name][1])) for name in txs}
  f = jax.jit(shard_map(functools.partial(step, txs), mesh=mesh,
                        in_specs=(SPECS,), out_specs=out_specs))
  got = f(shard(host, mesh, SPECS))
  for name in txs:
    jax.tree.map(lambda g, w, name=name: np.testing.assert_allclose(
        np.asarray(g), np.asarray(w), rtol=3e-6, err_msg=name), got[name], want[name])


@pytest.mark.parametrize("name", ["global", "each"])
def test_sharded_experts_take_one_all_reduce(name):
  # Each device writes its experts' partial sums at their place among all
  # devices' experts: one psum gives the global norm and every expert's.
  tx = expert_transforms(True, axis_name=AXES, specs=SPECS)[name]
  mesh = make_mesh((2, 4), AXES)
  tree = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      np.shape(x), x.dtype, sharding=NamedSharding(mesh, s)), moe_tree(True), SPECS)
  f = shard_map(lambda t: tx.update(t, tx.init(t))[1].norm, mesh=mesh,
                in_specs=(SPECS,), out_specs=P(), check_vma=False)
  main, _ = hlo_ops(jax.jit(f).lower(tree).compile().as_text(), "all-reduce")
  assert main == 1


def test_sharded_jit_experts_equal_the_unsharded():
  host, want = expert_results(True, 2)
  txs = expert_transforms(True)
  tree = shard(host, make_mesh((2, 4), AXES), SPECS)
  got = jax.jit(functools.partial(step, txs))(tree)
  for name in txs:
    jax.tree.map(lambda g, w, name=name: np.testing.assert_allclose(
        np.asarray(g), np.asarray(w), rtol=3e-6, err_msg=name), got[name], want[name])
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(got[name][0])):
      assert y.sharding.is_equivalent_to(x.sharding, x.ndim), name
