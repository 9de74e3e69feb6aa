"""What the public names accept beyond the obvious, for every one of them:
traced hyperparameters out of range (clamped as each docstring says),
``inf`` thresholds (never clip), Python scalar leaves, ``state=None``.

Bad arguments that raise are in tests/test_errors.py; the cases of one
transform (an inf threshold on Inf gradients, a traced initial scale, ...)
are in that transform's file.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip as oc

F = oc.functional


def grads_at(step):
  """Gradients whose norm moves, with a spike at step 3."""
  scale = (1.0, 1.2, 0.9, 40.0, 1.1)[step]
  return {"w": jnp.array([[0.3, -0.4], [0.5, 0.1]]) * scale,
          "b": jnp.array([-0.2, 0.6]) * scale}


PARAMS = {"w": jnp.array([[1.0, -2.0], [0.5, 1.0]]), "b": jnp.array([0.1, 0.0])}
STEPS = 5

# (factory, hyperparameters, argument, a bad traced value, the value it acts
# as, as the factory's docstring says, or the hyperparameters it acts as).
BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))
SKIP = functools.partial(oc.skip_step, optax.sgd(1.0))
TRACED = [
    (oc.clip_by_value, {"max_value": 0.5}, "max_value", -1.0, 0.0),
    (oc.clip_by_value, {"max_value": 0.5}, "max_value", math.nan, 0.0),
    (oc.clip_by_value, {"max_value": 0.5, "min_value": -0.5}, "min_value", 1.0,
     {"max_value": 0.0, "min_value": 0.0}),  # an empty range: every element 0
    (oc.clip_by_norm, {"max_norm": 0.5}, "max_norm", -1.0, 0.0),
    (oc.clip_by_norm, {"max_norm": 0.5, "eps": 0.0}, "eps", -2.0, 0.0),
    (oc.clip_by_global_norm, {"max_norm": 0.5}, "max_norm", -1.0, 0.0),
    (oc.clip_by_global_norm, {"max_norm": 0.5}, "max_norm", math.nan, 0.0),
    (oc.clip_by_global_norm, {"max_norm": 0.5, "eps": 0.0}, "eps", -0.4, 0.0),
    (oc.clip_by_global_norm, {"max_norm": 0.5, "ord": 3.0}, "ord", -1.0, 2.0),
    (oc.clip_by_global_norm, {"max_norm": 0.5, "ord": 3.0}, "ord", math.nan, 2.0),
    (oc.clip_grad_norm, {"max_norm": 0.5}, "max_norm", -1.0, 0.0),
    (oc.clip_by_block_rms, {"threshold": 0.5}, "threshold", -1.0, 0.0),
    (oc.clip_by_block_rms, {"threshold": 0.5}, "threshold", math.nan, 0.0),
    (oc.clip_grad_norm, {"max_norm": 0.5, "norm_type": 3.0}, "norm_type", 0.0, 2.0),
    (oc.adaptive_grad_clip, {"clipping": 0.1}, "clipping", -1.0, 0.0),
    (oc.adaptive_grad_clip, {"clipping": 0.1, "eps": 1e-3}, "eps", -1.0, 0.0),
    (oc.auto_clip, {"percentile": 10.0, "history": 4}, "percentile", -50.0, 0.0),
    (oc.auto_clip, {"percentile": 10.0, "history": 4}, "percentile", 150.0, 100.0),
    (oc.auto_clip, {"percentile": 10.0, "history": 4}, "percentile", math.nan, 0.0),
    (oc.auto_clip, {"percentile": 10.0, "history": 4, "eps": 1e-6}, "eps", -1.0, 0.0),
    (oc.zclip, {"warmup_steps": 2, "alpha": 0.9}, "alpha", 2.0, 1.0),
    (oc.zclip, {"warmup_steps": 2, "alpha": 0.9}, "alpha", -1.0, 0.0),
    (oc.zclip, {"warmup_steps": 2, "z_thresh": 2.5}, "z_thresh", -1.0, 0.0),
    (oc.zclip, {"warmup_steps": 2, "max_grad_norm": 1.0}, "max_grad_norm", -1.0, 0.0),
    (oc.zclip, {"warmup_steps": 2, "eps": 1e-6}, "eps", -1.0, 0.0),
    (oc.zclip, {"warmup_steps": 2, "clip_factor": 1.0}, "clip_factor", -1.0, 0.0),
    (oc.adagc, {"warmup_steps": 2, "lambda_abs": 1.0}, "lambda_abs", -1.0, 0.0),
    (oc.adagc, {"warmup_steps": 2, "lambda_rel": 1.05}, "lambda_rel", -1.0, 0.0),
    (oc.adagc, {"warmup_steps": 2, "beta": 0.9}, "beta", 2.0, 1.0),
    (oc.adagc, {"warmup_steps": 2, "beta": 0.9}, "beta", -1.0, 0.0),
    (oc.adagc, {"warmup_steps": 2, "eps": 0.0}, "eps", -1.0, 0.0),
    (oc.adagc, {"warmup_steps": 2}, "warmup_steps", -3, 1),
    (SKIP, {"max_norm": 10.0}, "max_norm", -1.0, 0.0),
    (SKIP, {"zscore": 3.0, "warmup_steps": 1}, "zscore", -1.0, 0.0),
    (SKIP, {"zscore": 3.0, "warmup_steps": 1, "ema_decay": 0.9}, "ema_decay", 1.5,
     BELOW_ONE),
    (SKIP, {"zscore": 3.0, "warmup_steps": 1, "ema_decay": 0.9}, "ema_decay", -1.0,
     0.0),
    (SKIP, {"zscore": 3.0, "warmup_steps": 2}, "warmup_steps", -5, 0),
    (SKIP, {"max_norm": 10.0, "ord": 3.0}, "ord", -1.0, 2.0),
    (oc.dynamic_loss_scale, {"initial_scale": 4.0, "period": 2}, "factor", 0.5, 1.0),
    (oc.dynamic_loss_scale, {"initial_scale": 4.0, "period": 2}, "factor", math.nan,
     1.0),
    (oc.dynamic_loss_scale, {"initial_scale": 4.0, "period": 2}, "period", -1, 1),
    (oc.dynamic_loss_scale, {"initial_scale": 4.0, "period": 2}, "min_scale", -1.0,
     1.0),
]


def _id(case):
  factory, _, arg, bad, _ = case
  name = getattr(factory, "__name__", None) or factory.func.__name__
  return f"{name}-{arg}={bad}"


@functools.cache
def _injected(factory, kwargs):
  """``inject_hyperparams(factory)(**kwargs)`` and its jitted update, built
  once: the cases of one transform share one compiled update."""
  tx = optax.inject_hyperparams(factory)(**dict(kwargs))
  return tx, jax.jit(tx.update)


def _run(factory, kwargs, values):
  """The updates of ``STEPS`` steps with the injected ``values`` (traced),
  and the transform's state after them."""
  tx, update = _injected(factory, tuple(sorted(kwargs.items())))
  state = tx.init(PARAMS)
  for arg, value in values.items():
    state.hyperparams[arg] = jnp.asarray(value, state.hyperparams[arg].dtype)
  outs = []
  for t in range(STEPS):
    out, state = update(grads_at(t), state, PARAMS)
    outs.append(out)
  return outs, state.inner_state


@pytest.mark.parametrize("case", TRACED, ids=[_id(c) for c in TRACED])
def test_traced_bad_hyperparameters_are_clamped(case):
  # Issue 11: an injected value changed in the state reaches a jitted update
  # as a tracer. It cannot be checked, so it acts as its clamp: never a
  # flipped sign, never NaN from finite gradients. (That valid injected
  # values give the transform's own numbers is tests/test_contract.py's.)
  factory, kwargs, arg, bad, acts_as = case
  outs, state = _run(factory, kwargs, {arg: bad})
  expected, expected_state = _run(
      factory, kwargs, acts_as if isinstance(acts_as, dict) else {arg: acts_as})
  for x, y in zip(jax.tree.leaves(outs), jax.tree.leaves(expected)):
    assert np.all(np.isfinite(x))
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  jax.tree.map(np.testing.assert_array_equal, state, expected_state)


@pytest.mark.parametrize("name,fn", [
    ("clip_by_norm", lambda g, v: F.clip_by_norm(g, v)),
    ("clip_by_global_norm", lambda g, v: F.clip_by_global_norm(g, v)[0]),
    ("clip_by_value", lambda g, v: F.clip_by_value(g, v)),
    ("adaptive_grad_clip", lambda g, v: F.adaptive_grad_clip(g, PARAMS, v)),
    ("per_example_clip_by_global_norm",
     lambda g, v: F.per_example_clip_by_global_norm(g, v).summed),
    ("per_example_clip_by_layer_norm",
     lambda g, v: F.per_example_clip_by_layer_norm(g, v).summed),
])
@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_functions_clamp_a_traced_threshold_to_zero(name, fn, bad):
  del name
  grads = grads_at(0)
  out = jax.jit(fn)(grads, jnp.float32(bad))
  expected = fn(grads, 0.0)
  jax.tree.map(np.testing.assert_array_equal, out, expected)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))


# --- inf thresholds: measure, never clip (issue 12) ---------------------------

FINITE = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}

INF_TRANSFORMS = {
    "clip_by_global_norm": lambda: oc.clip_by_global_norm(math.inf),
    "clip_by_norm": lambda: oc.clip_by_norm(math.inf),
    "clip_grad_norm": lambda: oc.clip_grad_norm(math.inf),
    "clip_by_global_norm_ord3": lambda: oc.clip_by_global_norm(math.inf, ord=3),
    "clip_by_value": lambda: oc.clip_by_value(math.inf),
    "clip_by_value_both": lambda: oc.clip_by_value(math.inf, -math.inf),
    "zclip": lambda: oc.zclip(max_grad_norm=math.inf, warmup_steps=2,
                              z_thresh=1e6),
    "adagc": lambda: oc.adagc(lambda_abs=math.inf, warmup_steps=10),
    "skip_step": lambda: oc.skip_step(optax.sgd(-1.0), max_norm=math.inf,
                                      zscore=math.inf, warmup_steps=0),
}


@pytest.mark.parametrize("name", INF_TRANSFORMS)
@pytest.mark.parametrize("jit", [False, True])
def test_inf_threshold_never_clips_and_still_measures(name, jit):
  tx = INF_TRANSFORMS[name]()
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(FINITE)
  for scale in (1.0, 1e30, 1.0):
    grads = jax.tree.map(lambda x: x * scale, FINITE)
    out, state = update(grads, state, FINITE)
    jax.tree.map(np.testing.assert_array_equal, out, grads)
  logged = [v for k, v in oc.stats(state).items() if k.endswith("/norm")]
  expected = {"clip_by_norm": 12.0,  # the largest leaf norm
              "clip_by_global_norm_ord3": F.global_norm(FINITE, ord=3)}
  for norm in logged:
    np.testing.assert_allclose(norm, expected.get(name, 13.0), rtol=1e-6)


# --- Python scalar leaves (issue 13) ------------------------------------------

def mixed_tree():
  return {"f": 1.5, "i": 3, "w": jnp.array([3.0, -4.0]), "c": [2.5, jnp.ones(2)]}


def as_arrays(tree):
  """The tree as ``jit`` hands it to a function: Python floats as arrays."""
  return jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, float) else x,
                      tree)


TRANSFORMS = {
    "clip_by_value": lambda: oc.clip_by_value(0.5),
    "clip_by_norm": lambda: oc.clip_by_norm(1.0),
    "clip_by_global_norm": lambda: oc.clip_by_global_norm(1.0),
    "clip_by_global_norm_zero": lambda: oc.clip_by_global_norm(1.0, nonfinite="zero"),
    "clip_by_global_norm_raise": lambda: oc.clip_by_global_norm(1.0, nonfinite="raise"),
    "clip_grad_norm": lambda: oc.clip_grad_norm(1.0),
    "adaptive_grad_clip": lambda: oc.adaptive_grad_clip(0.1),
    "auto_clip": lambda: oc.auto_clip(50.0, history=4),
    "zclip": lambda: oc.zclip(warmup_steps=1),
    "adagc": lambda: oc.adagc(warmup_steps=1),
    "skip_step": lambda: oc.skip_step(oc.clip_by_global_norm(1.0), max_norm=100.0),
    "dynamic_loss_scale": lambda: oc.dynamic_loss_scale(4.0),
}


@pytest.mark.parametrize("name", TRANSFORMS)
def test_python_float_leaves_are_scalar_arrays(name):
  # Optax's clippers crash on them (clip_by_global_norm: 'float' object has
  # no attribute 'dtype'); optaxclip treats them as jit does, as scalar
  # float32 arrays, eagerly too. Python ints are integer leaves: untouched.
  tx = TRANSFORMS[name]()
  tree = mixed_tree()
  state = tx.init(tree)
  eager = tx.update(tree, state, tree)
  jitted = jax.jit(tx.update)(tree, state, tree)
  arrays = tx.update(as_arrays(tree), state, as_arrays(tree))
  for a, b in ((eager, jitted), (eager, arrays)):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(
        np.asarray(x), np.asarray(y)), a, b)
  if name != "skip_step":  # its select makes every leaf an array
    assert eager[0]["i"] == 3 and type(eager[0]["i"]) is int
  assert isinstance(eager[0]["f"], jax.Array) and eager[0]["f"].dtype == jnp.float32


FUNCTIONS = {
    "global_norm": lambda t: F.global_norm(t),
    "global_norm_ord3": lambda t: F.global_norm(t, ord=3),
    "all_finite": lambda t: F.all_finite(t),
    "clip_by_value": lambda t: F.clip_by_value(t, 0.5),
    "clip_by_norm": lambda t: F.clip_by_norm(t, 1.0),
    "clip_by_global_norm": lambda t: F.clip_by_global_norm(t, 1.0),
    "adaptive_grad_clip": lambda t: F.adaptive_grad_clip(t, t, 0.1),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_functions_take_python_float_leaves(name):
  fn = FUNCTIONS[name]
  tree = mixed_tree()
  eager, jitted, arrays = fn(tree), jax.jit(fn)(tree), fn(as_arrays(tree))
  for a, b in ((eager, jitted), (eager, arrays)):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(
        np.asarray(x), np.asarray(y)), a, b)


# --- state=None (issue 14) -----------------------------------------------------

@pytest.mark.parametrize("name", ["clip_by_norm", "clip_by_global_norm",
                                  "clip_grad_norm", "adaptive_grad_clip",
                                  "clip_by_value"])
def test_fixed_threshold_clippers_take_state_none_as_a_fresh_state(name):
  # As optax's clippers (whose state is empty) do: the state only logs.
  tx = TRANSFORMS[name]()
  grads = grads_at(3)
  with_none = tx.update(grads, None, PARAMS)
  fresh = tx.update(grads, tx.init(PARAMS), PARAMS)
  jax.tree.map(np.testing.assert_array_equal, with_none[0], fresh[0])
  if name != "clip_by_value":  # stateless: the given state comes back
    jax.tree.map(np.testing.assert_array_equal, with_none[1], fresh[1])


# --------------------------------------------------------------------------
# Callables that optax.inject_hyperparams would call as schedules, and
# integral values injected as floats (issue 20)

def _every_3d(grads):
  return jax.tree.map(lambda x: 0 if x.ndim == 3 else None, grads)


STACK = {"w": jnp.stack([jnp.ones((2, 2)), 100 * jnp.ones((2, 2))])}

LAYER_BUILDERS = {
    "clip_by_norm": (oc.clip_by_norm, {"max_norm": 1.0}),
    "clip_by_global_norm": (oc.clip_by_global_norm, {"max_norm": 1.0, "leaf_norms": True}),
    "clip_by_block_rms": (oc.clip_by_block_rms, {"threshold": 1.0}),
    "adaptive_grad_clip": (oc.adaptive_grad_clip, {"clipping": 0.1}),
    "adagc": (oc.adagc, {}),
    "zclip": (oc.zclip, {"leaf_norms": True}),
    "skip_step": (oc.skip_step, {"inner": optax.sgd(0.1), "leaf_norms": True}),
}


# Every structural argument of every transform (the axes norms keep, labels,
# mesh axes, modes): under optax.inject_hyperparams, what a number or a
# schedule becomes never reaches one, whatever the factory calls it (issue 27).
STRUCTURAL = {
    "clip_by_norm": ("layer_axis", "axis_name", "specs", "nonfinite", "leaf_norms"),
    "clip_by_global_norm": ("layer_axis", "groups", "axis_name", "specs", "nonfinite",
                            "leaf_norms"),
    "clip_grad_norm": ("layer_axis", "axis_name", "specs", "leaf_norms",
                       "error_if_nonfinite"),
    "clip_by_block_rms": ("layer_axis", "axis_name", "specs"),
    "adaptive_grad_clip": ("layer_axis", "axis", "axis_name", "specs"),
    "adagc": ("layer_axis", "axis_name", "specs"),
    "zclip": ("layer_axis", "axis_name", "specs", "leaf_norms", "mode", "clip_option",
              "skip_update_on_spike"),
    "auto_clip": ("axis_name", "specs"),
    "skip_step": ("layer_axis", "axis_name", "specs", "leaf_norms", "nonfinite",
                  "two_sided", "update_norm"),
    "dynamic_loss_scale": ("axis_name", "consecutive_hysteresis",
                           "raise_error_at_min_scale"),
}
BUILDERS = {**LAYER_BUILDERS, "clip_grad_norm": (oc.clip_grad_norm, {"max_norm": 1.0}),
            "auto_clip": (oc.auto_clip, {"history": 4}),
            "dynamic_loss_scale": (oc.dynamic_loss_scale, {})}
# What inject_hyperparams makes of the value it is given: a number becomes an
# array; a callable becomes what it returns for the step count.
CARRIED = {"a number": 0, "a callable returning an int": lambda tree: 1,
           "a callable returning None": _every_3d}


@pytest.mark.parametrize("name, arg", [(name, arg) for name, args in STRUCTURAL.items()
                                       for arg in args])
def test_injected_structural_arguments_are_refused_whatever_their_name(name, arg):
  builder, kwargs = BUILDERS[name]
  for what, carried in CARRIED.items():
    for factory_arg in (arg, "carried"):  # the builder's own name, and another
      factory = lambda carried, arg=arg: builder(**{**kwargs, arg: carried})  # noqa: E731
      inject = optax.inject_hyperparams(builder if factory_arg == arg else factory)
      tx = inject(**({**kwargs, arg: carried} if factory_arg == arg else {"carried": carried}))
      names = (rf"`{name}\({arg}=\.\.\.\)` must be static Python values"
               if what != "a callable returning None" else rf"`{name}`: .*`layer_axis=`")
      with pytest.raises(TypeError, match=rf"{names}.*static_args=\('{factory_arg}',\)"):
        tx.init(STACK)


def _issue_27_factory(learning_rate, max_norm, per_layer):
  return optax.chain(oc.clip_by_norm(max_norm, layer_axis=per_layer), optax.sgd(learning_rate))


@pytest.mark.parametrize("per_layer", [0, _every_3d], ids=["int", "callable"])
def test_issue_27_factory_is_refused_or_clips_per_layer_with_static_args(per_layer):
  # The issue's user factory: a callable clipped layer 0 by 0.005 (the whole
  # stack's norm, 200), not by 0.5 (its own, 2). Listed in static_args, each
  # layer is clipped by its own norm, and max_norm stays injectable.
  tx = optax.inject_hyperparams(_issue_27_factory)(
      learning_rate=0.1, max_norm=1.0, per_layer=per_layer)
  with pytest.raises(TypeError, match=r"layer_axis.*static_args=\('per_layer',\)"):
    tx.init(STACK)
  tx = optax.inject_hyperparams(_issue_27_factory, static_args=("per_layer",))(
      learning_rate=0.1, max_norm=1.0, per_layer=per_layer)
  update = jax.jit(tx.update)
  state = tx.init(STACK)
  updates, state = update(STACK, state, STACK)
  factors = updates["w"] / (-0.1 * STACK["w"])
  np.testing.assert_allclose(factors[:, 0, 0], [0.5, 0.005], rtol=1e-6)
  state.hyperparams["max_norm"] = jnp.asarray(2.0, state.hyperparams["max_norm"].dtype)
  updates, _ = update(STACK, state, STACK)
  factors = updates["w"] / (-0.1 * STACK["w"])
  np.testing.assert_allclose(factors[:, 0, 0], [1.0, 0.01], rtol=1e-6)


@pytest.mark.parametrize("builder, arg", [
    (oc.adagc, "warmup_steps"), (oc.zclip, "warmup_steps"),
    (oc.dynamic_loss_scale, "period"), (oc.skip_step, "warmup_steps"),
    (oc.auto_clip, "history")])
def test_integral_floats_are_accepted_as_integers(builder, arg):
  kwargs = {"inner": optax.sgd(0.1)} if builder is oc.skip_step else {}
  grads = {"w": jnp.ones(3)}
  for value in (3.0, np.float32(3.0), jnp.float32(3.0)):
    tx = builder(**kwargs, **{arg: value})
    tx.update(grads, tx.init(grads), grads)
  tx = optax.inject_hyperparams(builder, hyperparam_dtype=jnp.float32)(
      **kwargs, **{arg: lambda count: jnp.float32(3)})
  if arg in ("warmup_steps", "history") and builder in (oc.zclip, oc.auto_clip):
    return  # a buffer length: a schedule cannot size the state (static_args)
  state = tx.init(grads)
  jax.jit(tx.update)(grads, state, grads)
  with pytest.raises(TypeError, match=rf"`\w+\({arg}=\.\.\.\)` must be an int"):
    builder(**kwargs, **{arg: 2.5})
