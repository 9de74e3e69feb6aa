"""Which leaves of a gradient tree take part in clipping.

A leaf takes part when it is a floating or complex array. ``None`` and
``optax.MaskedNode`` are empty subtrees (JAX never shows them as leaves), and
integer or boolean arrays (step counters, masks, token ids) pass through every
transform untouched and are left out of every norm. A Python float (or
complex) leaf is a scalar array, as under ``jit``; a Python int or bool is
an integer leaf.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def is_clippable(leaf: Any) -> bool:
  """Whether ``leaf`` is a floating or complex array (or array-like spec)."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:
    return isinstance(leaf, (float, complex))
  return jnp.issubdtype(dtype, jnp.inexact)


def as_array(leaf: Any) -> Any:
  """A Python float or complex leaf as the JAX scalar ``jit`` would make it."""
  if isinstance(leaf, (float, complex)) and not hasattr(leaf, "dtype"):
    return jnp.asarray(leaf)
  return leaf


def clippable_leaves(tree: PyTree) -> list[Any]:
  """The floating and complex leaves of ``tree``, in tree order, as arrays."""
  return [as_array(leaf) for leaf in jax.tree.leaves(tree)
          if is_clippable(leaf)]


def clippable_leaves_with_paths(tree: PyTree) -> list[tuple[str, Any]]:
  """``(keystr(path), leaf)`` for the floating and complex leaves of ``tree``."""
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path), as_array(leaf))
          for path, leaf in with_paths if is_clippable(leaf)]


def map_clippable(fn: Callable[[jax.Array], jax.Array], tree: PyTree) -> PyTree:
  """Applies ``fn`` to the clippable leaves of ``tree``; others pass through."""
  return jax.tree.map(lambda x: fn(as_array(x)) if is_clippable(x) else x, tree)


def map_clippable_indexed(fn: Callable[[jax.Array, int], jax.Array],
                          tree: PyTree) -> PyTree:
  """``fn(leaf, i)`` on the ``i``-th clippable leaf of ``tree``; others pass.

  ``i`` counts clippable leaves in tree order, as in ``clippable_leaves``, so
  it indexes whatever was computed from them (one norm or factor per leaf).
  """
  leaves, treedef = jax.tree.flatten(tree)
  out, index = [], 0
  for x in leaves:
    if is_clippable(x):
      out.append(fn(as_array(x), index))
      index += 1
    else:
      out.append(x)
  return treedef.unflatten(out)


class _Box:
  """Holds one value as an opaque pytree leaf (None included)."""

  def __init__(self, value: Any):
    self.value = value


def broadcast_prefix(fn: str, arg: str, prefix: PyTree, tree: PyTree, *,
                     is_value: Callable[[Any], bool], holds: str,
                     like: str) -> list[Any]:
  """The value ``prefix`` gives each leaf of ``tree`` (every leaf, in order).

  ``prefix`` is a tree prefix of ``tree`` whose leaves pass ``is_value``
  (as ``shard_map``'s ``in_specs`` or ``optax.partition``'s labels); a
  TypeError says it must hold ``holds``, a ValueError that it must be
  ``like`` and does not match the tree.
  """
  def broadcast(value, subtree):
    if not is_value(value):
      raise TypeError(f"`{fn}({arg}=...)` must hold {holds}, got {value!r} "
                      f"of type {type(value).__name__}")
    return jax.tree.map(lambda _: _Box(value), subtree)

  try:
    boxed = jax.tree.map(broadcast, prefix, tree, is_leaf=is_value)
  except ValueError as error:
    raise ValueError(f"`{fn}({arg}=...)` must be {like}; it does not match "
                     f"the gradient tree: {error}") from None
  return [box.value for box in
          jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, _Box))]


def accumulation_dtype(leaves: list[Any]) -> jnp.dtype:
  """float32, or float64 when any leaf is (complex) float64.

  Half-precision leaves are always upcast: their squares would overflow
  (fp16 above 256) or lose precision (bf16 keeps 8 bits of mantissa).
  """
  if any(jnp.finfo(leaf.dtype).bits >= 64 for leaf in leaves):
    # float32 again when x64 is off (numpy float64 leaves are cast down anyway).
    return jax.dtypes.canonicalize_dtype(jnp.float64)
  return jnp.dtype(jnp.float32)
