"""Bad arguments fail with an error naming the function, the argument and the
value, and saying what to do: one table for every public name.

Each row is ``(public name, keyword arguments, exception, regex)``: the call
``CALLS[name](**kwargs)`` must raise the exception, with a message matching
the regex (which names the argument). Transform builders fail when built;
``<name>.update`` rows call ``update`` on a transform built with its
defaults, on a small gradient tree, its fresh state and params, with the
row's arguments instead.
"""

import math
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optaxclip as oc

F = oc.functional
GRADS = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
QK_HEADS = oc.AttentionHeads(query="w", key="b", head_axis=-1)

# Each builder and the arguments it is built with unless a row says otherwise.
FACTORIES = {
    "clip_by_value": (oc.clip_by_value, {"max_value": 1.0}),
    "clip_by_norm": (oc.clip_by_norm, {"max_norm": 1.0}),
    "clip_by_global_norm": (oc.clip_by_global_norm, {"max_norm": 1.0}),
    "clip_grad_norm": (oc.clip_grad_norm, {"max_norm": 1.0}),
    "clip_by_block_rms": (oc.clip_by_block_rms, {"threshold": 1.0}),
    "adaptive_grad_clip": (oc.adaptive_grad_clip, {"clipping": 0.1}),
    "auto_clip": (oc.auto_clip, {"history": 4}),
    "zclip": (oc.zclip, {"warmup_steps": 2}),
    "adagc": (oc.adagc, {"warmup_steps": 2}),
    "skip_step": (oc.skip_step, {"inner": optax.sgd(0.1)}),
    "dynamic_loss_scale": (oc.dynamic_loss_scale, {}),
    "microbatch_guard": (oc.microbatch_guard, {}),
}
BUILDERS = {name: (lambda factory, defaults: lambda **k: factory(**{**defaults, **k}))(
    factory, defaults) for name, (factory, defaults) in FACTORIES.items()}
FUNCTIONS = {
    "global_norm": lambda **k: F.global_norm(**{"tree": GRADS, **k}),
    "all_finite": lambda **k: F.all_finite(**{"tree": GRADS, **k}),
    "F.clip_by_value": lambda **k: F.clip_by_value(
        **{"tree": GRADS, "max_value": 1.0, **k}),
    "F.clip_by_norm": lambda **k: F.clip_by_norm(
        **{"tree": GRADS, "max_norm": 1.0, **k}),
    "F.clip_by_global_norm": lambda **k: F.clip_by_global_norm(
        **{"tree": GRADS, "max_norm": 1.0, **k}),
    "F.clip_by_block_rms": lambda **k: F.clip_by_block_rms(
        **{"tree": GRADS, "threshold": 1.0, **k}),
    "F.adaptive_grad_clip": lambda **k: F.adaptive_grad_clip(
        **{"updates": GRADS, "params": GRADS, "clipping": 0.1, **k}),
    "per_example_clip_by_global_norm": lambda **k: F.per_example_clip_by_global_norm(
        **{"grads": [jnp.ones((4, 2))], "max_norm": 1.0, **k}),
    "per_example_clip_by_layer_norm": lambda **k: F.per_example_clip_by_layer_norm(
        **{"grads": [jnp.ones((4, 2))], "max_norm": 1.0, **k}),
    "F.unitwise_norm": lambda **k: F.unitwise_norm(**{"x": GRADS["w"], **k}),
    "F.unitwise_clip": lambda **k: F.unitwise_clip(**{
        "g_norm": GRADS["w"], "max_norm": GRADS["w"], "grad": GRADS["w"], **k}),
    "loss_scale": oc.loss_scale,
    "partial_norm": lambda **k: F.partial_norm(**{"tree": GRADS, **k}),
    "combine_norms": F.combine_norms,
    "combine_leaf_norms": F.combine_leaf_norms,
    "clip_stage": lambda **k: F.clip_stage(**{
        "tree": GRADS, "max_norm": 1.0, "partial": F.partial_norm(GRADS),
        "per_layer": True, **k}),
    "qk_clip": lambda **k: oc.qk_clip(**{"heads": QK_HEADS, **k}),
    "F.qk_clip": lambda **k: F.qk_clip(
        **{"params": GRADS, "max_logits": jnp.ones(3), "heads": QK_HEADS, **k}),
    "check_stall": lambda **k: oc.check_stall(**{"opt_state": {}, **k}),
    "along": lambda **k: oc.along(**{"label": "experts", "axis": 0, **k}),
}


def _update(name):
  def call(**kwargs):
    tx = BUILDERS[name]()
    args = {"updates": GRADS, "state": tx.init(GRADS), "params": GRADS, **kwargs}
    return tx.update(**args)
  return call


def _init(name):
  """Builds with the row's arguments and calls ``init``: for what only
  the gradients' tree can tell (a layer axis out of range, a prefix)."""
  def call(**kwargs):
    return BUILDERS[name](**kwargs).init(GRADS)
  return call


CALLS = {**BUILDERS, **FUNCTIONS,
         **{f"{name}.update": _update(name) for name in BUILDERS},
         **{f"{name}.init": _init(name) for name in BUILDERS}}


def _name(name):
  """How the messages name ``name``: without ``F.`` or ``.update``."""
  return re.escape(name.removeprefix("F.").removesuffix(".update")
                   .removesuffix(".init"))


def _arg(name, arg):
  return rf"`{_name(name)}\({arg}=\.\.\.\)`"


def _rows(names, arg, cases):
  """Rows for ``arg`` of each of ``names``: ``cases`` are ``(value, error,
  rest of the message)``, the message starting with the argument."""
  return [(name, {arg: value}, error, _arg(name, arg) + rest)
          for name in names for value, error, rest in cases]


THRESHOLDS = ["clip_by_norm", "clip_by_global_norm", "clip_grad_norm",
              "F.clip_by_norm", "F.clip_by_global_norm",
              "per_example_clip_by_global_norm", "per_example_clip_by_layer_norm",
              "clip_stage"]
ORDERS = ["clip_by_norm", "clip_by_global_norm", "F.clip_by_norm",
          "F.clip_by_global_norm", "global_norm", "skip_step",
          "per_example_clip_by_global_norm", "partial_norm"]
EPS = ["clip_by_norm", "clip_by_global_norm", "F.clip_by_norm",
       "F.clip_by_global_norm", "adaptive_grad_clip", "F.adaptive_grad_clip",
       "auto_clip", "zclip", "adagc", "clip_stage"]
SPECS = ["clip_by_norm", "clip_by_global_norm", "clip_grad_norm",
         "clip_by_block_rms", "F.clip_by_block_rms",
         "adaptive_grad_clip", "auto_clip", "zclip", "adagc", "skip_step",
         "F.clip_by_norm", "F.clip_by_global_norm", "F.adaptive_grad_clip",
         "global_norm", "per_example_clip_by_global_norm",
         "per_example_clip_by_layer_norm"]
LAYER_AXIS = ["adaptive_grad_clip", "F.adaptive_grad_clip", "clip_by_block_rms",
              "F.clip_by_block_rms", "adagc", "per_example_clip_by_layer_norm",
              "F.unitwise_norm"]
STATEFUL = {"auto_clip": "AutoClipState", "zclip": "ZClipState",
            "adagc": "AdaGCState", "skip_step": "SkipState",
            "dynamic_loss_scale": "LossScaleState",
            "clip_by_norm": "ClipState", "clip_by_global_norm": "ClipState",
            "clip_grad_norm": "ClipState", "adaptive_grad_clip": "AGCState",
            "clip_by_block_rms": "BlockRMSState"}
# Accept state=None as a fresh state, as optax's stateless clippers do.
STATELESS_USE = {"clip_by_norm", "clip_by_global_norm", "clip_grad_norm",
                 "adaptive_grad_clip", "clip_by_block_rms"}

# Values every real-number argument refuses, and how the message shows them.
NOT_A_NUMBER = [
    ("1.0", TypeError, r" must be a real number, got '1.0' of type str"),
    (True, TypeError, r" must be a real number, got True"),
    ([1.0], TypeError, r" must be a real number, got \[1.0\] of type list"),
    (np.ones(2), TypeError, r" must be a scalar, got an array of shape \(2,\)"),
    (jnp.ones(2), TypeError, r" must be a scalar, got an array of shape \(2,\)"),
    (jnp.array(1 + 1j), TypeError, r" must be a real number, got an array of dtype complex64"),
    (jnp.array(True), TypeError, r" must be a real number, got an array of dtype bool"),
]
NEGATIVE = [
    (-1.0, ValueError, r" must be a number >= 0 or inf, got -1.0"),
    (math.nan, ValueError, r" must be a number >= 0 or inf, got nan"),
    (-math.inf, ValueError, r" must be a number >= 0 or inf, got -inf"),
    # Concrete arrays are checked like numbers (issue 11).
    (jnp.array(-1.0), ValueError, r" must be a number >= 0 or inf, got Array\(-1\."),
    (np.float32(-1.0), ValueError, r" must be a number >= 0 or inf, got .*-1\.0"),
    (np.array(math.nan), ValueError, r" must be a number >= 0 or inf, got array\(nan\)"),
]
NEGATIVE_FINITE = [
    (-1e-6, ValueError, r" must be a finite number >= 0, got -1e-06"),
    (math.inf, ValueError, r" must be a finite number >= 0, got inf"),
    (math.nan, ValueError, r" must be a finite number >= 0, got nan"),
    (jnp.array(-1.0), ValueError, r" must be a finite number >= 0, got Array\(-1\."),
]
ORD = [
    (0, ValueError, r" must be a number > 0 or 'inf', got 0"),
    (-2, ValueError, r" must be a number > 0 or 'inf', got -2"),
    (math.nan, ValueError, r" must be a number > 0 or 'inf', got nan"),
    ("two", ValueError, r" must be a number > 0 or 'inf', got 'two'"),
    (None, TypeError, r" must be a real number, got None"),
    (jnp.array(0.0), ValueError, r" must be a number > 0 or 'inf', got Array\(0\."),
]
UNIT = [
    (1.5, ValueError, r" must be a number in \[0, 1\], got 1.5"),
    (-0.1, ValueError, r" must be a number in \[0, 1\], got -0.1"),
    (math.nan, ValueError, r" must be a number in \[0, 1\], got nan"),
    (jnp.array(2.0), ValueError, r" must be a number in \[0, 1\], got Array\(2\."),
]
AXIS_NAME = [(1.5, TypeError, r" must be an axis name or a tuple of axis names, got 1.5")]
SPECS_ALONE = [(P(), ValueError, r" needs `axis_name`: specs say how leaves are split")]
TREE_WITH_A_STRING = {"w": jnp.ones(2), "s": "abc"}


BAD_ARGUMENTS = [
    # --- thresholds: a number >= 0, or inf (never clip) --------------------
    *_rows(THRESHOLDS, "max_norm", NEGATIVE + NOT_A_NUMBER + [
        (None, TypeError, r" must be a real number, got None")]),
    *_rows(["skip_step", "microbatch_guard"], "max_norm", NEGATIVE + NOT_A_NUMBER),
    *_rows(["clip_by_block_rms", "F.clip_by_block_rms"], "threshold", NEGATIVE + NOT_A_NUMBER + [
        (None, TypeError, r" must be a real number, got None"),
        (jnp.array(math.nan), ValueError, r" must be a number >= 0 or inf, got Array\(nan")]),
    *_rows(["qk_clip", "F.qk_clip"], "threshold", [
        (0.0, ValueError, r" must be a finite number > 0, got 0.0"),
        (-1.0, ValueError, r" must be a finite number > 0, got -1.0"),
        (float("nan"), ValueError, r" must be a finite number > 0, got nan"),
        ("1.0", TypeError, r" must be a real number, got '1.0' of type str")]),
    *_rows(["qk_clip", "F.qk_clip"], "alpha", [
        (1.0, ValueError, r" must be a number in \(0, 1\)")]),
    *_rows(["qk_clip", "F.qk_clip"], "heads", [
        ("w", TypeError, r" must be an AttentionHeads or a non-empty dict of them")]),
    *_rows(["zclip"], "max_grad_norm", NEGATIVE),
    *_rows(["adagc"], "lambda_abs", NEGATIVE),
    *_rows(["skip_step"], "zscore", NEGATIVE + [
        ("6", TypeError, r" must be a real number, got '6'")]),
    *_rows(["skip_step"], "loss_zscore", [
        (0.0, ValueError, r" must be a number > 0 or inf, got 0.0; large runs use about 6"),
        (-1.0, ValueError, r" must be a number > 0 or inf, got -1.0"),
        (math.nan, ValueError, r" must be a number > 0 or inf, got nan"),
        (jnp.array(0.0), ValueError, r" must be a number > 0 or inf, got Array\(0\."),
        ("6", TypeError, r" must be a real number, got '6'"),
        (jnp.ones(2), TypeError, r" must be a scalar, got an array of shape \(2,\)")]),
    *[("skip_step.update", {"loss": loss}, TypeError,
       r"`skip_step`: `update\(loss=\.\.\.\)` must be a " + rest)
      for loss, rest in [
          (jnp.ones(2), r"scalar \(the step's loss\), got an array of shape \(2,\); "
           r"pass one number, e.g. loss=jnp.mean\(per_example_losses\)"),
          (np.ones((1,)), r"scalar .*got an array of shape \(1,\)"),
          ("1.0", r"real scalar \(the step's loss\), got '1.0' of type str"),
          (True, r"real scalar .*got True of type bool"),
          (jnp.array(1 + 1j), r"real scalar .*got an array of dtype complex64"),
      ]],
    *_rows(THRESHOLDS[:3], "max_norm", [
        (jnp.array(math.nan), ValueError, r" must be a number >= 0 or inf, got Array\(nan")]),
    # a norm measured beforehand: >= 0; NaN and inf pass on, as norms do
    *_rows(["F.clip_by_global_norm"], "use_norm", [
        (-1.0, ValueError, r" must be a norm: a number >= 0 \(NaN and inf are "
         r"passed on as the norm of non-finite gradients\), got -1.0"),
        (-math.inf, ValueError, r" must be a norm: a number >= 0 .*, got -inf"),
        (jnp.array(-1.0), ValueError, r" must be a norm: .*, got Array\(-1\."),
    ] + NOT_A_NUMBER),
    *_rows(ORDERS + ["microbatch_guard"], "ord", ORD),
    *_rows(["clip_grad_norm"], "norm_type", ORD),
    *_rows(["partial_norm"], "prefix", [
        (1, TypeError, r" must be a str, got 1")]),
    *_rows(["partial_norm"], "layers", [
        (1.5, TypeError, r" must hold None, an int .* or a range")]),
    *_rows(["clip_stage"], "partial", [
        (1.0, TypeError, r" must be the stage's PartialNorm")]),
    *_rows(["combine_norms", "combine_leaf_norms"], "partials", [
        ([], TypeError, r" must be a non-empty list of PartialNorm"),
        ([1.0], TypeError, r" must be a non-empty list of PartialNorm")]),
    *_rows(EPS, "eps", NEGATIVE_FINITE),
    *_rows(["adaptive_grad_clip", "F.adaptive_grad_clip"], "clipping",
           NEGATIVE_FINITE + NOT_A_NUMBER[:3]),
    *_rows(["adagc"], "lambda_rel", NEGATIVE_FINITE),
    *_rows(["zclip"], "z_thresh", NEGATIVE_FINITE),
    *_rows(["zclip"], "clip_factor", NEGATIVE_FINITE),
    # --- clip_by_value: bounds are numbers, the range is not empty ----------
    *_rows(["clip_by_value", "F.clip_by_value"], "max_value", [
        (None, TypeError, r" must be a number \(the upper bound; inf for none\), "
         r"got None; only min_value may be None"),
        (-1.0, ValueError, r" must be >= 0 when min_value is None \(the range is "
         r"\[-max_value, max_value\]\), got -1.0"),
        (math.nan, ValueError, r" must be a number other than NaN and -inf, got nan"),
        (-math.inf, ValueError, r" must be a number other than NaN and -inf, got -inf"),
        ("0.1", TypeError, r" must be a real number, got '0.1'"),
        (jnp.array(-1.0), ValueError, r" must be >= 0 when min_value is None"),
        (jnp.ones(2), TypeError, r" must be a scalar, got an array of shape \(2,\)"),
    ]),
    *[(name, {"max_value": 1.0, "min_value": low}, error, _arg(name, "min_value") + rest)
      for name in ("clip_by_value", "F.clip_by_value") for low, error, rest in [
          (2.0, ValueError, r" must be <= max_value, got min_value=2.0 > max_value=1.0"),
          (math.inf, ValueError, r" must be a number other than NaN and inf, got inf"),
          (jnp.array(2.0), ValueError, r" must be <= max_value, got min_value=Array\(2"),
          ("0", TypeError, r" must be a real number, got '0'"),
      ]],
    ("F.clip_by_value", {"tree": {"z": jnp.ones(2, jnp.complex64)}}, TypeError,
     r"`clip_by_value` cannot order complex values, but leaf \['z'\] is complex64"),
    # --- modes, flags and integers ------------------------------------------
    *_rows(["clip_by_norm", "clip_by_global_norm"], "nonfinite", [
        ("skip", ValueError, r" must be one of 'propagate', 'zero', 'raise', got 'skip'"),
        (True, ValueError, r" must be one of .*, got True")]),
    *_rows(["clip_grad_norm"], "error_if_nonfinite", [
        ("yes", TypeError, r" must be a bool \(True or False\), got 'yes'")]),
    *_rows(["skip_step"], "nonfinite", [
        (1, TypeError, r" must be a bool \(True or False\), got 1")]),
    *_rows(["zclip"], "skip_update_on_spike", [
        (1, TypeError, r" must be a bool \(True or False\), got 1")]),
    *_rows(["per_example_clip_by_layer_norm"], "uniform", [
        (1, TypeError, r" must be a bool \(True or False\), got 1")]),
    *_rows(["zclip"], "mode", [
        ("median", ValueError, r" must be one of 'zscore', 'percentile', got 'median'")]),
    *_rows(["zclip"], "clip_option", [
        ("max", ValueError, r" must be one of 'adaptive_scaling', 'mean', got 'max'")]),
    *_rows(["zclip", "adagc"], "warmup_steps", [
        (0, ValueError, r" must be an int >= 1, got 0"),
        (2.5, TypeError, r" must be an int >= 1, got 2.5 of type float"),
        (None, TypeError, r" must be an int >= 1, got None"),
        (jnp.array(0), ValueError, r" must be an int >= 1, got Array\(0"),
        (jnp.ones(2, jnp.int32), TypeError, r" must be a scalar, got an array of shape"),
    ]),
    *_rows(["skip_step"], "warmup_steps", [
        (-1, ValueError, r" must be an int >= 0, got -1"),
        (2.5, TypeError, r" must be an int >= 0, got 2.5")]),
    *_rows(["auto_clip"], "history", [
        (0, ValueError, r" must be an int >= 1, got 0"),
        (2.5, TypeError, r" must be an int >= 1, got 2.5"),
        (True, TypeError, r" must be an int >= 1, got True")]),
    *_rows(["auto_clip"], "percentile", [
        (-1.0, ValueError, r" must be a number in \[0, 100\], got -1.0"),
        (101.0, ValueError, r" must be a number in \[0, 100\], got 101.0"),
        (math.nan, ValueError, r" must be a number in \[0, 100\], got nan"),
        ("10", TypeError, r" must be a real number, got '10'"),
        (jnp.array(-50.0), ValueError, r" must be a number in \[0, 100\], got Array\(-50"),
    ]),
    *_rows(["zclip"], "alpha", UNIT),
    *_rows(["adagc"], "beta", UNIT),
    *_rows(["skip_step"], "ema_decay", [
        (1.0, ValueError, r" must be a number in \[0, 1\), got 1.0"),
        (-0.5, ValueError, r" must be a number in \[0, 1\), got -0.5")]),
    *_rows(["skip_step"], "inner", [
        ("adam", TypeError, r" must be an optax GradientTransformation, got 'adam'"),
        (optax.adam, TypeError, r" must be an optax GradientTransformation, got "
         r"<function adam.*\(a factory: call it, e.g. optax.adam\(1e-3\)\)")]),
    # --- dynamic_loss_scale --------------------------------------------------
    *_rows(["dynamic_loss_scale"], "initial_scale", [
        (0.0, ValueError, r" must be a finite number > 0, got 0.0"),
        (-1.0, ValueError, r" must be a finite number > 0, got -1.0"),
        (math.inf, ValueError, r" must be a finite number > 0, got inf"),
        (jnp.array(-1.0), ValueError, r" must be a finite number > 0, got Array\(-1\."),
        (None, TypeError, r" must be a real number, got None")]),
    *_rows(["dynamic_loss_scale"], "period", [
        (0, ValueError, r" must be an int >= 1, got 0"),
        (2.5, TypeError, r" must be an int >= 1, got 2.5"),
        (True, TypeError, r" must be an int >= 1, got True")]),
    *_rows(["dynamic_loss_scale"], "factor", [
        (0.5, ValueError, r" must be a finite number >= 1, got 0.5"),
        (math.nan, ValueError, r" must be a finite number >= 1, got nan"),
        (jnp.array(0.0), ValueError, r" must be a finite number >= 1, got Array\(0")]),
    *_rows(["dynamic_loss_scale"], "min_scale", [
        (0.0, ValueError, r" must be a finite number > 0, got 0.0"),
        (2.0**16, ValueError, r" must be <= initial_scale, got min_scale=65536.0 > "
         r"initial_scale=32768.0")]),
    *_rows(["dynamic_loss_scale"], "initial_scale", [
        (2.0**128, ValueError, r" must be at most the largest float32, "
         r"3.4028234663852886e\+38 \(the scale is a float32")]),
    *_rows(["dynamic_loss_scale"], "inner", [
        ("adamw", TypeError, r" must be an optax GradientTransformation or None, "
         r"got 'adamw'")]),
    # --- distribution --------------------------------------------------------
    *_rows(["clip_by_norm", "clip_by_global_norm", "clip_grad_norm",
            "clip_by_block_rms", "F.clip_by_block_rms",
            "adaptive_grad_clip", "auto_clip", "zclip", "adagc", "skip_step",
            "dynamic_loss_scale", "microbatch_guard", "all_finite", "global_norm"],
           "axis_name", AXIS_NAME),
    # specs without axis_name: refused when the transform is built (issue 14)
    *_rows(SPECS, "specs", SPECS_ALONE),
    *_rows(["clip_by_global_norm", "zclip"], "specs", [
        (P(), ValueError, r" needs `axis_name`")]),
    *[(name, {"axis_name": "i", "specs": {"w": "data"}}, TypeError,
       _arg(name, "specs") + r" must hold PartitionSpecs \(or None\), got 'data'")
      for name in ("clip_by_global_norm", "skip_step", "adagc")],
    *_rows(["adaptive_grad_clip", "F.adaptive_grad_clip"], "axis_name", [
        ("data", ValueError, r" needs `specs`: whether a unit's norm is summed")]),
    *_rows(["adaptive_grad_clip", "F.adaptive_grad_clip"], "axis", [
        (1.5, TypeError, r" must be None, an int or a tuple of ints, got 1.5"),
        ((0, "1"), TypeError, r" must be None, an int or a tuple of ints, got \(0, '1'\)")]),
    # --- granularity: leaf_norms, layer_axis, groups (issue 13) ---------------
    *_rows(["clip_by_norm", "clip_by_global_norm", "clip_grad_norm"], "leaf_norms", [
        (1, TypeError, r" must be a bool \(True or False\), got 1"),
        ("yes", TypeError, r" must be a bool \(True or False\), got 'yes'")]),
    *_rows(["clip_by_norm", "clip_by_global_norm", "clip_grad_norm", "F.clip_by_norm"],
           "layer_axis", [
               (1.5, TypeError, r" must hold ints \(the axis that stacks layers\) or "
                r"None, got 1.5 of type float"),
               ({"w": 0, "b": "0"}, TypeError, r" must hold ints .*got '0' of type str"),
               ({"w": True, "b": None}, TypeError, r" must hold ints .*got True of type bool")]),
    *[(name, {"layer_axis": 1}, ValueError,
       rf"`{_name(name)}\(layer_axis=1\)` is out of range for leaf \['b'\] of shape "
       r"\(3,\); give None for leaves that stack no layers")
      for name in ("clip_by_norm.init", "clip_by_global_norm.init",
                   "clip_grad_norm.init", "F.clip_by_norm")],
    *_rows(["clip_by_norm.init", "clip_by_global_norm.init", "clip_grad_norm.init",
            "F.clip_by_norm"], "layer_axis", [
        ({"w": 0}, ValueError, r" must be an int or a tree prefix of the gradients "
         r"with int or None leaves .*does not match the gradient tree")]),
    *_rows(["clip_by_global_norm"], "groups", [
        (1, TypeError, r" must hold strings \(group labels\), got 1 of type int"),
        ({"w": "a", "b": 2}, TypeError, r" must hold strings .*got 2 of type int")]),
    *_rows(["clip_by_global_norm.init"], "groups", [
        ({"w": "a"}, ValueError, r" must be a tree prefix of the gradients with "
         r"string leaves .*does not match the gradient tree")]),
    ("clip_by_global_norm", {"max_norm": {"a": 1.0}}, TypeError,
     _arg("clip_by_global_norm", "max_norm") + r" is a dict of per-group limits: "
     r"pass `groups=` to label the leaves, or a number"),
    ("clip_by_global_norm", {"max_norm": {"a": -1.0}, "groups": "a"}, ValueError,
     r"`clip_by_global_norm\(max_norm\['a'\]=\.\.\.\)` must be a number >= 0 or "
     r"inf, got -1.0"),
    ("clip_by_global_norm.init", {"max_norm": {"a": 1.0}, "groups": {"w": "a", "b": "c"}},
     ValueError, _arg("clip_by_global_norm", "max_norm") + r" has no limit for group "
     r"'c' \(it has \['a'\]\); give every group of `groups=` one"),
    # --- experts joined across leaves (issue 32) --------------------------------
    *_rows(["clip_by_norm", "F.clip_by_norm"], "joint_experts", [
        ("yes", TypeError, r" must be a bool \(True or False\), got 'yes'")]),
    *[(name, {"joint_experts": True}, ValueError, r"`clip_by_norm\(joint_experts=True\)` "
       r"needs `expert_axis=`") for name in ("clip_by_norm", "F.clip_by_norm")],
    ("clip_by_norm.init", {"joint_experts": True, "expert_axis": {"w": 0, "b": 0}},
     ValueError, r"`clip_by_norm\(expert_axis=\.\.\.\)`: leaf \['b'\] of shape \(3,\) "
     r"stacks 3 experts but leaf \['w'\] of shape \(2, 3\) stacks 2"),
    *_rows(["along"], "label", [
        ("", TypeError, r" must be a non-empty string \(the group's name\), got ''"),
        (1, TypeError, r" must be a non-empty string \(the group's name\), got 1")]),
    *_rows(["along"], "axis", [
        ("1", TypeError, r" must be an int \(the axis that indexes the group's parts\), "
         r"got '1' of type str"),
        (1.0, TypeError, r" must be an int .*got 1.0 of type float")]),
    ("clip_by_global_norm.init", {"groups": {"w": oc.along("e", 1), "b": oc.along("e", 0)},
                                  "layer_axis": {"w": 0, "b": None}}, ValueError,
     r"`clip_by_global_norm\(groups=\.\.\.\)`: leaf \['w'\] of shape \(2, 3\) stacks "
     r"layers but leaf \['b'\] of shape \(3,\) does not"),
    # --- layer_axis: ints (or None) that fit the leaves ------------------------
    *_rows(LAYER_AXIS, "layer_axis", [
        ("0", TypeError, r" must hold ints \(the axis that stacks layers\) or None, "
         r"got '0' of type str"),
        ({"w": 1.5}, TypeError, r" must hold ints .* or None, got 1.5 of type float"),
        (True, TypeError, r" must hold ints .* or None, got True of type bool"),
        (jnp.array(0), TypeError, r" must be static Python values \(ints or None, .*\), "
         r"got an array Array\(0.*; under optax.inject_hyperparams, list the "
         r"factory's argument that carries it in static_args")]),
    *[(name, {"layer_axis": 1}, ValueError, rf"`{_name(name)}\(layer_axis=1\)` is out "
       r"of range for leaf \['b'\] of shape \(3,\); give None for leaves that")
      for name in ("F.clip_by_block_rms", "F.adaptive_grad_clip")],
    ("per_example_clip_by_layer_norm", {"layer_axis": 1}, ValueError,
     r"`per_example_clip_by_layer_norm\(layer_axis=1\)` is out of range for leaf "
     r"\[0\] of shape \(2,\)"),
    ("F.adaptive_grad_clip", {"layer_axis": {"w": 0, "x": 0}}, ValueError,
     r"`adaptive_grad_clip\(layer_axis=\.\.\.\)` must be an int or a tree prefix of "
     r"the gradients"),
    # --- unitwise_norm / unitwise_clip ---------------------------------------
    ("F.unitwise_norm", {"x": jnp.ones((1, 2, 1, 2, 1, 2))}, ValueError,
     r"`unitwise_norm`: x has shape \(1, 2, 1, 2, 1, 2\); units are known for up to 5 "
     r"dimensions, pass `axis=`"),
    ("F.unitwise_norm", {"axis": 2}, ValueError,
     r"`unitwise_norm\(axis=\(2,\)\)` is out of range for x of shape \(2, 3\)"),
    *_rows(["F.unitwise_norm"], "axis", [
        (1.5, TypeError, r" must be None, an int or a tuple of ints, got 1.5"),
        (jnp.array(1), TypeError, r" must be static Python values \(None, an int or a "
         r"tuple of ints\), got an array Array\(1.*static_args")]),
    *[("F.unitwise_clip", {arg: jnp.ones(3)}, ValueError,
       rf"`unitwise_clip\({arg}=\.\.\.\)` must have grad's shape \(2, 3\), got "
       r"\(3,\); unitwise_norm\(grad\) gives norms in that shape")
      for arg in ("g_norm", "max_norm")],
    *_rows(["F.unitwise_clip"], "div_eps", [
        (0.0, ValueError, r" must be a finite number > 0, got 0.0"),
        (math.inf, ValueError, r" must be a finite number > 0, got inf"),
        ("1e-6", TypeError, r" must be a real number, got '1e-6'")]),
    # --- trees: leaves, shapes, structures ------------------------------------
    ("F.adaptive_grad_clip", {"updates": {"x": jnp.ones((1, 2, 1, 2, 1, 2))},
                              "params": {"x": jnp.ones((1, 2, 1, 2, 1, 2))}},
     ValueError, r"`adaptive_grad_clip`: leaf \['x'\] has shape \(1, 2, 1, 2, 1, 2\).*"
     r"pass `axis=`"),
    ("F.adaptive_grad_clip", {"updates": {"w": jnp.ones((2, 2))},
                              "params": {"w": jnp.ones((2, 2))}, "axis": 2},
     ValueError, r"`adaptive_grad_clip\(axis=\(2,\)\)` is out of range for leaf \['w'\]"),
    # AGC pairs units by path: mismatched trees fail, naming the leaves (issue 9)
    *[(name, {"updates": {"a": jnp.ones(3), "b": jnp.ones(3)},
              "params": {"a": jnp.ones(3), "c": jnp.ones(3)}}, ValueError,
       r"`adaptive_grad_clip`: params and updates must have the same tree "
       r"structure.*only in updates: \['b'\]; only in params: \['c'\]")
      for name in ("F.adaptive_grad_clip", "adaptive_grad_clip.update")],
    *[(name, {"updates": {"a": jnp.ones((2, 3)), "b": jnp.ones(3)},
              "params": {"a": jnp.ones((3, 2)), "b": jnp.ones(3)}}, ValueError,
       r"`adaptive_grad_clip`: leaf \['a'\] of the updates has shape \(2, 3\) but its "
       r"param has shape \(3, 2\); pass the params that the updates are for")
      for name in ("F.adaptive_grad_clip", "adaptive_grad_clip.update")],
    ("F.adaptive_grad_clip", {"updates": [jnp.ones(3)], "params": [jnp.ones(3, jnp.int32)]},
     ValueError, r"leaf \[0\] of the updates has shape \(3,\) but its param is "
     r"Array\(\[1, 1, 1\].*not a floating array"),
    ("adaptive_grad_clip.update", {"params": None}, ValueError,
     r"`adaptive_grad_clip`: You are using a transformation that requires the current "
     r"value of parameters, but you are not passing `params`"),
    ("adagc.update", {"updates": {**GRADS, "c": jnp.ones(2)}}, ValueError,
     r"`adagc`: the state has a threshold for 2 tensors but the updates have 3 "
     r"floating leaves; call init with the parameters"),
    *[(name, {"grads": grads}, ValueError, _arg(name, "grads") + rest)
      for name in ("per_example_clip_by_global_norm", "per_example_clip_by_layer_norm")
      for grads, rest in [
          ([np.ones((4, 2)), np.ones((3, 2))], r" needs a leading batch axis of the "
           r"same size on every floating leaf .*got shapes \[\(4, 2\), \(3, 2\)\]"),
          ([np.ones((4, 2)), np.ones(())], r" needs a leading batch axis.*\[\(4, 2\), \(\)\]"),
          ([1.5], r" needs a leading batch axis.*\[\(\)\]"),
      ]],
    # Non-array leaves are named by path (issue 14), in every entry point.
    *[(name, {arg: TREE_WITH_A_STRING}, TypeError,
       rf"`{_name(name)}`: {re.escape(shown)} must be a pytree of arrays, but "
       r"leaf \['s'\] is 'abc' of type str")
      for name, arg, shown in [
          ("global_norm", "tree", "tree"), ("all_finite", "tree", "tree"),
          ("F.clip_by_value", "tree", "the tree"), ("F.clip_by_norm", "tree", "the tree"),
          ("F.clip_by_global_norm", "tree", "the tree"),
          ("F.clip_by_block_rms", "tree", "the tree"),
          ("clip_by_block_rms.update", "updates", "the tree"),
          ("F.adaptive_grad_clip", "updates", "updates"),
          ("per_example_clip_by_global_norm", "grads", "grads"),
          ("per_example_clip_by_layer_norm", "grads", "grads"),
          ("clip_by_value.update", "updates", "the tree"),
          ("clip_by_norm.update", "updates", "the tree"),
          ("clip_by_global_norm.update", "updates", "the tree"),
          ("clip_grad_norm.update", "updates", "the tree"),
          ("adaptive_grad_clip.update", "updates", "updates"),
          *[(f"{name}.update", "updates", "updates")
            for name in ("auto_clip", "zclip", "adagc", "skip_step",
                         "dynamic_loss_scale")]]],
    ("global_norm", {"tree": "abc"}, TypeError,
     r"`global_norm`: tree must be a pytree of arrays, but leaf \(the root\) is 'abc'"),
    # --- states: what init returned (issue 14) --------------------------------
    *[(f"{name}.update", {"state": None}, TypeError,
       rf"`{name}`: update needs the {state} that `init` \(or the previous "
       r"update\) returned, got state=None; call `state = tx.init\(params\)` once")
      for name, state in STATEFUL.items() if name not in STATELESS_USE],
    *[(f"{name}.update", {"state": optax.EmptyState()}, TypeError,
       rf"`{name}`: update needs the {state} that `init` \(or the previous "
       r"update\) returned, got state=EmptyState\(\)")
      for name, state in STATEFUL.items()],
    # --- Muon-safe clipping: the stall guard's floor, scale_only ------------------
    *_rows(["clip_by_norm", "clip_by_global_norm", "clip_grad_norm"], "floor", [
        (-1.0, ValueError, r" must be a number in \[0, 1\], got -1.0"),
        (2.0, ValueError, r" must be a number in \[0, 1\], got 2.0"),
        (math.nan, ValueError, r" must be a number in \[0, 1\], got nan"),
        ("1e-4", TypeError, r" must be a real number, got '1e-4'")]),
    *_rows(["clip_by_global_norm", "clip_grad_norm"], "scale_only", [
        ({"w": "yes"}, TypeError, r" must hold bools \(True: the leaf is scaled\), got 'yes'"),
        ({"w": jnp.array(True)}, TypeError,
         r" must be static Python values \(bools, a tree prefix of them")]),
    *_rows(["clip_by_global_norm.init", "clip_grad_norm.init"], "scale_only", [
        ({"nope": True}, ValueError, r" must be a tree prefix of the gradients with bool "
         r"leaves .*; it does not match the gradient tree")]),
    ("clip_by_global_norm", {"groups": "a", "scale_only": True}, ValueError,
     r"`clip_by_global_norm`: pass `groups=` or `scale_only=`, not both"),
    *_rows(["check_stall"], "max_floor_steps", [
        (-1, ValueError, r" must be an int >= 0 \(steps\), got -1"),
        (1.5, TypeError, r" must be an int >= 0 \(steps\), got 1.5"),
        (True, TypeError, r" must be an int >= 0 \(steps\), got True")]),
    ("loss_scale", {"opt_state": optax.adam(0.1).init(GRADS)}, ValueError,
     r"`loss_scale\(opt_state\)` needs exactly one dynamic_loss_scale state in the "
     r"optimizer state, found no: build the optimizer with"),
]


def _id(row):
  name, kwargs, error, _ = row
  shown = ",".join(f"{k}={v!r:.20}" for k, v in kwargs.items())
  return f"{name}({shown})-{error.__name__}"


@pytest.mark.parametrize("name,kwargs,error,pattern", BAD_ARGUMENTS,
                         ids=[_id(row) for row in BAD_ARGUMENTS])
def test_bad_arguments_raise_a_clear_error(name, kwargs, error, pattern):
  with pytest.raises(error) as info:
    CALLS[name](**kwargs)
  assert re.search(pattern, str(info.value), re.DOTALL), str(info.value)


def _injectable(row):
  """Rows a user could write through ``optax.inject_hyperparams``: a
  builder's numeric argument."""
  name, kwargs, _, _ = row
  if len(kwargs) != 1:
    return False
  [(arg, value)] = kwargs.items()
  return (name in BUILDERS and isinstance(value, (int, float))
          and not isinstance(value, bool) and arg not in ("axis", "history"))


INJECTED = [row for row in BAD_ARGUMENTS if _injectable(row)]


@pytest.mark.parametrize("name,kwargs,error,pattern", INJECTED,
                         ids=[_id(row) for row in INJECTED])
def test_injected_hyperparameters_are_checked_at_init(name, kwargs, error, pattern):
  # inject_hyperparams builds the transform inside `init`, from concrete
  # arrays: they are checked there like numbers (issue 11).
  del pattern  # the value shows as an array here
  factory, defaults = FACTORIES[name]
  tx = optax.inject_hyperparams(factory)(**{**defaults, **kwargs})
  with pytest.raises(error, match=_arg(name, *kwargs)):
    tx.init(GRADS)


def test_every_public_name_is_in_the_table():
  named = {_name(name).replace("\\", "") for name, *_ in BAD_ARGUMENTS}
  public = set(oc.__all__) | set(F.__all__)
  stateless = {"functional", "stats", "PerExampleClip", "NonFiniteGradientError",
               "PartialNorm", "CombinedNorms", "ClipStallWarning",
               "AttentionHeads"}  # checked by qk_clip(heads=...)
  public = {n for n in public if not n.endswith("State") and n != "SkipStats"}
  assert public - stateless <= named, public - stateless - named


def test_good_edge_values_are_accepted():
  oc.clip_by_global_norm(0.0)
  oc.clip_by_global_norm(np.float32(1.0), ord="INF")
  oc.clip_by_global_norm(1, ord=np.int64(3))
  oc.clip_by_global_norm(jnp.array(1.0), ord=jnp.array(2.0), eps=np.array(0.0))
  oc.clip_by_value(0.0)
  oc.clip_by_value(-1.0, min_value=-2.0)
  oc.clip_by_value(math.inf, min_value=-math.inf)
  oc.dynamic_loss_scale(jnp.array(4.0), min_scale=np.float32(1.0), period=np.int64(3))
  oc.zclip(warmup_steps=jnp.array(3), alpha=jnp.array(1.0))
  optax.inject_hyperparams(oc.clip_by_global_norm)(max_norm=1.0).init(GRADS)
