"""Element-wise clipping to a range: ``clip_grad_value_``, ``tf.clip_by_value``."""

import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from optaxclip import _tree, _validation
from optaxclip._stats import registry
from optaxclip._types import Scalar

PyTree = Any


def _bound(fn: str, arg: str, value: Any, excluded: float) -> Any:
  """A clipping bound: a number, not NaN nor ``excluded`` (an infinity)."""
  number = _validation.scalar(fn, arg, value)
  if not _validation.is_traced(number) and (math.isnan(number)
                                            or number == excluded):
    raise ValueError(f"`{fn}({arg}=...)` must be a number other than NaN and "
                     f"{excluded}, got {value!r}")
  return number


def _check_bounds(fn: str, max_value: Any, min_value: Any) -> tuple[Any, Any]:
  """``(low, high)``, the range the updates are clipped to.

  Traced bounds cannot be checked: an empty or NaN range (a negative
  ``max_value`` without ``min_value``, or ``min_value > max_value``) then
  clips every element to 0.
  """
  if max_value is None:
    raise TypeError(
        f"`{fn}(max_value=...)` must be a number (the upper bound; inf for "
        f"none), got None; only min_value may be None (then -max_value)")
  high = _bound(fn, "max_value", max_value, -math.inf)
  low = None if min_value is None else _bound(fn, "min_value", min_value,
                                              math.inf)
  if _validation.is_traced(high) or _validation.is_traced(low):
    high = jnp.asarray(high)
    low = -high if low is None else jnp.asarray(low)
    usable = low <= high  # False for NaN
    return (jnp.where(usable, low, 0).astype(low.dtype),
            jnp.where(usable, high, 0).astype(high.dtype))
  if low is None and high < 0:
    raise ValueError(
        f"`{fn}(max_value=...)` must be >= 0 when min_value is None (the range "
        f"is [-max_value, max_value]), got {max_value!r}")
  if low is not None and low > high:
    raise ValueError(
        f"`{fn}(min_value=...)` must be <= max_value, got min_value="
        f"{min_value!r} > max_value={max_value!r}")
  if min_value is None:
    return -max_value, max_value
  return min_value, max_value


def _clip_tree(fn: str, tree: PyTree, low: Any, high: Any) -> PyTree:
  _validation.check_tree(fn, "the tree", tree)
  for path, leaf in _tree.clippable_leaves_with_paths(tree):
    if jnp.iscomplexobj(leaf):
      raise TypeError(
          f"`{fn}` cannot order complex values, but leaf {path} is "
          f"{leaf.dtype}; clip complex gradients by norm instead")

  def clip(x):
    # Bounds in the leaf's dtype: the result keeps it (bf16 stays bf16).
    return jnp.clip(x, jnp.asarray(low, x.dtype), jnp.asarray(high, x.dtype))

  return _tree.map_clippable(clip, tree)


def clip_by_value_fn(tree: PyTree, max_value: Scalar,
                     min_value: Scalar | None = None) -> PyTree:
  """Clips every element of ``tree`` to ``[min_value, max_value]``.

  Args:
    tree: a pytree of arrays (Python floats count as scalar arrays; integer
      leaves pass through).
    max_value: the upper bound (``inf``: none).
    min_value: the lower bound (``-inf``: none); ``None`` means
      ``-max_value`` (PyTorch's ``clip_grad_value_``, Optax's ``clip``).
      Traced bounds (inside ``jit``) cannot be checked: an empty or NaN
      range clips every element to 0.

  Returns:
    The clipped tree, with each leaf's dtype. NaN stays NaN.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> oc.functional.clip_by_value({"g": jnp.array([-0.5, 0.05, 0.5])}, 0.1)
    {'g': Array([-0.1 ,  0.05,  0.1 ], dtype=float32)}
  """
  low, high = _check_bounds("clip_by_value", max_value, min_value)
  return _clip_tree("clip_by_value", tree, low, high)


class ValueClipState(NamedTuple):
  """State of ``clip_by_value``: no fields.

  It holds nothing, but it marks the clipper's place in a chained state, so
  that ``dynamic_loss_scale`` can tell a value clip placed before it (which
  would clip the scaled gradients) from one placed after it.
  """


registry.register(ValueClipState, "clip_value")


def clip_by_value(max_value: Scalar,
                  min_value: Scalar | None = None) -> optax.GradientTransformation:
  """Clips every element of the updates to ``[min_value, max_value]``.

  A drop-in for ``optax.clip`` and ``torch.nn.utils.clip_grad_value_``
  (``min_value=None``), and ``tf.clip_by_value`` (both bounds).

  Args:
    max_value: the upper bound (``inf``: none).
    min_value: the lower bound (``-inf``: none); ``None`` means
      ``-max_value``. Injected with ``optax.inject_hyperparams``, the bounds
      are checked at ``init``; a traced range that is empty or NaN (a jitted
      update after a change of the state's hyperparameters) clips every
      element to 0.

  Returns:
    An ``optax.GradientTransformation`` whose state is an empty
    ``ValueClipState``; like ``optax.clip``, its ``update`` accepts any
    state (``None`` too).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> tx = oc.clip_by_value(1.0, min_value=-0.5)
    >>> tx.update([jnp.array([-2.0, 0.3, 2.0])], tx.init(None))[0]
    [Array([-0.5,  0.3,  1. ], dtype=float32)]
  """
  low, high = _check_bounds("clip_by_value", max_value, min_value)

  def update_fn(updates, state, params=None):
    del params  # any state is accepted and returned, as optax.clip does
    return _clip_tree("clip_by_value", updates, low, high), state

  return optax.GradientTransformation(lambda params: ValueClipState(),
                                     update_fn)
