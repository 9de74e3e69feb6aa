"""Bad arguments fail when the transform is built, naming argument and value."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip as oc

F = oc.functional

BAD_NORM_ARGS = [
    ("max_norm", -1.0, ValueError, "-1.0"),
    ("max_norm", math.nan, ValueError, "nan"),
    ("max_norm", math.inf, ValueError, "inf"),
    ("max_norm", "1.0", TypeError, "'1.0'"),
    ("max_norm", True, TypeError, "True"),
    ("max_norm", np.ones(2), TypeError, "shape"),
    ("max_norm", jnp.ones(2), TypeError, "shape"),
    ("ord", 0, ValueError, "0"),
    ("ord", -2, ValueError, "-2"),
    ("ord", math.nan, ValueError, "nan"),
    ("ord", "two", ValueError, "'two'"),
    ("ord", None, TypeError, "None"),
    ("eps", -1e-6, ValueError, "-1e-06"),
]


def _build(factory, arg, value):
  kwargs = {"max_norm": 1.0, arg: value}
  max_norm = kwargs.pop("max_norm")
  return factory(max_norm, **kwargs)


@pytest.mark.parametrize("arg,value,error,shown", BAD_NORM_ARGS)
@pytest.mark.parametrize("factory,name", [
    (oc.clip_by_global_norm, "clip_by_global_norm"),
    (oc.clip_by_norm, "clip_by_norm"),
])
def test_norm_clippers_reject_bad_arguments(factory, name, arg, value, error, shown):
  with pytest.raises(error) as info:
    _build(factory, arg, value)
  message = str(info.value)
  assert f"`{name}({arg}=...)`" in message and shown in message


@pytest.mark.parametrize("arg,value,error,shown", BAD_NORM_ARGS)
def test_functional_forms_reject_bad_arguments(arg, value, error, shown):
  tree = [jnp.ones(3)]
  kwargs = {"max_norm": 1.0, arg: value}
  max_norm = kwargs.pop("max_norm")
  with pytest.raises(error, match=arg):
    F.clip_by_global_norm(tree, max_norm, **kwargs)
  with pytest.raises(error, match=arg):
    F.clip_by_norm(tree, max_norm, **kwargs)
  if arg == "ord":
    with pytest.raises(error, match="global_norm"):
      F.global_norm(tree, value)


def test_clip_grad_norm_names_its_own_arguments():
  with pytest.raises(ValueError, match=r"`clip_grad_norm\(norm_type=...\)`.*-1"):
    oc.clip_grad_norm(1.0, norm_type=-1)
  with pytest.raises(ValueError, match=r"`clip_grad_norm\(max_norm=...\)`.*-2"):
    oc.clip_grad_norm(-2.0)
  with pytest.raises(TypeError, match="error_if_nonfinite"):
    oc.clip_grad_norm(1.0, error_if_nonfinite="yes")


def test_unknown_nonfinite_mode():
  with pytest.raises(ValueError, match=r"nonfinite=\.\.\.\)` must be one of .*'skip'"):
    oc.clip_by_global_norm(1.0, nonfinite="skip")


@pytest.mark.parametrize("max_value,min_value,error,shown", [
    (-1.0, None, ValueError, "max_value"),
    (1.0, 2.0, ValueError, "min_value=2.0 > max_value=1.0"),
    (math.nan, None, ValueError, "nan"),
    (1.0, math.inf, ValueError, "inf"),
    ("0.1", None, TypeError, "'0.1'"),
])
def test_clip_by_value_rejects_bad_bounds(max_value, min_value, error, shown):
  with pytest.raises(error, match="clip_by_value") as info:
    oc.clip_by_value(max_value, min_value)
  assert shown in str(info.value)
  with pytest.raises(error):
    F.clip_by_value([jnp.ones(2)], max_value, min_value)


def test_clip_by_value_rejects_complex_leaves_by_path():
  with pytest.raises(TypeError, match=r"\['z'\].*complex64"):
    F.clip_by_value({"z": jnp.ones(2, jnp.complex64)}, 1.0)


def test_bad_axis_name_and_specs_without_axis_name():
  with pytest.raises(TypeError, match="axis_name"):
    oc.clip_by_global_norm(1.0, axis_name=1.5)
  with pytest.raises(ValueError, match="specs"):
    F.global_norm([jnp.ones(2)], specs=jax.sharding.PartitionSpec())


def test_good_edge_values_are_accepted():
  oc.clip_by_global_norm(0.0)
  oc.clip_by_global_norm(np.float32(1.0), ord="INF")
  oc.clip_by_global_norm(1, ord=np.int64(3))
  oc.clip_by_value(0.0)
  oc.clip_by_value(-1.0, min_value=-2.0)
  optax.inject_hyperparams(oc.clip_by_global_norm)(max_norm=1.0)
