"""Pipeline stages (MPMD): ``partial_norm`` per stage, ``combine_norms``, and
the clip of each stage by the combined norm (``use_norm`` / ``grad_norm``).

References are written from the definition, ``(sum |x|**p) ** (1/p)`` over
every leaf of every stage, in float64 numpy. Each stage runs as a ``jit``
program of its own (the MPMD situation); the combination must give the same
bits whatever the split into stages and the order the partials arrive in.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxclip as oc
from optaxclip._clip import stage_units

F = oc.functional
ORDS = [1.0, 2.0, 3.0, 0.5, math.inf]


def _tree() -> dict[str, jax.Array]:
  """Mixed shapes and dtypes, huge (1e20) and tiny (1e-25) leaves, small
  leaves of one shape that the one-program norm would group together (three
  kinds of leaf: each compiles its norm once per order)."""
  rng = np.random.default_rng(0)
  def leaf(shape, dtype, scale=1.0):
    return jnp.asarray(rng.normal(size=shape) * scale, dtype)
  return {"a": leaf((4, 5), jnp.float32), "b": leaf((4, 5), jnp.float32, 1e20),
          "c": leaf((6,), jnp.bfloat16), "d": leaf((4, 5), jnp.float32),
          "e": leaf((3,), jnp.float16), "f": leaf((4, 5), jnp.float32, 1e-25),
          "g": leaf((3,), jnp.float16), "h": leaf((6,), jnp.bfloat16, 1e20),
          "i": jnp.arange(3)}  # an integer leaf: left out


TREE = _tree()
KEYS = sorted(TREE)
# Leaves split into 2, 3 and 4 stages, in blocks and interleaved.
SPLITS = [["abcd", "efghi"], ["aei", "bf", "cdgh"], ["ah", "bg", "cfi", "de"]]
# Each stage a program of its own, as in a pipeline.
_stage = jax.jit(F.partial_norm, static_argnames="ord")


def _stages(split):
  return [{k: TREE[k] for k in keys} for keys in split]


def _reference(tree, p) -> float:
  leaves = [np.abs(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)]
  if p == math.inf:
    return max(float(x.max(initial=0)) for x in leaves)
  return sum(float(np.sum(x ** p)) for x in leaves) ** (1 / p)


def _bits(x) -> int:
  return int(np.asarray(x, np.float32).view(np.int32))


def _whole(p) -> jax.Array:
  return F.combine_norms([F.partial_norm(TREE, p)])


@pytest.mark.parametrize("ord", ORDS)
def test_every_split_and_arrival_order_gives_the_same_bits(ord):
  want = _whole(ord)
  for split in SPLITS:  # eager stages: each leaf's norm compiled once
    partials = [F.partial_norm(stage, ord) for stage in _stages(split)]
    for arrival in (partials, partials[::-1], partials[1:] + partials[:1]):
      assert _bits(F.combine_norms(arrival)) == _bits(want), (split, ord)
  ref = np.float32(_reference(TREE, ord))
  assert np.isfinite(want)
  ulps = 2 * max(1, 1 / ord)  # the root's 1/p scales relative errors
  assert abs(_bits(want) - _bits(ref)) <= ulps  # from float64
  assert abs(_bits(want) - _bits(F.global_norm(TREE, ord=ord))) <= ulps
  # Stages whose partial sums of powers overflow (torchtitan sums those)
  # or fall below float32's normal range: leaves of TREE's kinds, compiled.
  for scale in (3e19, 1e-39):
    stages = [{f"w{i}": jnp.full((4, 5), scale * (i + 1))} for i in range(3)]
    norm = F.combine_norms([F.partial_norm(s, ord) for s in stages[::-1]])
    if scale < 1 and ord == math.inf:
      assert norm == 0  # a max of subnormals reads as 0, as in global_norm
      continue
    assert _bits(norm) > 0 and np.isfinite(norm)  # a subnormal reads as 0
    assert abs(_bits(norm) - _bits(np.float32(_reference(stages, ord)))) <= ulps


@pytest.mark.parametrize("ord", ORDS)
def test_nan_and_inf_propagate(ord):
  partials = [F.partial_norm(stage, ord) for stage in _stages(SPLITS[0])]
  for bad, want in ((jnp.nan, np.nan), (-jnp.inf, np.inf)):
    stage = dict(_stages(SPLITS[0])[1], f=TREE["f"].at[1, 2].set(bad))
    got = F.combine_norms([partials[0], F.partial_norm(stage, ord)])
    np.testing.assert_equal(np.asarray(got), want)
  both = [F.partial_norm({"a": TREE["a"].at[0, 0].set(jnp.inf)}, ord),
          F.partial_norm({"b": TREE["b"].at[0, 0].set(jnp.nan)}, ord)]
  assert np.isnan(F.combine_norms(both))


@pytest.mark.parametrize("ord", [2.0])
def test_stages_as_jitted_programs(ord):
  partials = [_stage(stage, ord=ord) for stage in _stages(SPLITS[1])]
  assert _bits(F.combine_norms(partials[::-1])) == _bits(_whole(ord))
  combine = jax.jit(F.combine_norms)  # the combination in a program too
  assert _bits(combine(partials)) == _bits(_whole(ord))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=len(KEYS), max_size=len(KEYS)),
       st.permutations(range(4)), st.sampled_from([2.0, 0.5, math.inf]))
def test_any_split_any_order(labels, arrival, ord):
  split = [[k for k, label in zip(KEYS, labels) if label == s] for s in arrival]
  partials = [F.partial_norm({k: TREE[k] for k in keys}, ord)
              for keys in split]
  assert _bits(F.combine_norms(partials)) == _bits(_whole(ord))


def test_use_norm_clips_each_stage_as_the_whole_tree():
  norm = _whole(2.0)
  stages = _stages(SPLITS[1])
  clipped = {}
  for stage in stages:
    clipped.update(F.clip_by_global_norm(stage, 1.0, use_norm=norm)[0])
  whole, whole_norm = F.clip_by_global_norm(TREE, 1.0)
  exact, _ = F.clip_by_global_norm(TREE, 1.0, use_norm=norm)
  for k in KEYS:
    np.testing.assert_array_equal(clipped[k], exact[k])
    assert clipped[k].dtype == TREE[k].dtype
    np.testing.assert_allclose(np.asarray(clipped[k], np.float64),
                               np.asarray(whole[k], np.float64), rtol=1e-6)
  np.testing.assert_allclose(norm, whole_norm, rtol=1e-6)
  # The transform takes the combined norm as ``grad_norm``.
  tx = oc.clip_by_global_norm(1.0)
  updates, state = tx.update(stages[0], tx.init(stages[0]), grad_norm=norm)
  for k, x in updates.items():
    np.testing.assert_array_equal(x, exact[k])
  np.testing.assert_array_equal(state.norm, norm)


def test_partial_is_a_pytree_that_travels():
  partial = _stage({"w": TREE["a"], "b": TREE["c"]}, ord=2.0)
  assert jax.tree.leaves(partial) == [partial.norms]
  assert partial.paths == ("['b']", "['w']") and partial.ord == 2.0
  host = jax.device_get(partial)
  assert isinstance(host.norms, np.ndarray)
  other = F.partial_norm([TREE["d"]], prefix="head")
  assert other.paths == ("head[0]",)
  assert _bits(F.combine_norms([host, other])) == _bits(
      F.combine_norms([partial, other]))
  assert F.partial_norm({"i": jnp.arange(3)}).norms.shape == (0,)
  assert F.combine_norms([F.partial_norm({})]) == 0


def test_stage_split_over_devices_with_axis_name():
  # A stage that is itself data parallel: its leaves split over 8 devices,
  # one replicated (counted once).
  mesh = jax.make_mesh((8,), ("d",))
  stage = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(16, 3)),
                            jnp.float32), "b": jnp.arange(3.0)}
  specs = {"w": P("d"), "b": P()}
  placed = jax.device_put(stage, jax.tree.map(
      lambda spec: NamedSharding(mesh, spec), specs))
  measure = jax.jit(shard_map(
      lambda t: F.partial_norm(t, axis_name="d", specs=specs), mesh=mesh,
      in_specs=(specs,), out_specs=P()))
  sharded = measure(placed)
  other = F.partial_norm({"x": TREE["a"]})
  got = F.combine_norms([sharded, other])
  np.testing.assert_allclose(got, _reference([stage, TREE["a"]], 2.0),
                             rtol=1e-6)
  np.testing.assert_allclose(sharded.norms, F.partial_norm(stage).norms,
                             rtol=1e-6)


def test_bad_arguments():
  a, b = F.partial_norm([jnp.ones(2)]), F.partial_norm([jnp.ones(3)])
  with pytest.raises(ValueError, match=r"same path.*\[0\].*prefix"):
    F.combine_norms([a, b])
  with pytest.raises(ValueError, match="orders"):
    F.combine_norms([a, F.partial_norm([jnp.ones(2)], 1, prefix="x")])
  for bad in ([], None, [1.0], a):
    with pytest.raises(TypeError, match=r"combine_norms\(partials"):
      F.combine_norms(bad)
  with pytest.raises(ValueError, match=r"partial_norm\(ord"):
    F.partial_norm([jnp.ones(2)], 0)
  with pytest.raises(TypeError, match=r"partial_norm\(ord.*constant"):
    jax.jit(lambda p: F.partial_norm([jnp.ones(2)], p).norms)(2.0)
  with pytest.raises(TypeError, match=r"partial_norm\(prefix"):
    F.partial_norm([jnp.ones(2)], prefix=1)
  with pytest.raises(ValueError, match=r"partial_norm\(specs.*axis_name"):
    F.partial_norm([jnp.ones(2)], specs=P())


# Per-layer and per-expert norms across stages. A model with a scanned stack
# of 4 layers (two leaves stacked on axis 0, one of them a mixture of 3
# experts on axis 1), a mixture of experts outside the stack, and leaves
# that are whole; layer 2 of the stack is huge (its squares overflow
# float32), layer 1 tiny (its squares underflow).
N_LAYERS = 4
LAYER = {"stack_w": 0, "stack_moe": 0}
EXPERT = {"stack_moe": 1, "experts": 0}


def _model() -> dict[str, jax.Array]:
  rng = np.random.default_rng(2)
  def leaf(shape):
    return rng.normal(size=shape)
  w = leaf((N_LAYERS, 4, 5))
  w[2] *= 1e20
  w[1] *= 1e-25
  return {"embed": jnp.asarray(leaf((8, 4)), jnp.float32),
          "stack_w": jnp.asarray(w, jnp.float32),
          "stack_moe": jnp.asarray(leaf((N_LAYERS, 3, 4, 2)), jnp.bfloat16),
          "experts": jnp.asarray(leaf((3, 4, 2)), jnp.float16),
          "head": jnp.asarray(leaf((4, 6)), jnp.float32),
          "step": jnp.arange(2)}  # an integer leaf: left out


MODEL = _model()
WHOLE_KEYS = sorted(k for k in MODEL if k not in LAYER)


def _axes(table):
  """A layer_axis / expert_axis for any stage (a part of MODEL)."""
  return lambda tree: {k: table.get(k) for k in tree}


def _stage_partial(stage, ord, start):
  return F.partial_norm(stage, ord, layer_axis=_axes(LAYER),
                        expert_axis=_axes(EXPERT), layers=start)


def _split(cuts, labels):
  """Stages: the stack cut at ``cuts`` (stage i holds layers cuts[i] to
  cuts[i + 1]), each whole leaf in the stage ``labels`` gives it; with the
  global index of each stage's first layer."""
  stages = []
  for i in range(len(cuts) - 1):
    a, b = cuts[i], cuts[i + 1]
    stage = {k: MODEL[k][a:b] for k in LAYER if b > a}
    stage.update({k: MODEL[k] for k, s in zip(WHOLE_KEYS, labels) if s == i})
    stages.append((stage, a))
  return stages


def _partials(cuts, labels, ord):
  return [_stage_partial(stage, ord, a) for stage, a in _split(cuts, labels)]


_ONE_STAGE: dict[float, oc.functional.CombinedNorms] = {}


def _one_stage(ord) -> oc.functional.CombinedNorms:
  """The whole model as one stage, combined: what every split must give."""
  if ord not in _ONE_STAGE:
    _ONE_STAGE[ord] = F.combine_leaf_norms(
        _partials([0, N_LAYERS], [0] * len(WHOLE_KEYS), ord))
  return _ONE_STAGE[ord]


def _same_bits(got, want):
  for name in ("total",):
    assert _bits(getattr(got, name)) == _bits(getattr(want, name))
  assert got.leaves.keys() == want.leaves.keys()
  assert got.units.keys() == want.units.keys()
  for path in want.leaves:
    assert _bits(got.leaves[path]) == _bits(want.leaves[path]), path
  for path in want.units:
    np.testing.assert_array_equal(
        np.asarray(got.units[path], np.float32).view(np.int32),
        np.asarray(want.units[path], np.float32).view(np.int32), path)


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, N_LAYERS), min_size=n - 1, max_size=n - 1),
    st.lists(st.integers(0, n - 1), min_size=len(WHOLE_KEYS),
             max_size=len(WHOLE_KEYS)),
    st.permutations(range(n)))), st.sampled_from([2.0, math.inf]))
def test_layers_and_experts_any_split_any_order(split, ord):
  inner, labels, arrival = split
  cuts = [0, *sorted(inner), N_LAYERS]  # empty slices too: a stage of no layers
  partials = _partials(cuts, labels, ord)
  partials = [partials[i] for i in arrival]
  got = F.combine_leaf_norms(partials)
  _same_bits(got, _one_stage(ord))
  assert _bits(F.combine_norms(partials)) == _bits(got.total)


FULL_LAYER = {k: LAYER.get(k) for k in MODEL}
FULL_EXPERT = {k: EXPERT.get(k) for k in MODEL}
# Three stages: layers 0, layers 1-2 (the huge and the tiny), layer 3; the
# whole leaves spread over them.
CUTS, LABELS = [0, 1, 3, N_LAYERS], [0, 1, 2, 0]


def _ulps(a, b) -> int:
  a, b = (np.asarray(x, np.float32).view(np.int32).astype(np.int64)
          for x in (a, b))
  return int(np.max(np.abs(a - b), initial=0))


def _unit_reference(x, axes, p) -> np.ndarray:
  """Each unit's norm from the definition, in float64."""
  a = np.abs(np.asarray(x, np.float64))
  over = tuple(i for i in range(a.ndim) if i not in axes)
  return a.max(axis=over) if p == math.inf else (a ** p).sum(axis=over) ** (1 / p)


def _torchtitan_reference(stages, p, dtype=np.float64) -> float:
  """torchtitan's clip_grad_norm_ with a pp_mesh (and Megatron-LM's
  get_grad_norm_fp32 over its model-parallel group), from their definition:
  each stage's total norm; over the stages, the sum of their p-th powers
  (the all-reduce) to the power 1/p, or for inf the max of the maxima."""
  totals = []
  for stage in stages:
    leaves = [np.abs(np.asarray(x, np.float64)).astype(dtype)
              for x in jax.tree.leaves(stage) if jnp.issubdtype(x.dtype, jnp.floating)]
    if p == math.inf:
      totals.append(max(x.max(initial=0) for x in leaves))
    else:
      with np.errstate(over="ignore"):
        totals.append(dtype(sum(np.sum(x ** dtype(p)) for x in leaves)) ** dtype(1 / p))
  if p == math.inf:
    return max(totals)
  with np.errstate(over="ignore"):
    return sum(t ** dtype(p) for t in totals) ** dtype(1 / p)


@pytest.mark.parametrize("ord", [2.0, 0.5, math.inf])
def test_leaf_norms_against_the_whole_tree_and_the_references(ord):
  got = F.combine_leaf_norms(_partials(CUTS, LABELS, ord))
  tx = oc.clip_by_global_norm(1.0, ord=ord, leaf_norms=True,
                              layer_axis=FULL_LAYER, expert_axis=FULL_EXPERT)
  _, whole = tx.update(MODEL, tx.init(MODEL))
  # ulps: each within `exact` of the truth (float64 below), so within twice
  # that of each other (p = 0.5: +3.0 and -3.9 ulps, measured)
  exact = 2 * max(1, 1 / ord)
  close = 2 * exact
  assert np.isfinite(got.total)
  assert _ulps(got.total, whole.norm) <= close
  assert _ulps(got.total, F.global_norm(MODEL, ord=ord)) <= close
  stages = [stage for stage, _ in _split(CUTS, LABELS)]
  assert _ulps(got.total, _torchtitan_reference(stages, ord)) <= exact
  if ord >= 2 and ord != math.inf:  # the same sums in float32 overflow
    assert _torchtitan_reference(stages, ord, np.float32) == np.inf
  for key in MODEL:
    if key == "step":
      continue
    path = f"['{key}']"
    axes = tuple(sorted(a for a in (LAYER.get(key), EXPERT.get(key)) if a is not None))
    units = got.units[path] if axes else got.leaves[path]
    assert units.shape == tuple(MODEL[key].shape[a] for a in axes)
    assert _ulps(units, whole.leaf_norms[key]) <= close, key
    assert _ulps(units, np.float32(_unit_reference(MODEL[key], axes, ord))) <= exact
    if axes:  # a stacked leaf's whole norm
      assert _ulps(got.leaves[path], whole.stack_norms[key]) <= close
      assert _ulps(got.leaves[path], np.float32(
          _reference([MODEL[key]], ord))) <= exact
  assert set(got.units) == {"['stack_w']", "['stack_moe']", "['experts']"}


@pytest.mark.parametrize("ord", [2.0, 0.5, math.inf])
def test_nonfinite_layer_propagates_and_leaves_the_others(ord):
  clean = F.combine_leaf_norms(_partials(CUTS, LABELS, ord))
  for bad, want in ((jnp.nan, np.nan), (-jnp.inf, np.inf)):
    (first, a), *rest = _split(CUTS, LABELS)
    first = dict(first, stack_w=first["stack_w"].at[0, 1, 1].set(bad))
    partials = [_stage_partial(first, ord, a)] + [
        _stage_partial(stage, ord, start) for stage, start in rest]
    got = F.combine_leaf_norms(partials[::-1])
    w = got.units["['stack_w']"]
    np.testing.assert_equal(np.asarray(w[0]), want)
    assert _ulps(w[1:], clean.units["['stack_w']"][1:]) == 0  # not touched
    np.testing.assert_equal(np.asarray(got.leaves["['stack_w']"]), want)
    np.testing.assert_equal(np.asarray(got.total), want)
    assert _ulps(got.leaves["['head']"], clean.leaves["['head']"]) == 0
    np.testing.assert_equal(np.asarray(F.combine_norms(partials)), want)


def test_clip_stage_as_the_whole_model():
  split = _split(CUTS, LABELS)
  partials = [_stage_partial(stage, 2.0, a) for stage, a in split]
  combined = F.combine_leaf_norms(partials)
  whole = F.clip_by_global_norm(MODEL, 1.0, eps=1e-6)[0]
  per_unit = F.clip_by_norm(MODEL, 1.0, layer_axis=FULL_LAYER,
                            expert_axis=FULL_EXPERT)
  # torchtitan / Megatron: every gradient times min(1, max / (total + 1e-6)).
  coef = min(1.0, 1.0 / (_torchtitan_reference(
      [stage for stage, _ in split], 2.0) + 1e-6))
  for (stage, a), part in zip(split, partials):
    got = F.clip_stage(stage, 1.0, part, combined, eps=1e-6)
    same = F.clip_by_global_norm(stage, 1.0, eps=1e-6, use_norm=combined.total)[0]
    layered = F.clip_stage(stage, 1.0, part, per_layer=True)
    for key, x in got.items():
      np.testing.assert_array_equal(x, same[key])
      if key == "step":
        assert x is stage[key] and layered[key] is stage[key]
        continue
      assert x.dtype == stage[key].dtype and layered[key].dtype == x.dtype
      rows = slice(a, a + stage[key].shape[0]) if key in LAYER else slice(None)
      np.testing.assert_allclose(np.asarray(x, np.float64),
                                 np.asarray(whole[key][rows], np.float64), rtol=1e-6)
      want = jnp.asarray(np.asarray(stage[key], np.float64) * coef, x.dtype)
      np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(want, np.float64),
                                 rtol=max(float(jnp.finfo(x.dtype).eps), 1e-6))
      np.testing.assert_allclose(np.asarray(layered[key], np.float64),
                                 np.asarray(per_unit[key][rows], np.float64),
                                 rtol=1e-6)
  # In a program, the combined norms as an argument (the same bits).
  stage, part = split[1][0], partials[1]
  clip = jax.jit(F.clip_stage, static_argnames=("eps", "per_layer"))
  for key, x in clip(stage, 1.0, part, combined, eps=1e-6).items():
    np.testing.assert_array_equal(x, F.clip_stage(stage, 1.0, part, combined.total,
                                                  eps=1e-6)[key])


def test_stages_with_layers_as_jitted_programs():
  measure = jax.jit(F.partial_norm, static_argnames=(
      "ord", "layer_axis", "expert_axis", "layers"))
  layer_axis, expert_axis = _axes(LAYER), _axes(EXPERT)
  partials = [measure(stage, 2.0, layer_axis=layer_axis, expert_axis=expert_axis,
                      layers=a) for stage, a in _split(CUTS, LABELS)]
  _same_bits(jax.jit(F.combine_leaf_norms)(partials), _one_stage(2.0))
  _same_bits(F.combine_leaf_norms(jax.device_get(partials)), _one_stage(2.0))
  units = dict(zip(partials[1].paths, partials[1].units))
  assert units["['stack_w']"] == stage_units.Units((0,), ("layer",), (2,), (1, 2))
  assert units["['stack_moe']"] == stage_units.Units(
      (0, 1), ("layer", "expert"), (2, 3), (1, 2))
  assert units["['experts']"] == stage_units.Units((0,), ("expert",), (3,))


def test_stage_with_layers_split_over_devices():
  mesh = jax.make_mesh((8,), ("d",))
  stage = {"w": jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 16)),
                            jnp.float32), "b": jnp.arange(3.0)}
  specs = {"w": P(None, None, "d"), "b": P()}
  measure = jax.jit(shard_map(
      lambda t: F.partial_norm(t, axis_name="d", specs=specs, layer_axis={
          "w": 0, "b": None}, layers=4), mesh=mesh, in_specs=(specs,),
      out_specs=P()))
  def placed(tree, specs):
    return jax.device_put(tree, jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs))
  sharded = measure(placed(stage, specs))
  here = F.partial_norm(stage, layer_axis={"w": 0, "b": None}, layers=4)
  assert sharded.units == here.units and sharded.paths == here.paths
  np.testing.assert_allclose(sharded.norms, here.norms, rtol=1e-6)
  np.testing.assert_allclose(sharded.norms[1:], np.sqrt(
      (np.asarray(stage["w"], np.float64) ** 2).sum(axis=(1, 2))), rtol=1e-6)
  split_layers = {"w": P("d"), "b": P()}
  with pytest.raises(ValueError, match=r"partial_norm\(specs.*\['w'\].*keep"):
    jax.jit(shard_map(lambda t: F.partial_norm(
        t, axis_name="d", specs=split_layers, layer_axis={"w": 0, "b": None}),
        mesh=mesh, in_specs=(split_layers,), out_specs=P()))(
            placed({"w": jnp.ones((8, 2)), "b": jnp.ones(3)}, split_layers))


def test_bad_layers_and_stages():
  stack = jnp.ones((4, 3))
  def part(x, layers=None, **kw):
    return F.partial_norm({"w": x}, layer_axis=kw.pop("layer_axis", 0),
                          layers=layers, **kw)
  with pytest.raises(ValueError, match=r"combine_leaf_norms\(partials.*layers \[2\]"
                     r".*\['w'\].*overlapping"):
    F.combine_leaf_norms([part(stack[:3]), part(stack[2:], 2)])
  with pytest.raises(ValueError, match=r"combine_norms\(partials.*\['w'\] misses layers \[2, 3\]"):
    F.combine_norms([part(stack[:2]), part(stack[:1], 4)])
  with pytest.raises(ValueError,
                     match=r"combine_norms\(partials.*\['w'\].*whole leaf.*layer axis 0"):
    F.combine_norms([F.partial_norm({"w": stack[:2]}), part(stack[2:], 2)])
  experts = F.partial_norm({"w": jnp.ones((2, 3))}, layer_axis=0, expert_axis=1)
  with pytest.raises(ValueError, match=r"combine_norms\(partials.*expert axis 1 \(3\)"
                     r".*expert axis 1 \(2\)"):
    F.combine_norms([experts, F.partial_norm({"w": jnp.ones((2, 2))}, layer_axis=0,
                                             expert_axis=1, layers=2)])
  with pytest.raises(ValueError, match=r"partial_norm\(layers=range\(0, 3\)\).*\['w'\] stacks 4"):
    part(stack, range(3))
  with pytest.raises(ValueError, match=r"partial_norm\(layers=-1\)"):
    part(stack, -1)
  with pytest.raises(ValueError, match=r"partial_norm\(layers=2\).*layer_axis"):
    part(stack, 2, layer_axis=None)
  with pytest.raises(TypeError, match=r"partial_norm\(layers=.*range"):
    part(stack, 1.5)
  with pytest.raises(ValueError, match=r"partial_norm\(layer_axis=2\).*\['w'\]"):
    part(stack, layer_axis=2)
  a, b = part(stack[:2]), part(stack[2:], 2)
  with pytest.raises(ValueError, match=r"clip_stage\(partial.*another tree"):
    F.clip_stage({"w": stack}, 1.0, a, per_layer=True)
  with pytest.raises(TypeError, match=r"clip_stage\(combined"):
    F.clip_stage({"w": stack[:2]}, 1.0, a)
  with pytest.raises(TypeError, match=r"clip_stage\(partial"):
    F.clip_stage({"w": stack[:2]}, 1.0, F.combine_norms([a, b]))
  with pytest.raises(ValueError, match=r"clip_stage\(max_norm"):
    F.clip_stage({"w": stack[:2]}, -1.0, a, per_layer=True)
  with pytest.raises(TypeError, match=r"combine_leaf_norms\(partials"):
    F.combine_leaf_norms([a, 1.0])


@pytest.mark.parametrize("ord", [2.0, 100.0])
def test_layer_norms_of_complex_subnormal_and_empty_slices(ord):
  rng = np.random.default_rng(5)
  c = (rng.normal(size=(3, 5)) + 1j * rng.normal(size=(3, 5))).astype(np.complex64)
  c[1] *= 1e20  # |x|**p overflows float32 (and float64 for p = 100)
  tiny = np.full((3, 6), 1e-39, np.float32)  # subnormal entries
  tiny[0], tiny[2, 0] = 0, 3e-39
  for x in (c, tiny):
    got = F.partial_norm({"w": jnp.asarray(x)}, ord, layer_axis=0).norms
    a = np.abs(x.astype(np.complex128 if x.dtype == np.complex64 else np.float64))
    peak = a.max(axis=1, keepdims=True)
    want = peak[:, 0] * ((a / np.where(peak > 0, peak, 1)) ** ord).sum(axis=1) ** (1 / ord)
    assert _ulps(got, np.float32(want)) <= 2, (x.dtype, got, want)
  empty = F.partial_norm({"w": jnp.zeros((2, 0))}, ord, layer_axis=0)
  np.testing.assert_array_equal(empty.norms, [0.0, 0.0])
