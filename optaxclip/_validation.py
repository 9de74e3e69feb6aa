"""Argument checks shared by every public function and transform.

Checks run when a transform is built, so a bad hyperparameter fails at the
line that wrote it, with a message naming the function, the argument and the
value. Python numbers, numpy scalars and concrete JAX arrays are checked
alike: a hyperparameter that ``optax.inject_hyperparams`` injects is a
concrete array when its ``init`` runs eagerly (the transform is built inside
it), so a bad one fails there.

A traced value (inside ``jit``: an injected hyperparameter during a jitted
``update``, or one changed in the state) has no value to check, and a
``jax.debug`` check would cost a host callback per step. Each check then
returns it clamped into the argument's range, NaN to the range's low end
(where the range has none, to a neutral value: 1 for a scale, 2 for a norm
order), so that no value can flip the update's sign or make it NaN; every
transform's docstring says what that means for its arguments.
"""

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from optaxclip._static import argument as _where
from optaxclip._static import check_expert_axis as check_expert_axis
from optaxclip._static import check_layer_axis as check_layer_axis
from optaxclip._static import check_mask as check_mask
from optaxclip._static import check_stack_axes as check_stack_axes
from optaxclip._static import check_static as check_static
from optaxclip._static import is_layer_axis as is_layer_axis
from optaxclip._static import is_traced as is_traced


def scalar(fn: str, arg: str, value: Any) -> Any:
  """``value`` as a Python float, or the tracer itself; else a TypeError.

  Accepts real numbers and real scalar arrays (numpy, JAX), not bools.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (numbers.Real, np.ndarray, np.generic, jax.Array)):
    raise TypeError(
        f"{_where(fn, arg)} must be a real number, got {value!r:.80} "
        f"of type {type(value).__name__}")
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    if value.shape != ():
      raise TypeError(
          f"{_where(fn, arg)} must be a scalar, got an array of shape "
          f"{value.shape}")
    if not (jnp.issubdtype(value.dtype, jnp.integer)
            or jnp.issubdtype(value.dtype, jnp.floating)):
      raise TypeError(
          f"{_where(fn, arg)} must be a real number, got an array of dtype "
          f"{value.dtype}")
    if is_traced(value):
      return value
  return float(value)


def clamp(value: Any, low: Any, high: Any = None) -> Any:
  """A traced ``value`` clamped to ``[low, high]``, NaN to ``low``.

  ``high`` may be None (no upper end) or ``"finite"`` (the largest finite
  float: a traced Inf where only finite values make sense). Values that
  are not traced are returned as they are: they were checked.
  """
  if not is_traced(value):
    return value
  floating = jnp.issubdtype(value.dtype, jnp.floating)
  if floating:
    value = jnp.where(jnp.isnan(value), jnp.asarray(low, value.dtype), value)
  value = jnp.maximum(value, jnp.asarray(low, value.dtype))
  if high == "finite":
    high = jnp.finfo(value.dtype).max if floating else None
  if high is not None:
    value = jnp.minimum(value, jnp.asarray(high, value.dtype))
  return value


def check_nonnegative(fn: str, arg: str, value: Any, *,
                      allow_inf: bool = False) -> Any:
  """A number >= 0, finite unless ``allow_inf`` (inf: no limit).

  Traced: clamped to ``[0, inf]`` (``[0, max float]`` unless ``allow_inf``),
  NaN to 0.
  """
  number = scalar(fn, arg, value)
  if is_traced(number):
    return clamp(number, 0, None if allow_inf else "finite")
  if math.isnan(number) or number < 0 or (math.isinf(number) and not allow_inf):
    what = "a number >= 0 or inf" if allow_inf else "a finite number >= 0"
    raise ValueError(f"{_where(fn, arg)} must be {what}, got {value!r}")
  return value


def check_at_least(fn: str, arg: str, value: Any, minimum: float) -> Any:
  """A finite number >= ``minimum``; traced: clamped, NaN to ``minimum``."""
  number = scalar(fn, arg, value)
  if is_traced(number):
    return clamp(number, minimum, "finite")
  if not math.isfinite(number) or number < minimum:
    raise ValueError(
        f"{_where(fn, arg)} must be a finite number >= {minimum}, got {value!r}")
  return value


def check_positive(fn: str, arg: str, value: Any, *, traced: float) -> Any:
  """A finite number > 0; traced, any other value (NaN too) acts as
  ``traced``."""
  number = scalar(fn, arg, value)
  if is_traced(number):
    usable = (number > 0) & jnp.isfinite(number)
    return jnp.where(usable, number, jnp.asarray(traced, number.dtype))
  if not math.isfinite(number) or number <= 0:
    raise ValueError(f"{_where(fn, arg)} must be a finite number > 0, got {value!r}")
  return value


def check_interval(fn: str, arg: str, value: Any, low: float, high: float, *,
                   include_high: bool = True) -> Any:
  """A number in ``[low, high]`` (or ``[low, high)``).

  Traced: clamped to the interval (``high`` itself excluded: the largest
  float below it), NaN to ``low``.
  """
  number = scalar(fn, arg, value)
  if is_traced(number):
    top = high
    if not include_high:
      dtype = number.dtype if jnp.issubdtype(number.dtype, jnp.floating) \
          else jnp.float32
      top = np.nextafter(np.asarray(high, dtype), np.asarray(low, dtype))
    return clamp(number, low, top)
  if not (low <= number <= high) or (number == high and not include_high):
    interval = f"[{low:g}, {high:g}{']' if include_high else ')'}"
    raise ValueError(f"{_where(fn, arg)} must be a number in {interval}, got {value!r}")
  return value


def check_unit_interval(fn: str, arg: str, value: Any, *,
                        include_one: bool = True) -> Any:
  """A number in [0, 1] (or [0, 1)); traced: clamped, NaN to 0."""
  return check_interval(fn, arg, value, 0, 1, include_high=include_one)


def check_ord(fn: str, value: Any, arg: str = "ord") -> Any:
  """The norm order: any p > 0, ``inf`` or ``"inf"``.

  A number comes back as a Python float, an array as it is (the norm then
  dispatches on its value at run time); a traced order that is not > 0
  (NaN too) acts as 2.
  """
  if isinstance(value, str):
    if value.lower() == "inf":
      return math.inf
    raise ValueError(
        f"{_where(fn, arg)} must be a number > 0 or 'inf', got {value!r}")
  number = scalar(fn, arg, value)
  if is_traced(number):
    return jnp.where(number > 0, number, jnp.asarray(2, number.dtype))
  if math.isnan(number) or number <= 0:
    raise ValueError(
        f"{_where(fn, arg)} must be a number > 0 or 'inf', got {value!r}")
  return value if isinstance(value, jax.Array) else number


def check_choice(fn: str, arg: str, value: Any, choices: Sequence[str]) -> str:
  if not isinstance(value, str) or value not in choices:
    options = ", ".join(repr(c) for c in choices)
    check_static(fn, arg, value, f"one of {options}")
    raise ValueError(f"{_where(fn, arg)} must be one of {options}, got {value!r}")
  return value


def check_bool(fn: str, arg: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    check_static(fn, arg, value, "True or False")
    raise TypeError(f"{_where(fn, arg)} must be a bool (True or False), got "
                    f"{value!r:.80} of type {type(value).__name__}")
  return bool(value)


def check_axis_name(fn: str, value: Any) -> tuple[Any, ...]:
  """``axis_name`` as a tuple of mesh axis names (empty when None)."""
  check_static(fn, "axis_name", value, "a mesh axis name or a tuple of them")
  if value is None:
    return ()
  names = value if isinstance(value, (tuple, list)) else (value,)
  for name in names:
    if not isinstance(name, (str, int)) or isinstance(name, bool):
      raise TypeError(
          f"{_where(fn, 'axis_name')} must be an axis name or a tuple of "
          f"axis names, got {value!r}")
  return tuple(names)


def check_integer(fn: str, arg: str, value: Any, minimum: int) -> Any:
  """An integer >= ``minimum``: an int, or a number or scalar array whose
  value is integral (``optax.inject_hyperparams(...,
  hyperparam_dtype=jnp.float32)`` and float schedules give float arrays).

  Traced: rounded to the nearest integer, then clamped to ``minimum`` from
  below (NaN to ``minimum``).
  """
  if isinstance(value, (np.ndarray, np.generic, jax.Array)) and value.shape != ():
    raise TypeError(f"{_where(fn, arg)} must be a scalar, got an array of "
                    f"shape {value.shape}")
  number = None
  if not isinstance(value, (bool, np.bool_)) and isinstance(
      value, (numbers.Real, np.ndarray, np.generic, jax.Array)):
    number = scalar(fn, arg, value)
  if isinstance(number, Tracer):
    floating = jnp.issubdtype(number.dtype, jnp.floating)
    return clamp(jnp.round(number) if floating else number, minimum)
  if number is None or not float(number).is_integer():
    raise TypeError(f"{_where(fn, arg)} must be an int >= {minimum}, got "
                    f"{value!r:.80} of type {type(value).__name__}")
  if number < minimum:
    raise ValueError(f"{_where(fn, arg)} must be an int >= {minimum}, got {value!r}")
  return int(number) if isinstance(value, numbers.Real) else value


def check_buffer_size(fn: str, arg: str, value: Any) -> int | None:
  """A state buffer's length: an int >= 1, or None when traced.

  ``optax.inject_hyperparams`` turns every int argument into an array. A
  concrete one is read; a traced one (inside ``jit``) gives None, and the
  transform then reads the length from its state's buffer.
  """
  checked = check_integer(fn, arg, value, 1)
  return None if is_traced(checked) else int(checked)


def require_buffer_size(fn: str, arg: str, size: int | None) -> int:
  """``size``, or an error when it was traced at ``init``."""
  if size is None:
    raise TypeError(
        f"{_where(fn, arg)} sets the shape of the state, so `init` needs its "
        f"value; with optax.inject_hyperparams list it in static_args "
        f"(static_args=({arg!r},)) or call init outside jit")
  return size


def _is_array_like(leaf: Any) -> bool:
  return (isinstance(leaf, (numbers.Number, np.bool_)) or hasattr(leaf, "dtype")
          or hasattr(leaf, "__jax_array__"))


def check_tree(fn: str, arg: str, tree: Any) -> None:
  """Every leaf of ``tree`` is an array or a number, or a TypeError naming it."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not _is_array_like(leaf):
      raise TypeError(
          f"`{fn}`: {arg} must be a pytree of arrays, but leaf "
          f"{jax.tree_util.keystr(path) or '(the root)'} is {leaf!r:.80} of "
          f"type {type(leaf).__name__}; leave such values out of the tree")


def check_state(fn: str, state: Any, state_type: type) -> None:
  """``state`` is what ``init`` returned (a ``state_type``), or a TypeError."""
  if isinstance(state, state_type) or (
      state is not None
      and all(hasattr(state, field) for field in state_type._fields)):
    return
  raise TypeError(
      f"`{fn}`: update needs the {state_type.__name__} that `init` (or the "
      f"previous update) returned, got state={state!r:.80}; call "
      f"`state = tx.init(params)` once and pass the state on at every step")


def check_update(fn: str, updates: Any, state: Any, state_type: type) -> None:
  """The arguments of a stateful transform's ``update``: see ``check_state``
  and ``check_tree``."""
  check_state(fn, state, state_type)
  check_tree(fn, "updates", updates)
