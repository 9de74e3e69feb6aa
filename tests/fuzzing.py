"""Hypothesis strategies and references for the fuzz and property tests:
random trees (a few fixed templates, so that compiled norms are reused),
random values from subnormal to 3e38 with NaN/Inf injected, and, per public
transform, its valid hyperparameters and bad ones (``SPECS``).

Used by ``test_fuzz.py`` (every transform through one table) and by the
property tests of single transforms (``test_global_norm.py``,
``test_clip_by_*.py``, ``test_per_example.py``).
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import optaxclip as oc

F = oc.functional


def fuzz_settings(examples: int) -> settings:
  # Deterministic for CI: the same examples every run, nothing stored.
  return settings(max_examples=examples, derandomize=True, deadline=None,
                  database=None, suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------------------
# Trees: a few fixed templates (each new structure costs a compile).

@dataclasses.dataclass(frozen=True)
class Float:
  """A floating leaf of the template: its values are drawn."""
  shape: tuple[int, ...]
  dtype: Any


@dataclasses.dataclass(frozen=True)
class PyFloat:
  """A Python float leaf (as optax accepts)."""


F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
TEMPLATES = {
    "mixed": {"dense": {"w": Float((2, 3), F32), "b": Float((3,), BF16)},
              "half": Float((4,), F16), "scalar": Float((), F32),
              "none": None, "masked": optax.MaskedNode(),
              "step": np.array([3, 7], np.int32), "flag": np.array(True)},
    "f32": [Float((5,), F32), Float((2, 2), F32)],
    "bf16": {"a": Float((2, 3), BF16)},
    "f16_scalar": Float((), F16),
    "empty": {},
    "no_float": {"step": np.arange(3, dtype=np.int32), "none": None,
                 "masked": optax.MaskedNode()},
    "py_float": {"x": PyFloat(), "w": Float((3,), F32)},
}


# The float leaves hold at most 14 entries of magnitude <= 1e36, so every
# norm (even for ord=0.5: (14 * 1e18)**2) is below float32's maximum.
EXPONENTS = [-45, -39, -30, -20, -8, -1, 0, 0, 2, 5, 19, 30, 36]
INJECTIONS = ["none", "none", "nan", "inf", "-inf", "huge"]
MULTIPLIERS = [1.0, 1.0, 0.0, 0.5, -1.0, 1e-3]
ORDERS = [1, 2, 2.0, 3, 0.5, 1.5, 7, math.inf, "inf"]


def _is_spec(x: Any) -> bool:
  return isinstance(x, (Float, PyFloat))


def float_specs(template) -> list[Any]:
  return [x for x in jax.tree.leaves(template, is_leaf=_is_spec) if _is_spec(x)]


def cast(values: np.ndarray, dtype) -> np.ndarray:
  """float64 values in ``dtype``, saturated to its finite range."""
  big = float(jnp.finfo(dtype).max)
  return np.asarray(jnp.asarray(np.clip(values, -big, big), dtype))


@dataclasses.dataclass
class Case:
  """One drawn input: a template with float64 values for its float leaves."""
  template: str
  values: list[np.ndarray]  # one per Float/PyFloat leaf, in tree order
  injection: str
  where: tuple[int, int]  # (float leaf, flat index) of the injection

  def tree(self, multiplier: float = 1.0, inject: bool = False):
    values = iter(self.values)

    def build(spec):
      if isinstance(spec, PyFloat):  # saturated to float32, as JAX will read it
        return float(cast(np.float64(next(values) * multiplier), jnp.float32))
      if isinstance(spec, Float):
        return jnp.asarray(cast(next(values) * multiplier, spec.dtype), spec.dtype)
      return jnp.asarray(spec)

    leaves = [build(spec) for spec in jax.tree.leaves(
        TEMPLATES[self.template], is_leaf=_is_spec)]
    tree = jax.tree.unflatten(jax.tree.structure(
        TEMPLATES[self.template], is_leaf=_is_spec), leaves)
    if inject and self.injection != "none":
      tree = inject_into(tree, self.injection, self.where)
    return tree


def inject_into(tree, kind: str, where: tuple[int, int]):
  leaves, treedef = jax.tree.flatten(tree)
  spots = [i for i, x in enumerate(leaves) if isinstance(x, float) or (
      hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating))]
  if not spots:
    return tree
  i = spots[where[0] % len(spots)]
  x = leaves[i]
  dtype = np.float32 if isinstance(x, float) else x.dtype
  value = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf,
           "huge": 0.88 * float(jnp.finfo(dtype).max)}[kind]
  if isinstance(x, float):
    leaves[i] = value
  else:
    flat = x.reshape(-1)
    leaves[i] = flat.at[where[1] % flat.size].set(value).reshape(x.shape)
  return treedef.unflatten(leaves)


@st.composite
def cases(draw, templates=tuple(TEMPLATES)):
  template = draw(st.sampled_from(templates))
  injection = draw(st.sampled_from(INJECTIONS))
  values = []
  for spec in float_specs(TEMPLATES[template]):
    shape = () if isinstance(spec, PyFloat) else spec.shape
    exponent = draw(st.sampled_from(EXPONENTS))
    if injection == "huge":  # one entry near the maximum, the rest ordinary
      exponent = min(exponent, 0)
    unit = draw(hnp.arrays(np.float64, shape, elements=st.floats(-1, 1)))
    values.append(unit * 10.0**exponent)
  where = (draw(st.integers(0, 7)), draw(st.integers(0, 15)))
  return Case(template, values, injection, where)


# ---------------------------------------------------------------------------
# Reference numbers, in float64 (norms: helpers.np_norm).

def is_clippable(x: Any) -> bool:
  if isinstance(x, float):
    return True
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def clippable(tree) -> list[np.ndarray]:
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)
          if is_clippable(x)]


def all_finite(tree) -> bool:
  return all(np.all(np.isfinite(v)) for v in clippable(tree))


def has_nan(tree) -> bool:
  return any(np.any(np.isnan(v)) for v in clippable(tree))


def signature(tree):
  """Shape, dtype and weak type of every array leaf (what jit caches on)."""
  def sig(x):
    if isinstance(x, float):
      return ("python float",)
    return (jnp.shape(x), jnp.result_type(x), getattr(x, "weak_type", None))
  return jax.tree.map(sig, tree)


def assert_named_error(error: BaseException, fn: str, arg: str) -> None:
  """A ValueError/TypeError whose message names the function and argument."""
  assert isinstance(error, (ValueError, TypeError)), (
      f"{type(error).__name__} instead of a ValueError/TypeError: {error}")
  message = str(error)
  assert fn in message and arg in message, (
      f"the message does not name `{fn}` and `{arg}`: {message!r}")


# ---------------------------------------------------------------------------
# Hyperparameters: what is valid and what is not, per transform.

TINY = 1e-30


def forms(values: st.SearchStrategy) -> st.SearchStrategy:
  """A valid number as Python float, numpy scalar or concrete JAX array."""
  return values.flatmap(lambda v: st.sampled_from(
      [v, np.float64(v), np.float32(v), jnp.asarray(v, jnp.float32)]))


def nonneg(high: float = 1e6) -> st.SearchStrategy:
  return forms(st.one_of(st.just(0.0), st.sampled_from([TINY, 1.0, high]),
                         st.floats(1e-6, high)))


def unit(include_one: bool = True) -> st.SearchStrategy:
  high = 1.0 if include_one else 0.999
  return forms(st.one_of(st.sampled_from([0.0, high]), st.floats(0.0, high)))


NOT_NUMBERS = ["1.0", True, [1.0], np.ones(2), jnp.ones(2), 1j]
NEGATIVE = [-1.0, -1e-30, np.float32(-2.0), jnp.asarray(-1.0), -math.inf, math.nan,
            jnp.asarray(math.nan)]
NOT_FINITE = [math.inf, jnp.asarray(math.inf)]
BAD_ORDERS = [0, -2, math.nan, "two", None, jnp.asarray(-1.0), jnp.asarray(0.0)]
BAD_INTS = [1.5, "3", True, None]


@dataclasses.dataclass(frozen=True)
class Spec:
  """How the fuzz builds and judges one public transform."""
  fn: str
  build: Callable[..., optax.GradientTransformation]
  valid: st.SearchStrategy  # of kwargs dicts
  invalid: dict[str, list[Any]]  # argument -> bad values (others valid)
  base: dict[str, Any]  # valid kwargs the invalid ones are put into
  norm_ord: Callable[[dict], Any] | None = None  # the order of state.norm
  per_leaf: bool = False  # state.norm is the largest leaf norm
  adaptive: tuple[str, ...] = ()  # statistics a NaN step must not touch
  cross: tuple[dict[str, Any], ...] = ()  # invalid combinations


def _value_kwargs() -> st.SearchStrategy:
  # Bounds may be infinite outward: inf above, -inf below (no bound).
  bounds = st.tuples(st.floats(-1e6, 1e6) | st.just(-math.inf),
                     st.floats(-1e6, 1e6) | st.just(math.inf)).map(sorted)
  return st.one_of(
      (nonneg() | st.just(math.inf)).map(lambda hi: {"max_value": hi}),
      bounds.map(lambda b: {"max_value": b[1], "min_value": b[0]}))


def _norm_kwargs(max_norms) -> st.SearchStrategy:
  return st.fixed_dictionaries({
      "max_norm": max_norms, "ord": st.sampled_from(ORDERS),
      "eps": st.one_of(st.just(0.0), nonneg(1e-3)),
      "nonfinite": st.sampled_from(["propagate", "zero", "raise"])})


# Thresholds are numbers >= 0, or inf: measure the norm, never clip.
MAX_NORMS = st.one_of(nonneg(1e30), st.just(1.0), st.just(math.inf))
NORM_INVALID = {"max_norm": NEGATIVE + NOT_NUMBERS + [None], "ord": BAD_ORDERS,
                "eps": NEGATIVE + NOT_FINITE + ["0"],
                "nonfinite": ["skip", None, True], "axis_name": [1.5, [None]],
                "specs": [P(), {"w": P()}]}  # specs without axis_name
INNERS = {
    "identity": optax.identity(),
    "clip": oc.clip_by_global_norm(1.0),
    "clip_value": optax.chain(oc.clip_by_norm(0.5), oc.clip_by_value(0.3)),
    "loss_scale": optax.chain(oc.dynamic_loss_scale(16.0, period=2),
                              optax.identity()),
}
SPECS = {
    "clip_by_value": Spec(
        "clip_by_value", lambda **k: oc.clip_by_value(**k), _value_kwargs(),
        {"max_value": [-1.0, math.nan, -math.inf, "0.1", None, np.ones(2),
                       jnp.asarray(-1.0)],
         "min_value": [math.nan, math.inf, "0", 2.0, jnp.asarray(2.0)]},
        {"max_value": 1.0},
        cross=({"max_value": 1.0, "min_value": jnp.asarray(2.0)},)),
    "clip_by_norm": Spec(
        "clip_by_norm", lambda **k: oc.clip_by_norm(**k),
        _norm_kwargs(MAX_NORMS), NORM_INVALID, {"max_norm": 1.0},
        norm_ord=lambda k: k["ord"], per_leaf=True),
    "clip_by_global_norm": Spec(
        "clip_by_global_norm", lambda **k: oc.clip_by_global_norm(**k),
        _norm_kwargs(MAX_NORMS), NORM_INVALID,
        {"max_norm": 1.0}, norm_ord=lambda k: k["ord"]),
    "clip_grad_norm": Spec(
        "clip_grad_norm", lambda **k: oc.clip_grad_norm(**k),
        st.fixed_dictionaries({
            "max_norm": MAX_NORMS, "norm_type": st.sampled_from(ORDERS),
            "error_if_nonfinite": st.booleans()}),
        {"max_norm": NEGATIVE + NOT_NUMBERS, "norm_type": BAD_ORDERS,
         "error_if_nonfinite": ["yes", None, 1], "specs": [P()]},
        {"max_norm": 1.0}, norm_ord=lambda k: k["norm_type"]),
    "adaptive_grad_clip": Spec(
        "adaptive_grad_clip", lambda **k: oc.adaptive_grad_clip(**k),
        st.fixed_dictionaries({"clipping": nonneg(10.0), "eps": nonneg(1.0),
                               "axis": st.sampled_from([None, 0, -1])}),
        {"clipping": NEGATIVE + NOT_NUMBERS + NOT_FINITE, "eps": NEGATIVE + NOT_FINITE,
         "axis": [1.5, "0", jnp.asarray(0)], "axis_name": ["x"]},
        {"clipping": 0.1}),
    "auto_clip": Spec(
        "auto_clip", lambda **k: oc.auto_clip(**k),
        st.fixed_dictionaries({
            "percentile": forms(st.floats(0, 100)),
            "history": st.sampled_from([1, 2, 3, 8]),
            "eps": st.one_of(st.just(0.0), nonneg(1e-3))}),
        {"percentile": NEGATIVE + [101.0, jnp.asarray(-50.0), jnp.asarray(150.0)],
         "history": [0, -1, jnp.asarray(0)] + BAD_INTS,
         "eps": NEGATIVE + NOT_FINITE, "specs": [P()]},
        {}, norm_ord=lambda k: 2,
        adaptive=("norms", "position", "size")),
    "zclip": Spec(
        "zclip", lambda **k: oc.zclip(**k),
        st.fixed_dictionaries({
            "alpha": unit(), "z_thresh": nonneg(10.0),
            "max_grad_norm": st.none() | MAX_NORMS,
            "eps": nonneg(1e-3), "warmup_steps": st.sampled_from([1, 2, 3]),
            "mode": st.sampled_from(["zscore", "percentile"]),
            "clip_option": st.sampled_from(["adaptive_scaling", "mean"]),
            "clip_factor": nonneg(10.0),
            "skip_update_on_spike": st.booleans()}),
        {"alpha": NEGATIVE + [2.0, jnp.asarray(2.0)], "z_thresh": NEGATIVE + NOT_FINITE,
         "max_grad_norm": NEGATIVE, "eps": NEGATIVE + NOT_FINITE,
         "warmup_steps": [0, -3, jnp.asarray(0)] + BAD_INTS,
         "mode": ["z", None], "clip_option": ["max", None],
         "clip_factor": NEGATIVE + NOT_FINITE, "skip_update_on_spike": ["yes", 1, None],
         "specs": [P()]},
        {}, norm_ord=lambda k: 2,
        adaptive=("mean", "std", "warmup_norms", "collected")),
    "adagc": Spec(
        "adagc", lambda **k: oc.adagc(**k),
        st.fixed_dictionaries({
            "lambda_abs": nonneg(10.0) | st.just(math.inf), "lambda_rel": nonneg(10.0),
            "beta": unit(), "warmup_steps": st.sampled_from([1, 2, 3]),
            "eps": st.one_of(st.just(0.0), nonneg(1e-3))}),
        {"lambda_abs": NEGATIVE, "lambda_rel": NEGATIVE + NOT_FINITE,
         "beta": NEGATIVE + [1.5, jnp.asarray(-1.0), jnp.asarray(2.0)],
         "warmup_steps": [0, jnp.asarray(0)] + BAD_INTS, "eps": NEGATIVE + NOT_FINITE,
         "specs": [P()]},
        {}, norm_ord=lambda k: 2, adaptive=("gamma",)),
    "skip_step": Spec(
        "skip_step", lambda inner, **k: oc.skip_step(
            INNERS[inner] if isinstance(inner, str) and inner in INNERS else inner, **k),
        st.fixed_dictionaries({
            "inner": st.sampled_from(list(INNERS)),
            "nonfinite": st.booleans(),
            "max_norm": st.none() | MAX_NORMS,
            "zscore": st.one_of(st.none(), nonneg(10.0)),
            "ema_decay": unit(include_one=False),
            "warmup_steps": st.sampled_from([0, 1, 2, 5]),
            "ord": st.sampled_from(ORDERS)}),
        {"inner": ["adam", None, optax.adam], "nonfinite": ["yes", 1, None],
         "max_norm": NEGATIVE, "zscore": NEGATIVE,
         "ema_decay": NEGATIVE + [1.0, 2.0, jnp.asarray(1.5)],
         "warmup_steps": [-1, jnp.asarray(-1)] + BAD_INTS[:3], "ord": BAD_ORDERS,
         "axis_name": [1.5], "specs": [P()]},
        {"inner": "identity"}, norm_ord=lambda k: k["ord"],
        adaptive=("norm_mean", "norm_var", "ema_count")),
    "dynamic_loss_scale": Spec(
        "dynamic_loss_scale", lambda **k: oc.dynamic_loss_scale(**k),
        st.tuples(
            forms(st.one_of(st.sampled_from([2.0**-20, 1.0, 2.0**15, 2.0**100,
                                             2.0**127]),
                            st.floats(1e-6, 1e30))),
            st.sampled_from([1, 2, 3, 2000]),
            forms(st.one_of(st.sampled_from([1.0, 2.0]), st.floats(1.0, 1e3))),
            st.floats(0.01, 1.0),
        ).map(lambda t: {"initial_scale": t[0], "period": t[1], "factor": t[2],
                         "min_scale": float(t[0]) * t[3]}),
        {"initial_scale": [0.0, jnp.asarray(0.0), 2.0**128] + NEGATIVE + NOT_FINITE +
                          NOT_NUMBERS,
         "period": [0, -1, jnp.asarray(0)] + BAD_INTS,
         "factor": [0.5, 0.0, jnp.asarray(0.5)] + NEGATIVE + NOT_FINITE,
         "min_scale": [0.0, jnp.asarray(0.0)] + NEGATIVE, "axis_name": [1.5]},
        {}, cross=({"initial_scale": 1.0, "min_scale": jnp.asarray(2.0)},
                   {"initial_scale": jnp.asarray(1.0), "min_scale": 2.0})),
}
NAMES = list(SPECS)


@dataclasses.dataclass(frozen=True)
class BadArg:
  arg: str
  value: Any


def bad_arguments(spec: Spec) -> st.SearchStrategy:
  return st.sampled_from([BadArg(arg, value) for arg, values in
                          spec.invalid.items() for value in values])


def params_like(tree):
  """Parameters for ``tree`` (AGC and adagc need them): 0.5 everywhere."""
  return jax.tree.map(
      lambda x: 0.5 if isinstance(x, float) else (
          jnp.full_like(x, 0.5) if is_clippable(x) else x), tree)


# ---------------------------------------------------------------------------
# Small float32 trees for the clipping invariants (one structure: one
# compile per order).

SMALL_SHAPES = [(3,), (2, 4)]  # one tree structure: each new one costs a compile
SMALL_ORDERS = [1.0, 2.0, 3.0, math.inf]
SMALL_SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def small_trees(draw):
  exponent = draw(st.integers(-6, 6))  # magnitudes 1e-6 .. 1e6
  leaves = []
  for shape in SMALL_SHAPES:
    values = draw(hnp.arrays(np.float32, shape, elements=st.floats(
        -10, 10, width=32, allow_subnormal=False)))
    values = values * np.float32(10.0 ** exponent)
    # XLA on CPU flushes subnormals to zero; keep clear of that range.
    values[np.abs(values) < 1e-30] = 0
    leaves.append(jnp.asarray(values))
  return leaves


# 0, or 2**-20..1e5: a factor below the smallest normal float (max_norm under
# ~1e-38 times the norm) flushes to zero, a documented limit.
thresholds = st.one_of(st.just(0.0),
                        st.floats(2.0**-20, 1e5, width=32))


@functools.cache
def jitted_clip(fn, ord, **kwargs):
  """``jit(fn)(tree, max_norm)`` of a functional clip for ``ord`` (and
  ``kwargs``): one compile per setting, however many examples."""
  return jax.jit(lambda tree, max_norm: fn(tree, max_norm, ord=ord, **kwargs))


@functools.cache
def jitted_norm(ord):
  return jax.jit(lambda tree: F.global_norm(tree, ord))
