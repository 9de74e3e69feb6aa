"""The contract every optaxclip transform keeps, checked for each of them.

Each transform's own file tests its algorithm against its reference; this one
checks what all of them promise: dtypes kept, state types stable (no weak
types), ``init`` on ``ShapeDtypeStruct``, eager == ``jit``, finite at zero,
composition with ``optax.chain``, ``MultiSteps``, ``inject_hyperparams`` and
``apply_if_finite``, checkpointable state, and, for the fixed-threshold
clippers, idempotence and no change below the threshold.
"""

import dataclasses
import functools
import pickle
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FLOAT_DTYPES
from helpers import (
  tree_like,
  warm,  # noqa: F401 (test_zclip.py, test_adagc.py import it from here)
)

import optaxclip as oc


@dataclasses.dataclass(frozen=True)
class Case:
  """How the contract builds one transform."""
  factory: Callable[..., optax.GradientTransformation]
  kwargs: dict[str, Any]  # hyperparameters; `inject` must be among them
  inject: str  # the numeric hyperparameter optax.inject_hyperparams injects
  off: Any = 1e6  # a value of `inject` under which nothing is clipped
  fixed_threshold: bool = True  # idempotent and a no-op below the threshold
  zero_ok: bool = True  # `inject` may be 0

  def make(self, **overrides) -> optax.GradientTransformation:
    """The transform; with number overrides (or none) one shared object, so
    that the tests of a case reuse its compiled updates (a transform is a
    pure function: nothing carries over between tests)."""
    if not all(isinstance(v, (int, float)) for v in overrides.values()):
      return self.factory(**{**self.kwargs, **overrides})  # the user's arrays
    key = (id(self), tuple(sorted(overrides.items())))
    if key not in _BUILT:
      _BUILT[key] = self.factory(**{**self.kwargs, **overrides})
    return _BUILT[key]


_BUILT: dict[Any, optax.GradientTransformation] = {}


CASES = {
    "clip_by_value": Case(oc.clip_by_value, {"max_value": 0.5}, "max_value"),
    "clip_by_norm": Case(oc.clip_by_norm, {"max_norm": 0.5}, "max_norm"),
    "clip_by_norm_inf": Case(functools.partial(oc.clip_by_norm, ord="inf"),
                             {"max_norm": 0.5}, "max_norm"),
    "clip_by_global_norm": Case(oc.clip_by_global_norm, {"max_norm": 0.5},
                                "max_norm"),
    "clip_by_global_norm_ord3": Case(
        functools.partial(oc.clip_by_global_norm, ord=3), {"max_norm": 0.5},
        "max_norm"),
    "clip_by_global_norm_zero": Case(
        functools.partial(oc.clip_by_global_norm, nonfinite="zero"),
        {"max_norm": 0.5}, "max_norm"),
    "clip_by_global_norm_raise": Case(
        functools.partial(oc.clip_by_global_norm, nonfinite="raise"),
        {"max_norm": 0.5}, "max_norm"),
    "clip_grad_norm": Case(oc.clip_grad_norm, {"max_norm": 0.5}, "max_norm"),
    # Granularity (issue 13): norms per leaf and per layer kept in the state,
    # each layer clipped on its own, and norm groups.
    "clip_by_global_norm_leaf_norms": Case(
        functools.partial(oc.clip_by_global_norm, leaf_norms=True,
                          layer_axis={"dense": {"w": 0, "b": None}, "norm": None}),
        {"max_norm": 0.5}, "max_norm"),
    "clip_grad_norm_leaf_norms": Case(
        functools.partial(oc.clip_grad_norm, leaf_norms=True), {"max_norm": 0.5},
        "max_norm"),
    "clip_by_norm_layer_axis": Case(
        functools.partial(oc.clip_by_norm, leaf_norms=True,
                          layer_axis={"dense": {"w": -1, "b": 0}, "norm": None}),
        {"max_norm": 0.5}, "max_norm"),
    "clip_by_global_norm_groups": Case(
        functools.partial(oc.clip_by_global_norm, leaf_norms=True,
                          groups={"dense": "dense", "norm": "norm"}),
        {"max_norm": 0.5}, "max_norm"),
    "clip_by_global_norm_groups_zero": Case(
        functools.partial(oc.clip_by_global_norm, nonfinite="zero",
                          groups={"dense": {"w": "w", "b": "b"}, "norm": "w"}),
        {"max_norm": 0.5}, "max_norm"),
    "clip_grad_norm_inf": Case(
        functools.partial(oc.clip_grad_norm, norm_type="inf"),
        {"max_norm": 0.5}, "max_norm"),
    "adaptive_grad_clip": Case(oc.adaptive_grad_clip, {"clipping": 0.05},
                               "clipping"),
    "clip_by_block_rms": Case(oc.clip_by_block_rms, {"threshold": 0.1},
                              "threshold"),
    # Learned thresholds: not idempotent, and the first steps already scale.
    "auto_clip": Case(oc.auto_clip, {"percentile": 10.0, "history": 8},
                      "percentile", off=100.0, fixed_threshold=False),
    "zclip": Case(oc.zclip, {"warmup_steps": 3}, "max_grad_norm",
                  fixed_threshold=False),
    "adagc": Case(oc.adagc, {"warmup_steps": 2}, "lambda_abs",
                  fixed_threshold=False),
    # Wrappers pass their inner optimizer's updates on, or zeroes.
    "skip_step": Case(functools.partial(oc.skip_step, optax.sgd(1.0)),
                      {"max_norm": 5.0}, "max_norm", fixed_threshold=False),
    "dynamic_loss_scale": Case(oc.dynamic_loss_scale,
                               {"initial_scale": 16.0, "period": 4}, "period",
                               off=None, fixed_threshold=False, zero_ok=False),
}
NAMES = list(CASES)
RAISES_ON_NAN = {"clip_by_global_norm_raise"}


PARAMS = tree_like(seed=1)  # AGC needs params; the others ignore them


def signature(tree):
  """Shape, dtype and weak type of every leaf: what jit keys its cache on."""
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x),
                                 getattr(x, "weak_type", None)), tree)


def run(tx, grads, state=None, steps=1, jit=True):
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(grads) if state is None else state
  params = jax.tree.map(lambda p, g: p.astype(g.dtype), PARAMS, grads)
  for _ in range(steps):
    out, state = update(grads, state, params)
  return out, state


def assert_trees_close(a, b, rtol=1e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol), a, b)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_dtype_and_state_types_are_stable(name, dtype):
  tx = CASES[name].make()
  grads = tree_like(dtype)
  state = tx.init(grads)
  for jit in (False, True):
    out, new_state = run(tx, grads, state, jit=jit)
    assert signature(out) == signature(grads)
    assert signature(new_state) == signature(state)
    assert not any(getattr(x, "weak_type", False)
                   for x in jax.tree.leaves(new_state))


def buffers(tree) -> list[int]:
  return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
          if isinstance(x, jax.Array)]


def users_arrays(case: Case) -> dict[str, jax.Array]:
  """The numeric hyperparameters as the user's own (strong) JAX arrays."""
  return {k: jnp.array(v, jnp.float32 if isinstance(v, float) else jnp.int32)
          for k, v in case.kwargs.items() if isinstance(v, (int, float))}


@pytest.mark.parametrize("inject", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_fresh_state_can_be_donated(name, inject):
  # A training step usually donates the optimizer state to jit. XLA refuses
  # to donate one buffer twice, so no two fields of a fresh state may share
  # an array (as `zero = jnp.zeros(...)` for several counters would, or a
  # field holding the value inject_hyperparams keeps in `hyperparams`).
  case = CASES[name]
  tx = optax.inject_hyperparams(case.factory)(**case.kwargs) if inject \
      else case.make()
  tx = optax.chain(tx, optax.sgd(0.1))
  grads = tree_like()
  state = tx.init(grads)
  leaves = buffers(state)
  assert len(set(leaves)) == len(leaves)
  update = jax.jit(tx.update, donate_argnums=1)
  for _ in range(2):
    _, state = update(grads, state, PARAMS)
  assert all(np.isfinite(np.asarray(x, np.float64)).all()
             for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating))


@pytest.mark.parametrize("name", NAMES)
def test_donated_state_leaves_the_users_hyperparameters_alive(name):
  """No state holds a hyperparameter array the user passed in: donating the
  state would delete the user's array. Under inject_hyperparams, optax itself
  keeps the user's array in ``hyperparams``; the transform's own state must
  still not share its buffer."""
  case = CASES[name]
  users = users_arrays(case)
  grads = tree_like()
  tx = case.make(**users)
  state = tx.init(grads)
  assert not set(buffers(state)) & set(buffers(users))
  update = jax.jit(tx.update, donate_argnums=1)
  for _ in range(2):
    _, state = update(grads, state, PARAMS)
  assert not any(x.is_deleted() for x in users.values())
  injected = optax.inject_hyperparams(case.factory)(**{**case.kwargs, **users})
  state = injected.init(grads)
  assert not set(buffers(state.inner_state)) & set(buffers(users))
  for _ in range(2):
    _, state = jax.jit(injected.update, donate_argnums=1)(grads, state, PARAMS)


@pytest.mark.parametrize("name", NAMES)
def test_init_accepts_shape_dtype_structs(name):
  tx = CASES[name].make()
  grads = tree_like()
  structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), grads)
  assert signature(jax.eval_shape(tx.init, structs)) == signature(tx.init(grads))
  out = jax.eval_shape(tx.update, structs, tx.init(grads), PARAMS)[0]
  assert jax.tree.map(lambda s: (s.shape, s.dtype), out) == \
      jax.tree.map(lambda x: (x.shape, x.dtype), grads)


@pytest.mark.parametrize("name", NAMES)
def test_eager_and_jit_agree_and_act_on_a_spike(name):
  tx = CASES[name].make()
  _, state = run(tx, tree_like(), steps=3)  # past every warm-up
  spike = tree_like(scale=30.0)
  eager = run(tx, spike, state, jit=False)
  jitted = run(tx, spike, state)
  assert_trees_close(eager, jitted)
  assert not jax.tree.all(jax.tree.map(
      lambda a, b: bool(np.allclose(a, b)), jitted[0], spike)), "no effect"


@pytest.mark.parametrize("name", [n for n in NAMES if CASES[n].fixed_threshold])
def test_idempotent(name):
  tx = CASES[name].make()
  once, state = run(tx, tree_like(scale=3.0))
  twice, _ = run(tx, once, state)
  assert_trees_close(once, twice, rtol=1e-5)


@pytest.mark.parametrize("name", [n for n in NAMES if CASES[n].fixed_threshold])
def test_below_threshold_is_a_no_op(name):
  grads = tree_like(scale=1e-4)
  out, _ = run(CASES[name].make(), grads)
  jax.tree.map(np.testing.assert_array_equal, out, grads)


@pytest.mark.parametrize("name", NAMES)
def test_finite_at_zero(name):
  case = CASES[name]
  zeros = jax.tree.map(jnp.zeros_like, tree_like())
  out, state = run(case.make(), zeros, steps=2)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state)
             if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim == 0)
  if case.zero_ok:  # a zero threshold clips to zero, never to NaN
    out, _ = run(case.make(**{case.inject: 0.0}), tree_like(), steps=2)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))


@pytest.mark.parametrize("name", NAMES)
def test_composes_with_chain_and_multisteps(name):
  case = CASES[name]
  grads = tree_like(scale=3.0)
  clipped, _ = run(case.make(), grads)
  chained = optax.chain(case.make(), optax.sgd(1.0))
  updates, _ = run(chained, grads)
  assert_trees_close(updates, jax.tree.map(jnp.negative, clipped))
  # MultiSteps applies the transform once per 2 micro-steps, to the mean.
  multi = optax.MultiSteps(optax.chain(case.make(), optax.sgd(1.0)),
                           every_k_schedule=2)
  updates, state = run(multi, grads)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  updates, _ = run(multi, grads, state)
  assert_trees_close(updates, jax.tree.map(jnp.negative, clipped), rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_inject_hyperparams(name):
  case = CASES[name]
  grads = tree_like(scale=3.0)
  tx = optax.inject_hyperparams(case.factory)(**case.kwargs)
  injected, state = run(tx, grads)
  expected, _ = run(case.make(), grads)
  assert_trees_close(injected, expected)
  if case.off is not None:  # the injected value is live: change it
    state.hyperparams[case.inject] = jnp.asarray(
        case.off, state.hyperparams[case.inject].dtype)
    changed, _ = run(tx, grads, state)
    unclipped, _ = run(case.make(**{case.inject: case.off}), grads)
    assert_trees_close(changed, unclipped)


# nonfinite="raise" stops on NaN by design (tested in test_clip_by_global_norm.py).
@pytest.mark.parametrize("name", [n for n in NAMES if n not in RAISES_ON_NAN])
def test_apply_if_finite_skips_nan_steps(name):
  tx = optax.apply_if_finite(optax.chain(CASES[name].make(), optax.sgd(1.0)),
                             max_consecutive_errors=3)
  grads = tree_like(scale=3.0)
  bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), grads)
  updates, state = run(tx, bad)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  assert int(state.notfinite_count) == 1
  updates, state = run(tx, grads, state)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates))
  assert int(state.notfinite_count) == 0


@pytest.mark.parametrize("name", NAMES)
def test_state_is_a_checkpointable_pytree(name):
  tx = CASES[name].make()
  grads = tree_like(scale=3.0)
  _, state = run(tx, grads, steps=2)
  leaves, treedef = jax.tree.flatten(state)
  rebuilt = jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
  restored = jax.tree.map(jnp.asarray, pickle.loads(pickle.dumps(rebuilt)))
  assert type(restored) is type(state)
  assert signature(restored) == signature(state)
  assert_trees_close(run(tx, grads, restored), run(tx, grads, state), rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_statistics_are_reported(name):
  found = oc.stats(run(optax.chain(CASES[name].make(), optax.sgd(1.0)),
                       tree_like())[1])
  if name != "clip_by_value":  # stateless, as optax.clip
    assert found and all(v.shape == () for v in found.values())
