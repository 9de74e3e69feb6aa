"""Empty axes are legal input, in every transform and functional with a view.

Zero layers, zero units, zero-size leaves, a group of only empty leaves (and
one of no floating leaf) and zero examples: no exception, every output
finite, states of the same shapes and dtypes at ``init`` and ``update``,
``optaxclip.stats`` with 0 for an empty leaf's norm, and beside normal
leaves the very numbers of the same tree without the empty ones (the norm
of nothing is 0, for every order). One program, compiled once, runs every
case on every tree (twice for the transforms: a second step from the
first's states); eagerly, each case runs on the all-empty tree.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip as oc

F = oc.functional
P = functools.partial

FULL = {
    "w": jnp.linspace(-2.0, 3.0, 12).reshape(3, 4),
    "b": jnp.array([0.5, -1.0, 2.0, 4.0]),
    "stack": jnp.linspace(-1.0, 5.0, 24).reshape(2, 3, 4),  # layer axis 0
    "steps": jnp.arange(3, dtype=jnp.int32),  # passed through, in no norm
}
EMPTIES = {
    "zero_layers": jnp.zeros((0, 3, 4)),  # a stack of no layers (axis 0)
    "zero_size": jnp.zeros((0,)),
    "zero_rows": jnp.zeros((0, 4)),  # AGC: 4 units of no entries
    "zero_cols": jnp.zeros((4, 0)),  # AGC: no units; no layers on axis 1
}
TREES = {"full": FULL, "mixed": {**FULL, **EMPTIES},
         "empty": {"steps": FULL["steps"], **EMPTIES}}
PARAMS = {name: jax.tree.map(lambda x: x * 2 + 1, tree)
          for name, tree in TREES.items()}
LAYERS = {"stack": 0, "zero_layers": 0, "zero_cols": 1}
TENSORS = 4  # FULL's tensors (a leaf, or a layer of a stack)


def layer_axis(tree):
  return {k: LAYERS.get(k) for k in tree}


def labels(tree):
  """A group of only empty leaves, and one of no floating leaf."""
  return {k: "empty" if k in EMPTIES else "ints" if k == "steps"
          else "w" if k == "w" else "rest" for k in tree}


# A stats key, state or output path naming one of these is an empty leaf's
# (or the group of them); everything else must be as without them.
EMPTY_NAMES = {*EMPTIES, "empty"}


@dataclasses.dataclass(frozen=True)
class Case:
  make: Callable[[], optax.GradientTransformation]
  leaf_norms: bool = False  # stats name each leaf's (and layer's) norm
  per_tensor: tuple[str, ...] = ()  # state fields with an entry per tensor
  ints_kept: bool = True  # int leaves come out as they went in
  over_tensors: tuple[str, ...] = ()  # the least of every tensor's statistic


def _microbatches():
  return optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2,
                          should_skip_update_fn=oc.microbatch_guard(max_norm=100.0))


CASES = {
    "clip_by_global_norm": Case(P(oc.clip_by_global_norm, 1.0)),
    "clip_by_global_norm_leaf_norms": Case(
        P(oc.clip_by_global_norm, 1.0, leaf_norms=True), leaf_norms=True),
    "clip_by_global_norm_layer_axis": Case(
        P(oc.clip_by_global_norm, 1.0, ord=3, leaf_norms=True,
          layer_axis=layer_axis), leaf_norms=True),
    "clip_by_global_norm_groups": Case(
        P(oc.clip_by_global_norm, 1.0, groups=labels, leaf_norms=True,
          layer_axis=layer_axis), leaf_norms=True),
    "clip_by_norm": Case(P(oc.clip_by_norm, 1.0, leaf_norms=True), leaf_norms=True),
    "clip_by_norm_layer_axis": Case(
        P(oc.clip_by_norm, 1.0, ord="inf", leaf_norms=True,
          layer_axis=layer_axis), leaf_norms=True),
    "clip_grad_norm": Case(
        P(oc.clip_grad_norm, 1.0, 1.0, leaf_norms=True, layer_axis=layer_axis),
        leaf_norms=True),
    "clip_by_block_rms": Case(P(oc.clip_by_block_rms, 0.5, layer_axis=layer_axis)),
    "adaptive_grad_clip": Case(P(oc.adaptive_grad_clip, 0.05)),
    "adaptive_grad_clip_layer_axis": Case(
        P(oc.adaptive_grad_clip, 0.05, layer_axis=layer_axis)),
    "zclip": Case(P(oc.zclip, warmup_steps=1, leaf_norms=True,
                    layer_axis=layer_axis), leaf_norms=True),
    "adagc": Case(P(oc.adagc, warmup_steps=1, layer_axis=layer_axis),
                  per_tensor=("gamma", "far_streak"),
                  over_tensors=("adagc/gamma_min",)),
    "auto_clip": Case(P(oc.auto_clip, history=4)),
    "skip_step": Case(P(oc.skip_step, oc.clip_by_global_norm(
        1.0, leaf_norms=True, layer_axis=layer_axis), max_norm=100.0),
                      leaf_norms=True),
    "dynamic_loss_scale": Case(P(oc.dynamic_loss_scale, oc.clip_by_global_norm(
        1.0, leaf_norms=True, layer_axis=layer_axis), period=4), leaf_norms=True),
    # optax.MultiSteps itself turns int leaves into float zeros.
    "microbatch_guard": Case(_microbatches, ints_kept=False),
}


def signature(tree, like=None):
  """Shape, dtype and weak type of every leaf: what jit keys its cache on;
  given ``like`` (a tree of the same structure), of the leaves where it is
  floating."""
  leaves = jax.tree.leaves(tree)
  keep = [True] * len(leaves) if like is None else [
      jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in jax.tree.leaves(like)]
  return [(jnp.shape(x), jnp.result_type(x), getattr(x, "weak_type", None))
          for x, kept in zip(leaves, keep) if kept]


def _names(path) -> set[str]:
  return {str(getattr(k, "key", getattr(k, "name", ""))) for k in path}


def by_path(tree) -> dict[str, np.ndarray]:
  """Every leaf by its path, the empty leaves' (and their group's) left out."""
  found, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in found
          if not _names(path) & EMPTY_NAMES}


def assert_same(got: dict, want: dict):
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)


def assert_finite(tree):
  for x in jax.tree.leaves(tree):
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      assert np.isfinite(np.asarray(x)).all(), x


def assert_empty_entries(stats: dict[str, jax.Array]) -> dict[str, np.ndarray]:
  """The entries of normal leaves; an empty leaf's norm is 0, its factor 1."""
  kept = {}
  for key, value in stats.items():
    if not set(key.split("/")) & EMPTY_NAMES:
      kept[key] = np.asarray(value)
    elif "leaf_norm" in key or key.endswith("/norm"):
      assert value == 0, key
    elif key.endswith("/scale"):
      assert value == 1, key
  return kept


def _without_empty_tensors(case: Case, state):
  """``state`` with its per-tensor fields cut to FULL's tensors (those come
  first: the empty leaves' names sort last), the others' checked 0."""
  if not case.per_tensor:
    return state
  for field in case.per_tensor:
    np.testing.assert_array_equal(getattr(state, field)[TENSORS:], 0)
  return state._replace(**{field: getattr(state, field)[:TENSORS]
                           for field in case.per_tensor})


ORDS = (1, 2, 3, 0.5, math.inf)
FLOATS = {name: {k: x for k, x in tree.items() if k != "steps"}
          for name, tree in TREES.items()}


def _norms(trees):
  """Every order's global norm of each tree; beside normal leaves, with its
  gradient (the generic power's order and 2)."""
  return {name: [jax.value_and_grad(P(F.global_norm, ord=p))(tree)
                 if name != "empty" and p in (2, 0.5)
                 else (F.global_norm(tree, ord=p), None)
                 for p in ORDS] for name, tree in trees.items()}


def _functionals(trees, params):
  out = {}
  for name, tree in trees.items():
    out[name] = {
        "clip_by_global_norm": F.clip_by_global_norm(tree, 1.0, ord=0.5),
        "clip_by_norm": F.clip_by_norm(tree, 1.0, layer_axis=layer_axis),
        "clip_by_block_rms": F.clip_by_block_rms(tree, 0.5),
        "adaptive_grad_clip": F.adaptive_grad_clip(tree, params[name], 0.05,
                                                    layer_axis=layer_axis),
        "unitwise_norm": {k: F.unitwise_norm(x) for k, x in tree.items()
                          if k != "steps"},
    }
  return out


EXAMPLES = {  # per-example gradients: a leading batch axis of 3
    "full": {"a": jnp.linspace(-3.0, 4.0, 12).reshape(3, 4),
             "s": jnp.linspace(0.0, 2.0, 12).reshape(3, 2, 2)},
    "mixed": {"a": jnp.linspace(-3.0, 4.0, 12).reshape(3, 4),
              "s": jnp.linspace(0.0, 2.0, 12).reshape(3, 2, 2),
              "zero_size": jnp.zeros((3, 0)), "zero_layers": jnp.zeros((3, 0, 2))},
    "no_examples": {"a": jnp.zeros((0, 4)), "s": jnp.zeros((0, 2, 2))},
    "zero_layers": {"zero_layers": jnp.ones((3, 0, 2))},  # no layer at all
}
EXAMPLE_LAYERS = {"s": 0, "zero_layers": 0}  # of one example's gradient


def _per_example(trees):
  out = {}
  for name, tree in trees.items():
    stacked = {k: EXAMPLE_LAYERS.get(k) for k in tree}
    out[name] = (F.per_example_clip_by_global_norm(tree, 1.0),
                 F.per_example_clip_by_layer_norm(tree, 1.0, uniform=False,
                                                  layer_axis=stacked),
                 F.per_example_clip_by_layer_norm(tree, 1.0, layer_axis=stacked))
  return out


TRANSFORMS = {name: case.make() for name, case in CASES.items()}


@jax.jit
def _program(states, trees, params, examples):
  """Every case on every tree: one compilation (measured: 6 s of CPU, against
  15 s for one program per transform)."""
  return {"transforms": {name: {tree: tx.update(trees[tree], states[name][tree],
                                                params[tree]) for tree in trees}
                         for name, tx in TRANSFORMS.items()},
          "global_norm": _norms({name: {k: x for k, x in tree.items() if k != "steps"}
                                 for name, tree in trees.items()}),
          "functionals": _functionals(trees, params),
          "per_example": _per_example(examples)}


@functools.cache
def _jitted():
  """The program's results, and the transforms' states at init."""
  states = {name: {tree: tx.init(PARAMS[tree]) for tree in TREES}
            for name, tx in TRANSFORMS.items()}
  first = _program(states, TREES, PARAMS, EXAMPLES)
  # A second step from the first's states: the same program.
  second = _program({name: {tree: out[1] for tree, out in runs.items()}
                     for name, runs in first["transforms"].items()},
                    TREES, PARAMS, EXAMPLES)
  assert _program._cache_size() == 1
  return states, second


@pytest.mark.parametrize("name", list(CASES))
def test_empty_axes_in_every_transform(name):
  case, tx = CASES[name], TRANSFORMS[name]
  states, results = _jitted()
  jitted = results["transforms"][name]
  eager = tx.update(TREES["empty"], states[name]["empty"], PARAMS["empty"])
  stats = {}
  for tree, (out, state) in [("eager", eager), *jitted.items()]:
    grads = TREES["empty" if tree == "eager" else tree]
    assert signature(state) == signature(states[name]["empty" if tree == "eager" else tree])
    like = None if case.ints_kept else grads
    assert signature(out, like) == signature(grads, like), tree
    assert_finite((out, state))
    stats[tree] = assert_empty_entries(oc.stats(state))
  for key, value in stats["empty"].items():  # a tree of nothing: norm 0, factor 1
    if key.endswith("/norm"):
      assert value == 0, key
    # (not a loss scale; not auto_clip's min(1, 0 / (0 + eps)), as at zero)
    if key.endswith("/scale") and key not in ("loss_scale/scale", "auto_clip/scale"):
      assert value == 1, key
  # Beside normal leaves, empty ones change no number.
  out, state = jitted["mixed"]
  assert_same(by_path((out, _without_empty_tensors(case, state))),
              by_path(jitted["full"]))
  for key in case.over_tensors:  # an empty tensor's statistic is 0
    assert stats["mixed"].pop(key) == min(stats["full"].pop(key), 0), key
  assert_same(stats["mixed"], stats["full"])
  assert_empty_entries(oc.stats(states[name]["mixed"]))  # at init too
  if case.leaf_norms:  # the stack of no layers is in the stats (as 0)
    assert any(key.endswith("leaf_norm/zero_layers") for key in oc.stats(state))


def test_global_norm_of_empty_leaves_every_order():
  jitted = _jitted()[1]["global_norm"]
  for i, p in enumerate(ORDS):
    assert F.global_norm(FLOATS["empty"], ord=p) == 0  # eager
    assert jitted["empty"][i][0] == 0
    (norm, grads), (want, want_grads) = jitted["mixed"][i], jitted["full"][i]
    assert norm == want
    if grads is not None:
      assert_finite(grads)
      assert_same(by_path(grads), by_path(want_grads))


def test_functionals_with_empty_leaves():
  jitted = _jitted()[1]["functionals"]
  eager = _functionals({"empty": TREES["empty"]}, PARAMS)["empty"]
  assert_same(by_path(eager), by_path(jitted["empty"]))
  for name, outputs in jitted.items():
    assert_finite(outputs)
    assert signature(outputs["unitwise_norm"]) == signature(FLOATS[name])
  assert_same(by_path(jitted["mixed"]), by_path(jitted["full"]))


def test_per_example_with_empty_axes():
  jitted = _jitted()[1]["per_example"]
  eager = _per_example({"no_examples": EXAMPLES["no_examples"]})
  assert_same(by_path(eager["no_examples"]), by_path(jitted["no_examples"]))
  for outputs in jitted.values():
    assert_finite(outputs)
  # No example: sums of nothing, no norm, none clipped.
  by_global, by_layer, _ = jitted["no_examples"]
  assert by_global.norms.shape == (0,) and by_global.num_clipped == 0
  assert_same(by_path(by_global.summed), {"['a']": np.zeros(4),
                                          "['s']": np.zeros((2, 2))})
  assert by_layer.norms["s"].shape == (0, 2)
  for result in jitted["zero_layers"][1:]:
    assert result.norms["zero_layers"].shape == (3, 0)
    assert result.summed["zero_layers"].shape == (0, 2)
  # Beside normal leaves, empty ones change nothing; uniform budgets too,
  # as optax's: an empty leaf is one of the K layers, no layer of a stack is
  # none (the mixed tree's K is 2 + 1 + 0).
  assert_same(by_path(jitted["mixed"][:2]), by_path(jitted["full"][:2]))
  a, s = EXAMPLES["full"]["a"], EXAMPLES["full"]["s"]
  layers = [a, s[:, 0], s[:, 1], EXAMPLES["mixed"]["zero_size"]]
  summed = optax.per_example_layer_norm_clip(layers, 1.0)[0]
  got = jitted["mixed"][2].summed
  np.testing.assert_allclose(got["a"], summed[0], rtol=1e-6)
  np.testing.assert_allclose(got["s"], jnp.stack(summed[1:3]), rtol=1e-6)
