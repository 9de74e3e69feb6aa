"""Where an attention block's heads lie: ``AttentionHeads``, its checks and
the leaves each block selects.

A block declares the leaves of its query projection, its head-specific key
projection, (multi-head latent attention) its rotary query projection, or
one leaf holding queries, keys and values fused; the axis of each leaf
along which the heads lie; the axis that stacks layers; and the number of
heads, which lets every leaf's shape be checked (``layout.py`` says which
entry belongs to which head).
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeGuard

import jax
import numpy as np

from optaxclip._types import PyTree

# A leaf selector: a path ("layers/attn/query": that leaf or every leaf
# below it), a predicate of the path, or several of them.
Selector = str | Callable[[str], bool] | Sequence[str | Callable[[str], bool]]

# What a selected leaf holds: the roles are the fields that select it.
QUERY, KEY, ROTARY, QKV = "query", "key", "query_rotary", "qkv"
LAYOUTS = ("megatron", "concat")


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
    num_heads: the number of query heads: ``max_logits`` must have that
      many, and a leaf may hold several entries per head along its head axis
      (``[heads * head_dim, in]``). None: taken from ``max_logits``, and each
      entry along a head axis must be one head (``[in, heads, head_dim]``).
    qkv: leaves holding queries, keys and values fused (values untouched).
    qkv_layout: how ``qkv`` leaves order them along the head axis:
      ``"megatron"`` (Megatron-LM's ``linear_qkv``: per key head, its group's
      query heads, then the key head, then the value head) or ``"concat"``
      (every query head, then every key head, then every value head).
    qkv_axis: with ``"concat"``: the axis of length 3 that separates query,
      key and value, for a kernel ``[in, 3, heads, head_dim]`` (``-3``).

  Examples:
    >>> import optaxclip as oc
    >>> oc.AttentionHeads(qkv="attn/linear_qkv", qkv_layout="megatron",
    ...                   head_axis=0, num_heads=8, kv_heads=2).qkv
    'attn/linear_qkv'
  """
  query: Selector = ()
  key: Selector = ()
  head_axis: int = -2
  layer_axis: int | None = None
  kv_heads: int | None = None
  query_rotary: Selector = ()
  rotary_dim: int = 0
  key_dim: int | None = None
  num_heads: int | None = None
  qkv: Selector = ()
  qkv_layout: Literal["megatron", "concat"] | None = None
  qkv_axis: int | None = None


class Part(NamedTuple):
  """One selected leaf: its index among the tree's leaves, its role, and the
  block's axes normalised for its rank."""
  leaf: int
  path: str
  role: str  # QUERY, KEY, ROTARY or QKV
  head_axis: int
  layer_axis: int | None
  qkv_axis: int | None


def label(name: str | None) -> str:
  """How errors name a block: the lone ``AttentionHeads`` or ``heads[name]``."""
  return "AttentionHeads" if name is None else f"heads[{name!r}]"


def path_of(keys: tuple[Any, ...]) -> str:
  return jax.tree_util.keystr(keys, simple=True, separator="/")


def _is_int(value: Any) -> TypeGuard[int]:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_selector(value: Any, nested: bool = False) -> bool:
  if isinstance(value, str) or callable(value):
    return True
  return not nested and isinstance(value, Sequence) and all(
      _is_selector(one, nested=True) for one in value)


# Integer fields: (field, least value (-inf for an axis), None allowed, what it is).
_INTS = (("head_axis", -math.inf, False, "the axis of every selected leaf along which the heads "
          "lie, e.g. -2 for kernels [in, heads, head_dim]"),
         ("layer_axis", -math.inf, True, "the axis that stacks layers"),
         ("qkv_axis", -math.inf, True, "the axis of length 3 of a qkv kernel [in, 3, heads, "
          "head_dim]"),
         ("num_heads", 1, True, "the number of query heads"),
         ("kv_heads", 1, True, "the number of key heads"),
         ("key_dim", 1, True, "the entries of each key head that are keys"),
         ("rotary_dim", 0, False, "the rotary entries of each query head"))


def check(fn: str, name: str | None, block: Any) -> None:
  """Every field of one block, whatever form ``heads`` took."""
  where = f"`{fn}(heads=...)`: {label(name)}"
  if not isinstance(block, AttentionHeads):
    raise TypeError(f"{where} must be an AttentionHeads, got {block!r:.80}")
  for field in (QUERY, KEY, ROTARY, QKV):
    if not _is_selector(getattr(block, field)):
      raise TypeError(f"{where}.{field} must be a leaf path such as 'layers/attn/{field}', "
                      f"a predicate of the path, or a sequence of them, got "
                      f"{getattr(block, field)!r:.80}")
  for field, least, optional, what in _INTS:
    value = getattr(block, field)
    if (value is None and optional) or (_is_int(value) and value >= least):
      continue
    kind = "an int" if least == -math.inf else f"an int >= {least}"
    raise (ValueError if _is_int(value) else TypeError)(
        f"{where}.{field} must be {kind}{' or None' if optional else ''} ({what}), "
        f"got {value!r:.80}")
  if block.num_heads and block.kv_heads and block.num_heads % block.kv_heads:
    raise ValueError(f"{where}: num_heads={block.num_heads} must be a multiple of "
                     f"kv_heads={block.kv_heads} (each key head serves a group)")
  _check_qkv(where, block)
  for side in (QUERY, KEY):
    if not (getattr(block, side) or block.qkv):
      raise ValueError(f"{where} declares no {side} leaves: give query= and key= "
                       f"(separate projections), or qkv= (one fused leaf)")


def _check_qkv(where: str, block: AttentionHeads) -> None:
  if not block.qkv:
    for field in ("qkv_layout", "qkv_axis"):
      if getattr(block, field) is not None:
        raise ValueError(f"{where}.{field}={getattr(block, field)!r} describes qkv "
                         f"leaves, but qkv selects none: give qkv=, or drop {field}")
    return
  if block.qkv_layout not in LAYOUTS:
    raise ValueError(
        f"{where}.qkv_layout must be 'megatron' (per key head: its group's query "
        f"heads, its key head, its value head) or 'concat' (every query head, then "
        f"every key head, then every value head), got {block.qkv_layout!r}")
  if block.qkv_axis is not None and block.qkv_layout != "concat":
    raise ValueError(f"{where}.qkv_axis={block.qkv_axis} separates query, key and "
                     f"value on their own axis: that layout is qkv_layout='concat'")
  if block.qkv_axis is not None and block.kv_heads not in (None, block.num_heads):
    raise ValueError(f"{where}.qkv_axis: a kernel [in, 3, heads, head_dim] holds as many "
                     f"key heads as query heads, got kv_heads={block.kv_heads}")
  if block.query_rotary or block.rotary_dim or block.key_dim is not None:
    raise ValueError(f"{where}: qkv leaves hold no rotary or latent parts; MLA's "
                     f"projections are separate: declare them with query=, key=, "
                     f"query_rotary=, rotary_dim= and key_dim=")


def check_blocks(fn: str, heads: Any) -> dict[str | None, AttentionHeads]:
  """The blocks by name (None for a lone ``AttentionHeads``), each checked."""
  blocks: dict[str | None, Any]
  if isinstance(heads, AttentionHeads):
    blocks = {None: heads}
  elif isinstance(heads, Mapping) and heads:
    blocks = {str(name): block for name, block in heads.items()}
  else:
    raise TypeError(
        f"`{fn}(heads=...)` must be an AttentionHeads or a non-empty dict of "
        f"them (one per attention block), got {heads!r:.80}")
  for name, block in blocks.items():
    check(fn, name, block)
  return blocks


def _selects(selector: Selector, path: str) -> bool:
  if isinstance(selector, str):
    return path == selector or path.startswith(selector + "/")
  if callable(selector):
    return bool(selector(path))
  return any(_selects(one, path) for one in selector)


def _axis(fn: str, name: str | None, field: str, axis: int, path: str, ndim: int) -> int:
  if not -ndim <= axis < ndim:
    raise ValueError(
        f"`{fn}(heads=...)`: {label(name)}.{field}={axis}, but leaf {path!r} "
        f"has {ndim} axes; give the axis along which its heads lie")
  return axis % ndim


def _part(fn: str, name: str | None, block: AttentionHeads, index: int, path: str,
          role: str, ndim: int) -> Part:
  head = _axis(fn, name, "head_axis", block.head_axis, path, ndim)
  layer = None if block.layer_axis is None else _axis(
      fn, name, "layer_axis", block.layer_axis, path, ndim)
  fused = None if block.qkv_axis is None or role != QKV else _axis(
      fn, name, "qkv_axis", block.qkv_axis, path, ndim)
  axes = [axis for axis in (head, layer, fused) if axis is not None]
  if len(set(axes)) < len(axes):
    raise ValueError(f"`{fn}(heads=...)`: {label(name)}: head_axis, layer_axis and "
                     f"qkv_axis must be different axes of leaf {path!r}")
  return Part(index, path, role, head, layer, fused)


def resolve(fn: str, blocks: Mapping[str | None, AttentionHeads], tree: PyTree
            ) -> dict[str | None, list[Part]]:
  """The leaves each block selects in ``tree``, checked: every selector finds
  a leaf, no leaf is selected twice, and the axes exist."""
  with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  taken: dict[int, str] = {}
  found: dict[str | None, list[Part]] = {}
  for name, block in blocks.items():
    parts = []
    for role in (QUERY, KEY, ROTARY, QKV):
      selector = getattr(block, role)
      if not selector:  # none declared (check() made sure queries and keys are)
        continue
      hits = [(i, path_of(keys), leaf) for i, (keys, leaf) in enumerate(with_paths)
              if _selects(selector, path_of(keys))]
      if not hits:
        shown = ", ".join(repr(path_of(k)) for k, _ in with_paths[:6])
        raise ValueError(
            f"`{fn}(heads=...)`: {label(name)}.{role}={selector!r} selects no "
            f"leaf of the parameters; their paths look like {shown}")
      for i, path, leaf in hits:
        if i in taken:
          raise ValueError(f"`{fn}(heads=...)`: leaf {path!r} is selected twice "
                           f"({taken[i]} and {label(name)}.{role}); select it once")
        taken[i] = f"{label(name)}.{role}"
        parts.append(_part(fn, name, block, i, path, role, np.ndim(leaf)))
    found[name] = parts
  return found
