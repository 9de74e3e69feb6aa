"""Argument checks shared by every public function and transform.

Checks run when a transform is built, so a bad hyperparameter fails at the
line that wrote it, with a message naming the function, the argument and the
value. JAX arrays (for instance the traced values that
``optax.inject_hyperparams`` passes) are accepted as they are: their value is
unknown at trace time, and reading it eagerly would cost a device sync per step.
"""

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer


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


def check_positive(fn: str, arg: str, value: Any) -> Any:
  """A finite number > 0; JAX arrays pass unchecked."""
  check_nonnegative(fn, arg, value)
  if not _is_jax_value(value) and float(value) == 0:
    raise ValueError(f"{_where(fn, arg)} must be a finite number > 0, got {value!r}")
  return value


def check_unit_interval(fn: str, arg: str, value: Any, *,
                        include_one: bool = True) -> Any:
  """A number in [0, 1] (or [0, 1)); JAX arrays pass unchecked."""
  check_nonnegative(fn, arg, value)
  if _is_jax_value(value):
    return value
  number = float(value)
  if number > 1 or (number == 1 and not include_one):
    interval = "[0, 1]" if include_one else "[0, 1)"
    raise ValueError(f"{_where(fn, arg)} must be a number in {interval}, got {value!r}")
  return value


def check_integer(fn: str, arg: str, value: Any, minimum: int) -> Any:
  """An int >= ``minimum``; a scalar JAX array (injected) passes."""
  if _is_jax_value(value):
    check_scalar_array(fn, arg, value)
    return value
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{_where(fn, arg)} must be an int >= {minimum}, got "
                    f"{value!r} of type {type(value).__name__}")
  if value < minimum:
    raise ValueError(f"{_where(fn, arg)} must be an int >= {minimum}, got {value!r}")
  return value


def check_buffer_size(fn: str, arg: str, value: Any) -> int | None:
  """A state buffer's length: an int >= 1, or None when traced.

  ``optax.inject_hyperparams`` turns every int argument into an array. A
  concrete one is read; a traced one (inside ``jit``) gives None, and the
  transform then reads the length from its state's buffer.
  """
  if _is_jax_value(value):
    check_scalar_array(fn, arg, value)
    if isinstance(value, Tracer):
      return None
    value = value.item()
  return int(check_integer(fn, arg, value, 1))


def require_buffer_size(fn: str, arg: str, size: int | None) -> int:
  """``size``, or an error when it was traced at ``init``."""
  if size is None:
    raise TypeError(
        f"{_where(fn, arg)} sets the shape of the state, so `init` needs its "
        f"value; with optax.inject_hyperparams list it in static_args "
        f"(static_args=({arg!r},)) or call init outside jit")
  return size
