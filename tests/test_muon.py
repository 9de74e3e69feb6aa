"""Muon-safe clipping (docs/muon.md): the recipes, ``scale_only`` and the
stall guard (``min_scale``, ``floor_count``, ``check_stall``).

References from the definitions: a global norm is ``sqrt(sum x^2)`` over the
leaves it measures, the factor ``max_norm / norm`` above ``max_norm`` (1
below); optax.contrib.muon sends a leaf to Newton-Schulz when it is 2-D
(its default ``param_labels``), to AdamW otherwise.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import muon

import optaxclip as oc

F = oc.functional
MAX_NORM = 0.5
GRADS = {"w1": jnp.arange(12.0).reshape(3, 4) / 7, "b1": jnp.array([3.0, -4.0, 1.0, 2.0]),
         "w2": -jnp.arange(8.0).reshape(4, 2) / 3, "gain": jnp.array(1.5)}
MUON_LEAVES = ("w1", "w2")
SCALE_ONLY = {"w1": False, "b1": True, "w2": False, "gain": True}  # the tree prefix form


def adam_mask(tree):
  return jax.tree.map(lambda x: x.ndim != 2, tree)


def labels(tree):
  return jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", tree)


def np_norm(tree, keys):
  return math.sqrt(sum(float(np.sum(np.asarray(tree[k], np.float64) ** 2)) for k in keys))


def np_factor(norm, max_norm, eps=0.0):
  return 1.0 if norm + eps <= max_norm else max_norm / (norm + eps)


def assert_same_bits(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def _recipes():
  return {
      "masked": optax.masked(oc.clip_by_global_norm(MAX_NORM), adam_mask),
      "groups": oc.clip_by_global_norm({"adam": MAX_NORM, "muon": math.inf}, groups=labels),
      "scale_only": oc.clip_by_global_norm(MAX_NORM, scale_only=adam_mask),
      "scale_only_prefix": oc.clip_by_global_norm(MAX_NORM, scale_only=SCALE_ONLY),
      "scale_only_torch": oc.clip_grad_norm(MAX_NORM, scale_only=SCALE_ONLY),
  }


RECIPES = _recipes()


@jax.jit
def _apply_recipes(grads):
  out = {}
  for name, tx in RECIPES.items():
    updates, state = tx.update(grads, tx.init(grads), grads)
    out[name] = (updates, oc.stats(state))
  return out


RESULTS = _apply_recipes(GRADS)  # one compiled program for every recipe


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_against_numpy(name):
  updates, stats = RESULTS[name]
  adam = [k for k in GRADS if k not in MUON_LEAVES]
  measured = adam if name in ("masked", "groups") else list(GRADS)
  norm = np_norm(GRADS, measured)
  factor = np_factor(norm, MAX_NORM, 1e-6 if name == "scale_only_torch" else 0.0)
  assert factor < 0.2  # the case clips
  prefix = "clip/adam/" if name == "groups" else "clip/"
  np.testing.assert_allclose(stats[prefix + "norm"], norm, rtol=1e-6)
  np.testing.assert_allclose(stats[prefix + "scale"], factor, rtol=1e-6)
  for key in adam:
    np.testing.assert_allclose(updates[key], np.asarray(GRADS[key]) * factor, rtol=1e-6)
  for key in MUON_LEAVES:  # Newton-Schulz renormalises them: untouched, bit for bit
    assert_same_bits(updates[key], GRADS[key])
  if name == "groups":  # and their norm is logged beside
    np.testing.assert_allclose(stats["clip/muon/norm"], np_norm(GRADS, MUON_LEAVES), rtol=1e-6)
    assert stats["clip/muon/scale"] == 1


def test_labels_are_the_ones_optax_muon_uses():
  """The recipe's mask sends to the clip exactly the leaves optax's muon
  gives to AdamW (its MuonState holds the others, MaskedNode here)."""
  state = muon(1e-2).init(GRADS)
  muon_state = state.inner_states["muon"].inner_state[0]
  adam_state = state.inner_states["adam"].inner_state[0]
  is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  on_muon = jax.tree.map(lambda x: not is_masked(x), muon_state.mu, is_leaf=is_masked)
  on_adam = jax.tree.map(lambda x: not is_masked(x), adam_state.mu, is_leaf=is_masked)
  assert on_adam == adam_mask(GRADS)
  assert on_muon == jax.tree.map(lambda x: not x, adam_mask(GRADS))
  assert labels(GRADS) == {k: "adam" if v else "muon" for k, v in on_adam.items()}


def test_scale_only_forms_agree_and_bad_ones_are_refused():
  for key in GRADS:  # a callable and the tree it returns: the same bits
    assert_same_bits(RESULTS["scale_only_prefix"][0][key], RESULTS["scale_only"][0][key])
  with pytest.raises(TypeError, match=r"clip_by_global_norm\(scale_only=...\).*bools"):
    oc.clip_by_global_norm(1.0, scale_only={"w": "yes"})
  with pytest.raises(TypeError, match=r"scale_only=...\).*static"):
    oc.clip_grad_norm(1.0, scale_only={"w": jnp.array(True)})
  with pytest.raises(ValueError, match=r"scale_only=...\).*does not match"):
    oc.clip_by_global_norm(1.0, scale_only={"w": True}).init(GRADS)
  with pytest.raises(ValueError, match=r"groups=.*scale_only="):
    oc.clip_by_global_norm(1.0, groups=labels, scale_only=adam_mask)


def test_scale_only_refused_as_a_schedule_and_traced():
  params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
  injected = optax.inject_hyperparams(oc.clip_by_global_norm)(max_norm=1.0, scale_only=adam_mask)
  with pytest.raises(TypeError, match=r"scale_only.*static_args"):
    injected.init(params)
  static = optax.inject_hyperparams(oc.clip_by_global_norm, static_args=("scale_only",))(
      max_norm=1.0, scale_only=adam_mask)
  updates, _ = jax.jit(static.update)(params, static.init(params))
  assert_same_bits(updates["w"], params["w"])

  def traced(flag):  # a mask computed under jit holds tracers: refused
    tx = oc.clip_by_global_norm(1.0, scale_only={"w": flag, "b": True})
    return tx.update(params, tx.init(params))[0]

  with pytest.raises(TypeError, match=r"scale_only=...\).*static"):
    jax.jit(traced)(jnp.array(True))


# --------------------------------------------------------------------------
# The stall guard: min_scale and floor_count over a sequence of steps

NORMS = [0.5, 3.0, 5e4, 0.0, math.nan, 2e5, math.inf, 8.0, 1e6]


@jax.jit
def _run_sequence(norms):
  """Every builder with a ClipState over the same steps (one program)."""
  builders = {"default": oc.clip_by_global_norm(1.0),
              "floor": oc.clip_by_global_norm(1.0, floor=1e-2),
              "none": oc.clip_by_global_norm(1.0, floor=None),
              "per_leaf": oc.clip_by_norm(1.0, floor=1e-2),
              "torch": oc.clip_grad_norm(1.0, floor=1e-2),
              "groups": oc.clip_by_global_norm(1.0, groups=lambda t: {"a": "x"}, floor=1e-2)}
  out = {}
  for name, tx in builders.items():
    state = tx.init({"a": jnp.zeros(2)})

    def step(state, norm, tx=tx):
      _, state = tx.update({"a": jnp.array([0.6, 0.8]) * norm}, state)
      return state, None

    state, _ = jax.lax.scan(step, state, norms)
    out[name] = oc.stats(state)
  return out


SEQUENCE = _run_sequence(jnp.array(NORMS, jnp.float32))


@pytest.mark.parametrize("name,floor", [("default", 1e-4), ("floor", 1e-2), ("per_leaf", 1e-2),
                                        ("torch", 1e-2), ("groups", 1e-2), ("none", None)])
def test_stall_counters_against_a_reference(name, floor):
  eps = 1e-6 if name == "torch" else 0.0
  finite = [float(np.float32(n)) for n in NORMS if math.isfinite(n)]
  factors = [np.float32(np_factor(n, 1.0, eps)) for n in finite]
  stats = SEQUENCE[name]
  prefix = "clip/x/" if name == "groups" else "clip/"
  np.testing.assert_allclose(stats[prefix + "min_scale"], min(factors), rtol=1e-6)
  assert stats[prefix + "min_scale"].dtype == jnp.float32
  assert stats[prefix + "nonfinite_count"] == 2
  if floor is None:
    assert prefix + "floor_count" not in stats
  else:
    assert stats[prefix + "floor_count"].dtype == jnp.int32
    assert stats[prefix + "floor_count"] == sum(f < floor for f in factors)


def test_fresh_state_and_bad_floors():
  state = oc.clip_by_global_norm(1.0).init(jax.ShapeDtypeStruct((3,), jnp.bfloat16))
  assert state.min_scale == 1 and state.min_scale.dtype == jnp.float32
  assert not state.min_scale.weak_type and state.floor_count.dtype == jnp.int32
  for bad in (-1.0, 2.0, math.nan):
    with pytest.raises(ValueError, match=r"clip_by_global_norm\(floor=...\)` must be a number"):
      oc.clip_by_global_norm(1.0, floor=bad)
  with pytest.raises(ValueError, match=r"clip_by_norm\(floor=...\)"):
    oc.clip_by_norm(1.0, floor=-1)
  with pytest.raises(TypeError, match=r"clip_grad_norm\(floor=...\)"):
    oc.clip_grad_norm(1.0, floor="low")


def test_the_default_program_adds_only_scalar_work():
  """The guard is two scalars: the default program reads and writes no more
  than one without it, apart from a few scalar bytes (XLA cost analysis)."""
  grads = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}

  def cost(tx):
    update = jax.jit(lambda g, s: tx.update(g, s))
    analysis = update.lower(grads, tx.init(grads)).compile().cost_analysis()
    return analysis["bytes accessed"], analysis["flops"]

  (bytes_on, flops_on), (bytes_off, flops_off) = (cost(oc.clip_by_global_norm(1.0)),
                                                  cost(oc.clip_by_global_norm(1.0, floor=None)))
  assert 0 <= bytes_on - bytes_off <= 64 and 0 <= flops_on - flops_off <= 8


def test_check_stall_warns_over_its_threshold():
  stats = {**SEQUENCE["floor"], **{f"b/{k}": v for k, v in SEQUENCE["groups"].items()}}
  with pytest.warns(oc.ClipStallWarning, match=r"clip(/x)?: .* on 3 of 9 steps .* "
                    r"max_floor_steps=2.*docs/muon.md") as caught:
    found = oc.check_stall(stats, max_floor_steps=2)
  assert found == {"clip": 3, "b/clip/x": 3} and len(caught) == 2
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert oc.check_stall(stats, max_floor_steps=3) == {}
    assert oc.check_stall(SEQUENCE["none"]) == {}  # nothing counted, nothing to say
  with pytest.raises(ValueError, match=r"check_stall\(max_floor_steps=...\)"):
    oc.check_stall(stats, max_floor_steps=-1)
  with pytest.raises(TypeError, match=r"check_stall\(max_floor_steps=...\)"):
    oc.check_stall(stats, max_floor_steps=1.5)


# --------------------------------------------------------------------------
# End to end with optax.contrib.muon, against the recipe written by hand


def _loss(params, x, y):
  hidden = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((hidden @ params["w2"] + params["gain"] - y) ** 2) + 1e6 * params["gain"] ** 2


def _by_hand(grads, measure_all):
  """The Adam leaves scaled by the factor of their norm (or of every leaf's)."""
  adam = {k: v for k, v in grads.items() if k not in MUON_LEAVES}
  norm = F.global_norm(grads if measure_all else adam)
  clipped, _ = F.clip_by_global_norm(adam, MAX_NORM, use_norm=norm)
  return {**grads, **clipped}


@jax.jit
def _train(params, x, y):
  """Three steps of the masked recipe before muon, and of muon fed by hand
  (scale_only's numbers are the recipes' test above: the same program
  otherwise, and each Newton-Schulz chain costs seconds to compile)."""
  opt = muon(1e-2)
  tx = optax.chain(RECIPES["masked"], opt)

  def step(carry, _):
    p, s, hand_p, hand_s = carry
    updates, s = tx.update(jax.grad(_loss)(p, x, y), s, p)
    hand_grads = _by_hand(jax.grad(_loss)(hand_p, x, y), measure_all=False)
    hand_updates, hand_s = opt.update(hand_grads, hand_s, hand_p)
    return (optax.apply_updates(p, updates), s,
            optax.apply_updates(hand_p, hand_updates), hand_s), None

  start = (params, tx.init(params), params, opt.init(params))
  (p, s, hand_p, _), _ = jax.lax.scan(step, start, length=3)
  return p, hand_p, oc.stats(s)


def test_end_to_end_with_optax_muon_matches_the_recipe_by_hand():
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(keys[0], (3, 4)), "b1": jnp.zeros(4),
            "w2": jax.random.normal(keys[1], (4, 1)), "gain": jnp.array(0.1)}
  x, y = jax.random.normal(keys[2], (8, 3)), jax.random.normal(keys[3], (8, 1))
  p, hand_p, stats = _train(params, x, y)
  for key in params:
    assert np.all(np.isfinite(p[key])), key
    assert_same_bits(p[key], hand_p[key])
  assert stats["clip/count"] == 3 and stats["clip/clipped_count"] == 3
