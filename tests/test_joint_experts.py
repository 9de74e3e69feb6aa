"""One expert clipped by the norm of all its tensors:
``clip_by_norm(joint_experts=True)``.

Expert ``e`` (of layer ``l``) owns a slice of every leaf with an expert
axis (``router[l, :, e]``, ``w_in[l, e]``, ``w_out[e, l]``); its joint
norm is the ``ord``-norm of all those entries together, and each of its
slices is scaled by ``min(1, max_norm / (norm + eps))``. Checked against
float64 numpy written from that definition, against torchtitan's
expert-parallel arithmetic (``_clip_grad_norm_with_ep``: the EP norm and the
non-EP norm combined into the total), eager, jitted and under
``shard_map`` on the 8 host devices (one all-reduce), in bfloat16, with
zero and empty experts, a mask and non-finite gradients.
"""

import functools
import math
import sys
from pathlib import Path

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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/_cost.py
  sys.path.insert(0, str(ROOT))

L, E, D, H = 2, 4, 4, 2  # layers, experts, model and expert hidden widths


def moe_tree(stacked: bool = True, seed: int = 0, dtype=np.float32) -> dict:
  """A router (row ``e`` of its expert axis: expert ``e``'s gate), experts'
  in and out kernels (``w_out`` stacks experts before layers: the units
  are transposed to ``[layers, experts]``), a dense leaf and an int step;
  the experts' scales spread so that some are clipped, not all."""
  rng = np.random.default_rng(seed)
  spread = np.linspace(0.5, 2.0, E)

  def leaf(shape, axis):
    x = rng.normal(size=shape)
    if axis is not None:
      x = x * np.expand_dims(spread, [a for a in range(len(shape)) if a != axis])
    return np.asarray(x, dtype)
  if stacked:
    return {"router": leaf((L, D, E), 2), "w_in": leaf((L, E, D, H), 1),
            "w_out": leaf((E, L, H, D), 0), "dense": leaf((L, D), None),
            "step": np.int32(7)}
  return {"router": leaf((D, E), 1), "w_in": leaf((E, D, H), 0),
          "w_out": leaf((E, H, D), 0), "dense": leaf((D, D), None),
          "step": np.int32(7)}


def axes(stacked: bool = True) -> tuple[dict, dict | None]:
  """``(expert_axis, layer_axis)`` of ``moe_tree(stacked)``."""
  if stacked:
    return ({"router": 2, "w_in": 1, "w_out": 0, "dense": None, "step": None},
            {"router": 0, "w_in": 0, "w_out": 1, "dense": 0, "step": None})
  return {"router": 1, "w_in": 0, "w_out": 0, "dense": None, "step": None}, None


def np_joint(tree: dict, stacked: bool = True, ord=2, leaves=None) -> np.ndarray:
  """Each expert's float64 ``ord``-norm over its slices of every leaf with
  an expert axis (of ``leaves``, default all): ``[layers, experts]`` or
  ``[experts]``, from the definition."""
  experts, layers = axes(stacked)
  names = [k for k in (leaves or experts) if experts[k] is not None]
  grid = (L, E) if stacked else (E,)
  out = np.zeros(grid)
  for index in np.ndindex(*grid):
    parts = []
    for k in names:
      x = f64(tree[k])
      if stacked:
        x = np.moveaxis(x, [layers[k], experts[k]], [0, 1])
      else:
        x = np.moveaxis(x, experts[k], 0)
      parts.append(x[index])
    out[index] = np_norm(parts, ord)
  return out


def np_scaled(tree: dict, factors: np.ndarray, name: str,
              stacked: bool = True) -> np.ndarray:
  """Leaf ``name`` with each expert's slice times its factor."""
  experts, layers = axes(stacked)
  x = f64(tree[name])
  if stacked:
    moved = np.moveaxis(x, [layers[name], experts[name]], [0, 1])
    extra = (1,) * (x.ndim - 2)
    return np.moveaxis(moved * factors.reshape(factors.shape + extra), [0, 1],
                       [layers[name], experts[name]])
  moved = np.moveaxis(x, experts[name], 0)
  return np.moveaxis(moved * factors.reshape((E,) + (1,) * (x.ndim - 1)), 0,
                     experts[name])


def limit(stacked: bool, ord) -> float:
  """Half of the experts above it: some clipped, not all."""
  return float(np.median(np_joint(moe_tree(stacked), stacked, ord)))


ORDS = [2, 1, 3, math.inf]
EPS = 1e-6


def joint(stacked: bool, ord=2, eps=0.0, **kw):
  experts, layers = axes(stacked)
  return oc.clip_by_norm(limit(stacked, ord), ord=ord, eps=eps, expert_axis=experts,
                         layer_axis=layers, joint_experts=True, **kw)


def step(txs, tree):
  return {name: tx.update(tree, tx.init(tree), tree) for name, tx in txs.items()}


def groups(stacked: bool) -> dict:
  """``groups=`` labels: the experts' leaves split along their expert axes,
  the dense leaf a plain group."""
  experts, _ = axes(stacked)
  return {k: "dense" if k == "dense" else oc.along("experts", experts[k])
          for k in ("router", "w_in", "w_out", "dense")} | {"step": "dense"}


def along_groups(stacked: bool, ord=2, **kw):
  return oc.clip_by_global_norm({"experts": limit(stacked, ord), "dense": 1.0}, ord=ord,
                                groups=groups(stacked), layer_axis=axes(stacked)[1], **kw)


def joint_transforms(stacked: bool) -> dict:
  txs = {f"ord={float(ord)}": joint(stacked, ord) for ord in ORDS}
  txs["eps"] = joint(stacked, 2, EPS)
  txs["along"] = along_groups(stacked)
  txs["along/ord=1"] = along_groups(stacked, 1)
  # torchtitan's split: the experts' weights are the EP parameters, the
  # router (replicated, as torchtitan's MoE.router.gate) is not.
  experts, layers = axes(stacked)
  for ord in (2, math.inf):
    txs[f"ep/ord={ord}"] = oc.clip_by_norm(
        limit(stacked, ord), ord=ord, expert_axis=experts | {"router": None},
        layer_axis=layers, joint_experts=True)
  return txs


@functools.cache
def joint_results(stacked: bool):
  """Every order (and the eps form) in one compiled step."""
  host = moe_tree(stacked)
  return host, jax.jit(functools.partial(step, joint_transforms(stacked)))(host)


# --------------------------------------------------------------------------
# Against the definition

@pytest.mark.parametrize("stacked", [True, False], ids=["layers_x_experts", "experts"])
@pytest.mark.parametrize("name", [f"ord={float(ord)}" for ord in ORDS] + ["eps"])
def test_joint_norms_and_clipping_match_numpy(stacked, name):
  host, got = joint_results(stacked)
  ord = 2 if name == "eps" else float(name[4:])
  eps = EPS if name == "eps" else 0.0
  out, state = got[name]
  norms = np_joint(host, stacked, ord)
  np.testing.assert_allclose(state.expert_norms, norms, rtol=3e-6)
  factors = np_factor(norms, limit(stacked, ord), eps)
  assert 0 < factors.min() < factors.max() == 1, "some experts clipped, not all"
  for k in ("router", "w_in", "w_out"):
    np.testing.assert_allclose(out[k], np_scaled(host, factors, k, stacked),
                               rtol=3e-6, err_msg=k)
  # A leaf without an expert axis is clipped on its own, per layer.
  dense = f64(host["dense"])
  own = (np.array([np_norm([row], ord) for row in dense]) if stacked
         else np.array(np_norm([dense], ord)))
  want = dense * (np_factor(own, limit(stacked, ord), eps)[:, None] if stacked
                  else np_factor(own, limit(stacked, ord), eps))
  np.testing.assert_allclose(out["dense"], want, rtol=3e-6)
  np.testing.assert_array_equal(out["step"], host["step"])
  np.testing.assert_allclose(state.norm, max(norms.max(), own.max()), rtol=3e-6)
  np.testing.assert_allclose(state.scale, factors.min(), rtol=3e-6)
  assert int(state.clipped_count) == 1


def test_eager_and_functional_equal_the_jitted():
  host, got = joint_results(True)
  tx = joint(True)
  eager = tx.update(host, tx.init(host))
  experts, layers = axes(True)
  functional = oc.functional.clip_by_norm(
      host, limit(True, 2), expert_axis=experts, layer_axis=layers,
      joint_experts=True)
  for out in (eager[0], functional):
    for k in ("router", "w_in", "w_out", "dense"):
      np.testing.assert_allclose(out[k], got["ord=2.0"][0][k], rtol=1e-6, err_msg=k)
  np.testing.assert_allclose(eager[1].expert_norms, got["ord=2.0"][1].expert_norms,
                             rtol=1e-6)


def test_stats_name_each_layer_and_expert():
  host, got = joint_results(True)
  stats = oc.stats(got["ord=2.0"][1])
  keys = [k for k in stats if k.startswith("clip/expert_norm/")]
  assert sorted(keys) == sorted(f"clip/expert_norm/{i}/{j}"
                                for i in range(L) for j in range(E))
  norms = np_joint(host)
  np.testing.assert_allclose(stats["clip/expert_norm/1/2"], norms[1, 2], rtol=3e-6)
  flat = oc.stats(joint_results(False)[1]["ord=2.0"][1])
  assert sorted(k for k in flat if "expert_norm" in k) == [
      f"clip/expert_norm/{j}" for j in range(E)]
  assert "clip/expert_norm" not in str(list(oc.stats(
      oc.clip_by_norm(1.0).init({"w": jnp.ones(2)}))))


def test_state_shapes_are_fixed_at_init():
  host, got = joint_results(True)
  tx = joint(True)
  specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                       host)
  fresh = tx.init(specs)
  assert fresh.expert_norms.shape == (L, E) and fresh.expert_norms.dtype == jnp.float32
  for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(got["ord=2.0"][1]), strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("ord", [2, math.inf])
def test_torchtitan_expert_parallel_arithmetic(ord):
  # torchtitan's _clip_grad_norm_with_ep (torchtitan/distributed/utils.py):
  # the EP parameters' total norm and the others' (each torch's
  # get_total_norm: the norm of the per-tensor norms), combined as
  # (a^p + b^p)^(1/p) (max for inf) into the one norm it clips all by. The
  # experts' joint norms partition the EP norm exactly; the other leaves'
  # own norms (the router's and the dense leaf's, per layer) the rest.
  host, got = joint_results(True)
  state = got[f"ep/ord={ord}"][1]

  def total_norm(names):  # torch.nn.utils.get_total_norm, in float64
    return np_norm([np.array([np_norm([host[k]], ord) for k in names])], ord)
  ep_norm, non_ep_norm = total_norm(["w_in", "w_out"]), total_norm(["router", "dense"])
  np.testing.assert_allclose(state.expert_norms, np_joint(host, ord=ord, leaves=["w_in",
                             "w_out"]), rtol=3e-6)
  np.testing.assert_allclose(np_norm([state.expert_norms], ord), ep_norm, rtol=3e-6)
  total = (max(ep_norm, non_ep_norm) if ord == math.inf
           else (ep_norm ** ord + non_ep_norm ** ord) ** (1 / ord))
  np.testing.assert_allclose(oc.functional.global_norm(host, ord), total, rtol=3e-6)
  # torchtitan then scales every gradient by min(1, c / (total + 1e-6));
  # clip_grad_norm gives that factor from the same norm.
  c = 0.5 * total
  out, _ = jax.jit(oc.clip_grad_norm(c, ord).update)(host, None)
  np.testing.assert_allclose(out["w_in"], f64(host["w_in"]) * c / (total + 1e-6), rtol=3e-6)


# --------------------------------------------------------------------------
# groups= with along(label, axis): the same experts, the other leaves a group

@pytest.mark.parametrize("stacked", [True, False], ids=["layers_x_experts", "experts"])
@pytest.mark.parametrize("ord", [2, 1])
def test_along_groups_match_numpy_and_joint_experts(stacked, ord):
  host, got = joint_results(stacked)
  out, state = got["along" if ord == 2 else "along/ord=1"]
  norms = np_joint(host, stacked, ord)
  experts = state.groups["experts"]
  np.testing.assert_allclose(experts.expert_norms, norms, rtol=3e-6)
  factors = np_factor(norms, limit(stacked, ord))
  for k in ("router", "w_in", "w_out"):
    np.testing.assert_allclose(out[k], np_scaled(host, factors, k, stacked), rtol=3e-6)
    if ord == 2:  # the same numbers as clip_by_norm(joint_experts=True)
      np.testing.assert_array_equal(out[k], got["ord=2.0"][0][k])
  np.testing.assert_allclose(experts.norm, norms.max(), rtol=3e-6)
  np.testing.assert_allclose(experts.scale, factors.min(), rtol=3e-6)
  # A plain group is clipped whole (not per layer) by its own norm.
  dense = np_norm([host["dense"]], ord)
  np.testing.assert_allclose(state.groups["dense"].norm, dense, rtol=3e-6)
  np.testing.assert_allclose(out["dense"], f64(host["dense"]) * np_factor(dense, 1.0),
                             rtol=3e-6)
  assert state.groups["dense"].expert_norms is None
  stats = oc.stats(state)
  index = "1/2" if stacked else "2"
  np.testing.assert_allclose(stats[f"clip/experts/expert_norm/{index}"],
                             norms[(1, 2) if stacked else 2], rtol=3e-6)
  assert len([k for k in stats if "/expert_norm/" in k]) == norms.size


def test_along_groups_keep_leaf_norms_and_zero_one_group():
  host = moe_tree(True)
  tx = along_groups(True, leaf_norms=True)
  _, state = jax.jit(tx.update)(host, tx.init(host))
  stats = oc.stats(state)
  w_in = np.sqrt((f64(host["w_in"]) ** 2).sum(axis=(2, 3)))  # [layers, experts]
  np.testing.assert_allclose(stats["clip/layer_norm/w_in/1/2"], w_in[1, 2], rtol=3e-6)
  bad = moe_tree(True)
  bad["w_in"][0, 3, 0, 0] = np.inf
  out, state = jax.jit(along_groups(True, nonfinite="zero").update)(bad, None)
  assert int(state.groups["experts"].nonfinite_count) == 1
  assert int(state.groups["dense"].nonfinite_count) == 0
  assert all((np.asarray(out[k]) == 0).all() for k in ("router", "w_in", "w_out"))
  np.testing.assert_allclose(out["dense"], f64(bad["dense"]) * np_factor(
      np_norm([bad["dense"]]), 1.0), rtol=3e-6)


# --------------------------------------------------------------------------
# Dtypes, edge cases, the mask, non-finite gradients

def test_bfloat16_keeps_dtype_and_float32_norms():
  host = moe_tree(True, seed=1, dtype=jnp.bfloat16)
  out, state = jax.jit(lambda t: joint(True).update(t, None))(host)
  norms = np_joint(host)  # of the bfloat16 values as stored
  np.testing.assert_allclose(state.expert_norms, norms, rtol=3e-6)
  factors = np_factor(norms, limit(True, 2))
  for k in ("router", "w_in", "w_out"):
    assert out[k].dtype == jnp.bfloat16
    np.testing.assert_allclose(f64(out[k]), np_scaled(host, factors, k), rtol=2 ** -8)


def test_zero_and_empty_experts():
  experts, layers = axes(True)
  tree = moe_tree(True)
  tree["w_in"][:, 1] = 0.0
  tree["w_out"][1] = 0.0
  tree["router"][..., 1] = 0.0  # expert 1 has no gradient at all
  tx = oc.clip_by_norm(0.5, expert_axis=experts, layer_axis=layers, joint_experts=True)
  out, state = jax.jit(tx.update)(tree, tx.init(tree))
  np.testing.assert_array_equal(state.expert_norms[:, 1], 0.0)
  assert np.isfinite(out["w_in"]).all() and (np.asarray(out["w_in"])[:, 1] == 0).all()
  floats = {k: jnp.zeros_like(v) for k, v in tree.items() if k != "step"}
  grads = jax.jit(jax.grad(lambda t: sum(jnp.sum(x) for x in jax.tree.leaves(
      oc.functional.clip_by_norm(t, 0.5, expert_axis=experts, layer_axis=layers,
                                 joint_experts=True)))))(floats | {"step": None})
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  # No experts at all (an empty expert axis), and experts of no entries.
  for shape in ((L, 0, D, H), (L, E, 0, H)):
    empty = {"w_in": jnp.zeros(shape), "dense": jnp.ones((L, D))}
    axis = {"w_in": 1, "dense": None}
    tx = oc.clip_by_norm(1.0, expert_axis=axis, layer_axis=0, joint_experts=True)
    out, state = jax.jit(tx.update)(empty, tx.init(empty))
    assert state.expert_norms.shape == shape[:2]
    np.testing.assert_array_equal(state.expert_norms, 0.0)
    np.testing.assert_allclose(out["dense"], 1 / math.sqrt(D), rtol=1e-6)


def test_masked_router_is_out_of_the_joint_norms():
  tree = moe_tree(True)
  tree["router"] = tree["router"] * 1000.0  # a frozen router's large gradients
  frozen = {"router": False, "w_in": True, "w_out": True, "dense": True, "step": True}
  got = jax.jit(functools.partial(step, {"joint": joint(True, mask=frozen),
                                         "along": along_groups(True, mask=frozen)}))(tree)
  norms = np_joint(tree, leaves=["w_in", "w_out"])
  for name, (out, state) in got.items():
    state = state.groups["experts"] if name == "along" else state
    np.testing.assert_allclose(state.expert_norms, norms, rtol=3e-6, err_msg=name)
    np.testing.assert_array_equal(out["router"], tree["router"])
    np.testing.assert_allclose(out["w_in"], np_scaled(
        tree, np_factor(norms, limit(True, 2)), "w_in"), rtol=3e-6, err_msg=name)


@pytest.mark.parametrize("mode", ["zero", "propagate"])
def test_a_nonfinite_expert(mode):
  tree = moe_tree(True)
  tree["w_out"][2, 1, 0, 0] = np.nan
  tx = joint(True, nonfinite=mode)
  out, state = jax.jit(tx.update)(tree, tx.init(tree))
  assert int(state.nonfinite_count) == 1 and int(state.count) == 1
  assert np.isnan(state.expert_norms[1, 2])
  assert np.isfinite(np.delete(np.asarray(state.expert_norms).ravel(), 1 * E + 2)).all()
  if mode == "zero":
    assert all((np.asarray(x) == 0).all() for k, x in out.items() if k != "step")
  else:  # NaN reaches that expert's slices only
    assert np.isnan(np.asarray(out["w_in"])[1, 2]).all()
    assert np.isfinite(np.asarray(out["w_in"])[0]).all()
  with pytest.raises(Exception, match=r"w_out"):
    jax.block_until_ready(joint(True, nonfinite="raise").update(tree, None))


BAD = [
    (dict(joint_experts=True), ValueError, r"clip_by_norm\(joint_experts=True\)` needs "
     r"`expert_axis=`"),
    (dict(joint_experts=1, expert_axis=0), TypeError, r"joint_experts=\.\.\.\)` must be a bool"),
    (dict(joint_experts=True, expert_axis={"a": 0, "b": 0}), ValueError,
     r"leaf \['a'\] of shape \(4, 3\) stacks 4 experts but leaf \['b'\] of shape "
     r"\(3, 2\) stacks 3"),
    (dict(joint_experts=True, expert_axis={"a": 0, "b": 0}, layer_axis={"a": 1, "b": None}),
     ValueError, r"leaf \['a'\] of shape \(4, 3\) stacks layers but leaf \['b'\] .* does not"),
    (dict(joint_experts=True, expert_axis={"a": 2, "b": 0}), ValueError,
     r"expert_axis=2\)` is out of range for leaf \['a'\] of shape \(4, 3\)"),
]


E3 = oc.along("e", 0)
BAD_GROUPS = [
    (dict(groups={"a": E3, "b": E3}), ValueError,
     r"clip_by_global_norm\(groups=\.\.\.\)`: leaf \['a'\] of shape \(4, 3\) stacks 4 "
     r"experts but leaf \['b'\] of shape \(3, 2\) stacks 3"),
    (dict(groups={"a": oc.along("e", 2), "b": "x"}), ValueError,
     r"clip_by_global_norm\(groups=\.\.\.\)`: along\('e', axis=2\) is out of range for "
     r"leaf \['a'\] of shape \(4, 3\)"),
    (dict(groups={"a": E3, "b": "e"}), ValueError, r"uses \['e'\] both as a plain label "
     r"and in along\(\)"),
    (dict(groups={"a": E3, "b": "x"}, expert_axis=0), ValueError,
     r"with along\(\) labels in `groups=`, leave `expert_axis` out"),
    (dict(groups={"a": E3, "b": 3}), TypeError, r"groups=\.\.\.\)` must hold strings "
     r"\(group labels\), got 3 of type int, or optaxclip.along\(\) labels"),
]


@pytest.mark.parametrize(("kw", "error", "match"), BAD_GROUPS,
                         ids=["experts", "range", "both", "expert_axis", "label"])
def test_bad_along_groups_name_the_argument(kw, error, match):
  tree = {"a": jnp.ones((4, 3)), "b": jnp.ones((3, 2))}
  with pytest.raises(error, match=match):
    oc.clip_by_global_norm(1.0, **kw).init(tree)
  with pytest.raises(TypeError, match=r"`along\(label=\.\.\.\)` must be a non-empty string"):
    oc.along("", 0)
  with pytest.raises(TypeError, match=r"`along\(axis=\.\.\.\)` must be an int .*got True"):
    oc.along("e", True)


@pytest.mark.parametrize(("kw", "error", "match"), BAD,
                         ids=["no_axis", "not_bool", "experts", "layers", "range"])
@pytest.mark.parametrize("form", ["transform", "functional"])
def test_bad_arguments_name_the_argument(kw, error, match, form):
  tree = {"a": jnp.ones((4, 3)), "b": jnp.ones((3, 2))}
  with pytest.raises(error, match=match):
    if form == "functional":
      oc.functional.clip_by_norm(tree, 1.0, **kw)
    else:
      oc.clip_by_norm(1.0, **kw).init(tree)


# --------------------------------------------------------------------------
# Sharded experts: experts split over "expert" (w_in's layers over "data",
# w_out's hidden axis over "data"), the router (with its expert axis)
# replicated. Each device's units arrive in blocks, device by device; the
# joint norms line them up expert by expert.

AXES = ("data", "expert")
SPECS = {"router": P(), "w_in": P("data", "expert"), "w_out": P("expert", None, "data"),
         "dense": P(None, "data"), "step": P()}


def test_shard_map_equals_the_unsharded():
  host, want = joint_results(True)
  txs = {"ord=2.0": joint(True, axis_name=AXES, specs=SPECS),
         "ord=1.0": joint(True, 1, axis_name=AXES, specs=SPECS),
         "along": along_groups(True, axis_name=AXES, specs=SPECS)}
  mesh = make_mesh((2, 4), AXES)
  out_specs = {name: (SPECS, jax.tree.map(lambda _: P(), want[name][1])) for name in txs}
  f = jax.jit(shard_map(functools.partial(step, txs), mesh=mesh, in_specs=(SPECS,),
                        out_specs=out_specs))
  got = f(shard(host, mesh, SPECS))
  for name in txs:
    jax.tree.map(lambda g, w, name=name: np.testing.assert_allclose(
        np.asarray(g), np.asarray(w), rtol=3e-6, err_msg=name), got[name], want[name])


@pytest.mark.parametrize("form", ["joint_experts", "along"])
def test_sharded_experts_take_one_all_reduce(form):
  tx = (joint if form == "joint_experts" else along_groups)(True, axis_name=AXES,
                                                            specs=SPECS)
  mesh = make_mesh((2, 4), AXES)
  tree = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      np.shape(x), np.asarray(x).dtype, sharding=NamedSharding(mesh, s)), moe_tree(True),
      SPECS)
  f = shard_map(lambda t: tx.update(t, tx.init(t)), mesh=mesh, in_specs=(SPECS,),
                out_specs=(SPECS, P()), check_vma=False)
  main, _ = hlo_ops(jax.jit(f).lower(tree).compile().as_text(), "all-reduce")
  assert main == 1


def test_joining_experts_adds_no_pass_over_the_gradients():
  # XLA's bytes accessed over the tree's bytes (benchmarks/_cost.py, as
  # tests/test_traffic.py): the joint norms are a norm of the per-expert
  # slice norms, so the per-expert clip and the joint one read as much, and
  # along() groups as much as plain groups that keep the same slice norms.
  from benchmarks import _cost

  tree = {"router": jax.ShapeDtypeStruct((2, 64, 8), jnp.float32),
          "w_in": jax.ShapeDtypeStruct((2, 8, 64, 32), jnp.float32),
          "w_out": jax.ShapeDtypeStruct((8, 2, 32, 64), jnp.float32),
          "dense": jax.ShapeDtypeStruct((2, 64), jnp.float32)}
  experts, layers = axes(True)
  experts, layers = ({k: v for k, v in a.items() if k != "step"} for a in (experts, layers))
  slices = _cost.alone(oc.clip_by_norm(1.0, expert_axis=experts, layer_axis=layers), tree)
  joined = _cost.alone(oc.clip_by_norm(1.0, expert_axis=experts, layer_axis=layers,
                                       joint_experts=True), tree)
  plain = {k: "e" if a is not None else "dense" for k, a in experts.items()}
  whole = _cost.alone(oc.clip_by_global_norm(  # the same per-expert partial sums
      1.0, groups=plain, leaf_norms=True, expert_axis=experts, layer_axis=layers), tree)
  split = _cost.alone(oc.clip_by_global_norm(1.0, layer_axis=layers, groups={
      k: oc.along("e", a) if a is not None else "dense" for k, a in experts.items()}), tree)
  # A pass is 1.0; joining adds ~0.005 (the rescue kernel) to ~0.03 (the
  # one-pass kernel forced on the CPU) of small vectors of norms.
  assert abs(joined - slices) < 0.1, (joined, slices)
  assert abs(split - whole) < 0.1, (split, whole)


def test_optax_chain_and_inject_hyperparams():
  experts, layers = axes(True)
  tx = optax.chain(optax.inject_hyperparams(oc.clip_by_norm, static_args=(
      "expert_axis", "layer_axis", "joint_experts"))(
      max_norm=1.0, expert_axis=experts, layer_axis=layers, joint_experts=True),
      optax.sgd(1.0))
  host = moe_tree(True)
  _, state = jax.jit(tx.update)(host, tx.init(host), host)
  np.testing.assert_allclose(oc.stats(state)["clip/expert_norm/0/3"], np_joint(host)[0, 3],
                             rtol=3e-6)
