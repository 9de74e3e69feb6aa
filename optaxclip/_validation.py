"""Argument checks shared by every public function and transform.

Checks run when a transform is built, so a bad hyperparameter fails at the
line that wrote it, with a message naming the function, the argument and the
value. JAX arrays (for instance the traced values that
``optax.inject_hyperparams`` passes) are accepted as they are: their value is
unknown at trace time, and reading it eagerly would cost a device sync per step.
"""

import math
import numbers
from typing import Any, Sequence

import jax
import numpy as np


def _where(fn: str, arg: str) -> str:
  return f"`{fn}({arg}=...)`"


def _is_jax_value(value: Any) -> bool:
  return isinstance(value, jax.Array)


def _as_real(fn: str, arg: str, value: Any) -> float:
  """``value`` as a Python float, or a TypeError naming the argument."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (numbers.Real, np.ndarray)):
    raise TypeError(
        f"{_where(fn, arg)} must be a real number, got {value!r} "
        f"of type {type(value).__name__}")
  if isinstance(value, np.ndarray):
    if value.shape != () or not np.issubdtype(value.dtype, np.number):
      raise TypeError(
          f"{_where(fn, arg)} must be a real scalar, got an array of shape "
          f"{value.shape} and dtype {value.dtype}")
    value = value.item()
  return float(value)


def check_scalar_array(fn: str, arg: str, value: jax.Array) -> None:
  if value.shape != ():
    raise TypeError(
        f"{_where(fn, arg)} must be a scalar, got an array of shape "
        f"{value.shape}")


def check_nonnegative(fn: str, arg: str, value: Any) -> Any:
  """A finite number >= 0 (thresholds, eps); JAX arrays pass unchecked."""
  if _is_jax_value(value):
    check_scalar_array(fn, arg, value)
    return value
  number = _as_real(fn, arg, value)
  if not math.isfinite(number) or number < 0:
    raise ValueError(
        f"{_where(fn, arg)} must be a finite number >= 0, got {value!r}")
  return value


def check_finite(fn: str, arg: str, value: Any) -> Any:
  """A finite number of either sign (clipping bounds); JAX arrays unchecked."""
  if value is None or _is_jax_value(value):
    if value is not None:
      check_scalar_array(fn, arg, value)
    return value
  number = _as_real(fn, arg, value)
  if not math.isfinite(number):
    raise ValueError(f"{_where(fn, arg)} must be a finite number, got {value!r}")
  return value


def check_ord(fn: str, value: Any, arg: str = "ord") -> Any:
  """The norm order as a Python float (any p > 0, ``inf``, ``"inf"``).

  A JAX array (a hyperparameter injected by ``optax.inject_hyperparams``)
  is returned as it is.
  """
  if isinstance(value, str):
    if value.lower() == "inf":
      return math.inf
    raise ValueError(
        f"{_where(fn, arg)} must be a number > 0 or 'inf', got {value!r}")
  if _is_jax_value(value):
    # Injected by optax.inject_hyperparams: the norm dispatches on its value.
    check_scalar_array(fn, arg, value)
    return value
  number = _as_real(fn, arg, value)
  if math.isnan(number) or number <= 0:
    raise ValueError(
        f"{_where(fn, arg)} must be a number > 0 or 'inf', got {value!r}")
  return number


def check_choice(fn: str, arg: str, value: Any, choices: Sequence[str]) -> str:
  if value not in choices:
    options = ", ".join(repr(c) for c in choices)
    raise ValueError(f"{_where(fn, arg)} must be one of {options}, got {value!r}")
  return value


def check_axis_name(fn: str, value: Any) -> tuple[Any, ...]:
  """``axis_name`` as a tuple of mesh axis names (empty when None)."""
  if value is None:
    return ()
  names = value if isinstance(value, (tuple, list)) else (value,)
  for name in names:
    if not isinstance(name, (str, int)) or isinstance(name, bool):
      raise TypeError(
          f"{_where(fn, 'axis_name')} must be an axis name or a tuple of "
          f"axis names, got {value!r}")
  return tuple(names)
