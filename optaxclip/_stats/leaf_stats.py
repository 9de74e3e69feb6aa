"""The per-leaf norms a state keeps (``leaf_norms=True``), and their keys.

A state keeps the norm of every clippable leaf as a tree of the gradients'
structure (None where a leaf is not clippable): a scalar per leaf, or with
``layer_axis`` a vector with one norm per layer (per expert with
``expert_axis``, a matrix per layer x expert with both), and then the stacked
leaf's whole norm too (``stack_norms``: the norm of its layers' norms, the
same partial sums). ``optaxclip.stats`` names each entry by its tree path,
``<transform>/leaf_norm/<key>/<key>/...`` (a stacked leaf's whole norm) and
``<transform>/layer_norm/<key>/<key>/.../<i>`` for its layer (or expert)
``i``, ``.../<i>/<j>`` for expert ``j`` of layer ``i`` (a separate name, so
that a sequence index is never read as a layer):
dict keys, sequence indices and attribute names, in tree order, a ``/`` in
a key written ``%2F`` (and ``%`` as ``%25``) so that keys stay one per
leaf, and the ``.value`` of a flax.nnx Variable left out
(docs/logging.md).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip import _core, _tree
from optaxclip._types import PyTree


def zeros(fn: str, params: PyTree, kept: _core.Kept, dtype
          ) -> tuple[PyTree, PyTree]:
  """The leaf norms and stack norms before the first step: zeros."""
  shapes = _core.unit_shapes(fn, params, kept)
  leaves, treedef = jax.tree.flatten(params)
  shapes_iter = iter(shapes)
  per_leaf = [next(shapes_iter) if _tree.is_clippable(x) else None
              for x in leaves]
  norms = treedef.unflatten([None if s is None else jnp.zeros(s, dtype)
                             for s in per_leaf])
  stacks = treedef.unflatten([jnp.zeros([], dtype) if s else None
                              for s in per_leaf])
  return norms, stacks


def measured(measured: _core.Measured, dtype) -> tuple[PyTree, PyTree]:
  """The leaf norms and stack norms of a ``Measured``, in ``dtype``."""
  norms = [n.astype(dtype) for n in measured.here()]
  stacks = [None if s is None else s.astype(dtype)
            for s in measured.stack_norms()]
  return measured.tree(norms), measured.tree(stacks)


def _escaped(key: Any) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      key = getattr(key, attribute)
      break
  return str(key).replace("%", "%25").replace("/", "%2F")


def _is_nnx_variable(x: Any) -> bool:
  """A flax.nnx Variable (a Param of an nnx.State), without importing flax."""
  return any(cls.__name__ == "Variable" and cls.__module__.startswith("flax.nnx")
             for cls in type(x).__mro__)


def _paths(tree: PyTree) -> dict[str, jax.Array]:
  """The non-None leaves of ``tree`` by their escaped path; an nnx
  Variable's array under the Variable's path."""
  found, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_nnx_variable)
  out = {}
  for path, value in found:
    if _is_nnx_variable(value):
      value = jax.tree.leaves(value)[0] if jax.tree.leaves(value) else None
    if value is not None:
      out["/".join(_escaped(k) for k in path)] = jnp.asarray(value)
  return out


def entries(norms: PyTree, stacks: PyTree = None,
            name: str = "leaf_norm") -> dict[str, jax.Array]:
  """Flat ``stats`` entries of a leaf-norm tree: ``name/<path>``, one per
  leaf (a stacked leaf's whole norm), and ``layer_norm/<path>/<i>`` per layer
  or expert of a stacked leaf (``.../<i>/<j>`` per layer x expert); none for
  None."""
  if norms is None:
    return {}
  out = {}
  totals = _paths(stacks) if stacks is not None else {}
  for path, value in _paths(norms).items():
    # Units under their own name: a list index in a path ("mlp/1") is
    # never read as a layer ("mlp/0/1"), whatever the tree holds.
    whole = value if value.ndim == 0 else totals.get(path)
    if whole is not None:
      out["/".join(filter(None, [name, path]))] = whole
    for index in np.ndindex(*value.shape) if value.ndim else ():
      out["/".join(filter(None, ["layer_norm", path, *map(str, index)]))] = (
          value[index])
  return out


def grid_entries(name: str, norms: jax.Array | None) -> dict[str, jax.Array]:
  """Flat ``stats`` entries of a grid of norms (the experts' joint norms):
  ``name/<i>`` per entry of a vector, ``name/<i>/<j>`` of a matrix (layer
  ``i``, expert ``j``); none for None."""
  if norms is None:
    return {}
  return {"/".join([name, *map(str, index)]): norms[index]
          for index in np.ndindex(*norms.shape)}
