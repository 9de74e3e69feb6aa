"""Per-leaf and per-layer norms: layer axes, and the norms a state keeps.

A scanned model (``nn.scan``, ``nnx.scan``) stacks its layers along one
axis of each parameter; ``layer_axis`` names it, as a tree prefix of the
gradients (like ``specs``): an int, or None for leaves that stack nothing;
or a callable from the gradients to such a prefix (as ``groups``: handy
where the gradients are an ``nnx.State``).
A per-tensor quantity then becomes one per layer slice, the leaf keeping
that axis in the one norm computation (``_norms``).

With ``leaf_norms=True`` a state keeps the norm of every clippable leaf,
as a tree of the gradients' structure (None where a leaf is not clippable):
a scalar per leaf, or a vector with one norm per layer. The global norm is
then the norm of these norms: the same partial sums, no second pass over
the gradients. ``optaxclip.stats`` names each entry by its tree path,
``<transform>/leaf_norm/<key>/<key>/...``, with ``/<i>`` for layer ``i``:
dict keys, sequence indices and attribute names, in tree order, the
``.value`` of a flax.nnx Variable left out (docs/logging.md).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip import _norms, _tree, _validation

PyTree = Any
Keep = tuple[int, ...]


def layer_keep(fn: str, tree: PyTree, layer_axis: PyTree
               ) -> tuple[Keep, ...] | None:
  """Per clippable leaf of ``tree``, the axes its norm keeps: ``(axis,)``
  where ``layer_axis`` gives one, ``()`` elsewhere; None for no layer axes.
  """
  if layer_axis is None:
    return None
  if callable(layer_axis) and not isinstance(layer_axis, jax.Array):
    layer_axis = layer_axis(tree)  # as groups: e.g. for an nnx.State
  leaf_axes = _tree.broadcast_prefix(
      fn, "layer_axis", layer_axis, tree, is_value=_validation.is_layer_axis,
      holds="ints (the axis that stacks layers) or None",
      like="an int or a tree prefix of the gradients with int or None "
           "leaves (as optax.partition's labels)")
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  keep = []
  for (path, x), axis in zip(with_paths, leaf_axes):
    if not _tree.is_clippable(x):
      continue
    ndim = len(np.shape(x))
    if axis is None:
      keep.append(())
    elif -ndim <= axis < ndim:
      keep.append((axis % ndim,))
    else:
      raise ValueError(
          f"`{fn}(layer_axis={axis})` is out of range for leaf "
          f"{jax.tree_util.keystr(path)} of shape {tuple(np.shape(x))}; give "
          f"None for leaves that stack no layers")
  return tuple(keep)


def norm_tree(tree: PyTree, per_leaf: list[jax.Array]) -> PyTree:
  """``per_leaf`` (one array per clippable leaf) in ``tree``'s structure,
  None where a leaf is not clippable."""
  leaves, treedef = jax.tree.flatten(tree)
  values = iter(per_leaf)
  return treedef.unflatten([next(values) if _tree.is_clippable(x) else None
                            for x in leaves])


def zeros(params: PyTree, keep: tuple[Keep, ...] | None, dtype) -> PyTree:
  """The leaf norms before the first step: zeros of each norm's shape."""
  leaves = _tree.clippable_leaves(params)
  keep = keep or ((),) * len(leaves)
  return norm_tree(params, [jnp.zeros([np.shape(x)[a] for a in kept], dtype)
                            for x, kept in zip(leaves, keep)])


def measure(fn: str, updates: PyTree, p: Any, axis_name: Any, specs: PyTree,
            *, leaf_norms: bool, layer_axis: PyTree = None
            ) -> tuple[jax.Array, PyTree]:
  """The global ``p``-norm of ``updates`` and, with ``leaf_norms``, the
  tree of its leaves' (or layers') norms (else None)."""
  leaves = _tree.clippable_leaves(updates)
  if not leaf_norms:
    reduction = _norms.make_reduction(fn, updates, axis_name, specs)
    return _norms.norm_of_leaves(leaves, p, reduction), None
  keep = layer_keep(fn, updates, layer_axis) or ((),) * len(leaves)
  reduction = _norms.make_reduction(fn, updates, axis_name, specs, keep)
  units = _norms.units(leaves, p, reduction, keep)
  # The norm of the leaf norms (of all devices' units): their partial sums,
  # read once.
  norm = _norms.norm_of_leaves(
      [jnp.concatenate(units.everywhere)] if leaves else [], p)
  return norm, norm_tree(updates, units.here)


def _key_name(key: Any) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def entries(norms: PyTree, name: str = "leaf_norm") -> dict[str, jax.Array]:
  """Flat ``stats`` entries ``name/<path>`` (``/<i>`` per layer) of a leaf
  norm tree; none for None."""
  if norms is None:
    return {}
  found, _ = jax.tree_util.tree_flatten_with_path(norms)
  out = {}
  for path, value in found:
    keys = [_key_name(k) for k in path]
    if path and getattr(path[-1], "name", None) == "value":
      # A flax.nnx Variable (a Param of an nnx.State) holds its array as
      # `.value`: `attn/kernel`, not `attn/kernel/value`.
      keys.pop()
    key = "/".join([name] + keys)
    value = jnp.asarray(value)
    if value.ndim == 0:
      out[key] = value
    else:
      for i in range(value.shape[0]):
        out[f"{key}/{i}"] = value[i]
  return out
