"""Where an attention block's heads lie: ``AttentionHeads`` and the per-entry factors.

A block declares the leaves of its query projection, its head-specific key
projection and (multi-head latent attention) its rotary query projection,
the axis of each leaf along which the heads lie, and the axis that stacks
layers. Along the head axis a leaf of length ``n * s`` holds ``n`` heads of
``s`` entries each, head-major (``reshape(..., n, s)``): ``s = 1`` for a
kernel shaped ``[in, heads, head_dim]`` on its heads axis, ``s = head_dim``
for a fused ``[heads * head_dim, in]`` weight. Each entry gets the factor
``gamma ** e`` of its head, the exponent ``e`` set by what the entry is:
``alpha`` (query), ``1`` (rotary query), ``1 - alpha`` (key), ``0`` (values
sharing a fused key leaf).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip._types import PyTree

# A leaf selector: a path ("layers/attn/query": that leaf or every leaf
# below it), a predicate of the path, or several of them.
Selector = str | Callable[[str], bool] | Sequence[str | Callable[[str], bool]]

# Exponent codes of an entry's factor: 1, gamma**alpha, gamma**(1-alpha), gamma.
ONE, QUERY, KEY, ROTARY = 0, 1, 2, 3


class AttentionHeads(NamedTuple):
  """Where one attention block's query and key weights are, for ``qk_clip``.

  Attributes:
    query: the query projection's leaves (with MLA the head-specific
      ``q_C``, or ``q_C`` and ``q_R`` fused): a path such as
      ``"layers/attn/query"`` (that leaf and every leaf below it: kernel and
      bias), a predicate of the ``"/"``-joined path, or a sequence of these.
    key: the key projection's head-specific leaves (MLA's ``k_C``), likewise.
    head_axis: the axis of every selected leaf along which the heads lie
      (negative counts from the end, so one value fits kernels and biases).
    layer_axis: the axis that stacks layers (``nn.scan``), or None; then
      ``max_logits`` for the block is ``[layers, heads]``.
    kv_heads: grouped-query attention: the number of key heads (None: as many
      as query heads). Query heads ``g*j ... g*j+g-1`` share key head ``j``.
    query_rotary: MLA: leaves of the per-head rotary query ``q_R`` (scaled by
      ``gamma``); the shared rotary key ``k_R`` is never declared: untouched.
    rotary_dim: MLA with ``q_C`` and ``q_R`` fused in one leaf: the last
      ``rotary_dim`` entries of each query head are ``q_R``.
    key_dim: with keys and values fused in one leaf (DeepSeek's ``wkv_b``):
      the first ``key_dim`` entries of each key head are ``k_C``; the rest
      (values) are untouched. None: every entry is key.
  """
  query: Selector
  key: Selector
  head_axis: int = -2
  layer_axis: int | None = None
  kv_heads: int | None = None
  query_rotary: Selector = ()
  rotary_dim: int = 0
  key_dim: int | None = None


class Part(NamedTuple):
  """One selected leaf: its index among the tree's leaves, its role, and the
  block's axes normalised for its rank."""
  leaf: int
  path: str
  role: int  # QUERY, KEY or ROTARY
  head_axis: int
  layer_axis: int | None


def path_of(keys: tuple[Any, ...]) -> str:
  return jax.tree_util.keystr(keys, simple=True, separator="/")


def _selects(selector: Selector, path: str) -> bool:
  if isinstance(selector, str):
    return path == selector or path.startswith(selector + "/")
  if callable(selector):
    return bool(selector(path))
  return any(_selects(one, path) for one in selector)


def _axis(fn: str, name: str, what: str, axis: int, path: str, ndim: int) -> int:
  if not -ndim <= axis < ndim:
    raise ValueError(
        f"`{fn}(heads=...)`: block {name!r} has {what}={axis}, but leaf {path!r} "
        f"has {ndim} axes; give the axis along which its heads lie")
  return axis % ndim


def resolve(fn: str, blocks: Mapping[str, AttentionHeads], tree: PyTree
            ) -> dict[str, list[Part]]:
  """The leaves each block selects in ``tree``, checked: every selector finds
  a leaf, no leaf is selected twice, axes exist and layer counts agree."""
  with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  taken: dict[int, str] = {}
  found: dict[str, list[Part]] = {}
  for name, block in blocks.items():
    parts = []
    for role, field in ((QUERY, "query"), (KEY, "key"), (ROTARY, "query_rotary")):
      selector = getattr(block, field)
      if field == "query_rotary" and not selector:
        continue
      hits = [(i, path_of(keys), leaf) for i, (keys, leaf) in enumerate(with_paths)
              if _selects(selector, path_of(keys))]
      if not hits:
        shown = ", ".join(repr(path_of(k)) for k, _ in with_paths[:6])
        raise ValueError(
            f"`{fn}(heads=...)`: block {name!r} {field}={selector!r} selects no "
            f"leaf of the parameters; their paths look like {shown}")
      for i, path, leaf in hits:
        if i in taken:
          raise ValueError(f"`{fn}(heads=...)`: leaf {path!r} is selected twice "
                           f"({taken[i]} and {name!r} {field}); select it once")
        taken[i] = f"{name!r} {field}"
        ndim = np.ndim(leaf)
        head = _axis(fn, name, "head_axis", block.head_axis, path, ndim)
        layer = None if block.layer_axis is None else _axis(
            fn, name, "layer_axis", block.layer_axis, path, ndim)
        if layer == head:
          raise ValueError(f"`{fn}(heads=...)`: block {name!r}: head_axis and "
                           f"layer_axis are the same axis of leaf {path!r}")
        parts.append(Part(i, path, role, head, layer))
    found[name] = parts
  return found


def head_factors(gamma: jax.Array, alpha: float) -> jax.Array:
  """``[..., 4]``: the factor of each exponent code, for every head."""
  if alpha == 0.5:  # the report's sqrt(gamma), correctly rounded
    query = key = jnp.sqrt(gamma)
  else:
    query, key = gamma ** alpha, gamma ** (1 - alpha)
  return jnp.stack([jnp.ones_like(gamma), query, key, gamma], axis=-1)


def codes(fn: str, name: str, block: AttentionHeads, part: Part, length: int,
          heads: int) -> np.ndarray:
  """The exponent code of each entry of one head along the head axis."""
  if length % heads:
    raise ValueError(
        f"`{fn}`: block {name!r} leaf {part.path!r} has {length} entries along "
        f"its head axis ({part.head_axis}), not a multiple of its {heads} heads; "
        f"check head_axis, kv_heads and the shape of max_logits")
  size = length // heads
  if part.role == ROTARY:
    return np.full(size, ROTARY)
  if part.role == QUERY:
    if not 0 <= block.rotary_dim < size:
      raise ValueError(f"`{fn}`: block {name!r} rotary_dim={block.rotary_dim} must "
                       f"be in [0, {size}) (entries per query head of {part.path!r})")
    return np.array([QUERY] * (size - block.rotary_dim) + [ROTARY] * block.rotary_dim)
  key_dim = size if block.key_dim is None else block.key_dim
  if not 0 < key_dim <= size:
    raise ValueError(f"`{fn}`: block {name!r} key_dim={block.key_dim} must be in "
                     f"[1, {size}] (entries per key head of {part.path!r})")
  return np.array([KEY] * key_dim + [ONE] * (size - key_dim))


def leaf_factor(table: jax.Array, code: np.ndarray, part: Part, ndim: int
                ) -> jax.Array:
  """Each entry's factor, shaped to broadcast against the leaf.

  ``table`` is ``[heads, 4]`` or ``[layers, heads, 4]``; the result has the
  leaf's rank, its head (and layer) axis full and every other axis 1.
  """
  per_entry = jnp.take(table, jnp.asarray(code), axis=-1)  # [..., heads, size]
  per_entry = per_entry.reshape(*per_entry.shape[:-2], -1)
  shape = [1] * ndim
  shape[part.head_axis] = per_entry.shape[-1]
  if part.layer_axis is not None:
    shape[part.layer_axis] = per_entry.shape[0]
    if part.layer_axis > part.head_axis:
      per_entry = per_entry.T
  return per_entry.reshape(shape)
