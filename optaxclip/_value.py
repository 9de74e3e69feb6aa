"""Element-wise clipping to a range: ``clip_grad_value_``, ``tf.clip_by_value``."""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optaxclip import _tree, _validation

PyTree = Any


def _check_bounds(fn: str, max_value: Any, min_value: Any) -> None:
  _validation.check_finite(fn, "max_value", max_value)
  _validation.check_finite(fn, "min_value", min_value)
  if isinstance(max_value, jax.Array) or isinstance(min_value, jax.Array):
    return  # traced (optax.inject_hyperparams): no value to compare yet
  if min_value is None and max_value < 0:
    raise ValueError(
        f"`{fn}(max_value=...)` must be >= 0 when min_value is None (the range "
        f"is [-max_value, max_value]), got {max_value!r}")
  if min_value is not None and min_value > max_value:
    raise ValueError(
        f"`{fn}(min_value=...)` must be <= max_value, got min_value="
        f"{min_value!r} > max_value={max_value!r}")


def _clip_tree(fn: str, tree: PyTree, max_value: Any, min_value: Any) -> PyTree:
  if min_value is None:
    min_value = -max_value
  for path, leaf in _tree.clippable_leaves_with_paths(tree):
    if jnp.iscomplexobj(leaf):
      raise TypeError(
          f"`{fn}` cannot order complex values, but leaf {path} is "
          f"{leaf.dtype}; clip complex gradients by norm instead")

  def clip(x):
    # Bounds in the leaf's dtype: the result keeps it (bf16 stays bf16).
    return jnp.clip(x, jnp.asarray(min_value, x.dtype),
                    jnp.asarray(max_value, x.dtype))

  return _tree.map_clippable(clip, tree)


def clip_by_value_fn(tree: PyTree, max_value: Any,
                     min_value: Any = None) -> PyTree:
  """Clips every element of ``tree`` to ``[min_value, max_value]``.

  Args:
    tree: a pytree of arrays.
    max_value: the upper bound.
    min_value: the lower bound; ``None`` means ``-max_value`` (PyTorch's
      ``clip_grad_value_``, Optax's ``clip``).

  Returns:
    The clipped tree, with each leaf's dtype. NaN stays NaN.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> oc.functional.clip_by_value({"g": jnp.array([-0.5, 0.05, 0.5])}, 0.1)
    {'g': Array([-0.1 ,  0.05,  0.1 ], dtype=float32)}
  """
  _check_bounds("clip_by_value", max_value, min_value)
  return _clip_tree("clip_by_value", tree, max_value, min_value)


def clip_by_value(max_value: Any,
                  min_value: Any = None) -> optax.GradientTransformation:
  """Clips every element of the updates to ``[min_value, max_value]``.

  A drop-in for ``optax.clip`` and ``torch.nn.utils.clip_grad_value_``
  (``min_value=None``), and ``tf.clip_by_value`` (both bounds).

  Args:
    max_value: the upper bound.
    min_value: the lower bound; ``None`` means ``-max_value``.

  Returns:
    An ``optax.GradientTransformation`` with an empty state.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> tx = oc.clip_by_value(1.0, min_value=-0.5)
    >>> tx.update([jnp.array([-2.0, 0.3, 2.0])], tx.init(None))[0]
    [Array([-0.5,  0.3,  1. ], dtype=float32)]
  """
  _check_bounds("clip_by_value", max_value, min_value)

  def update_fn(updates, state, params=None):
    del params
    return _clip_tree("clip_by_value", updates, max_value, min_value), state

  return optax.GradientTransformation(
      lambda params: optax.EmptyState(), update_fn)
