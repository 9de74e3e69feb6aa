"""Which head each entry of a selected leaf belongs to, and its factor.

Along its head axis a leaf holds ``n`` slots of ``s`` entries each,
slot-major (``reshape(..., n, s)``): ``s = 1`` for a kernel
``[in, heads, head_dim]`` on its heads axis, ``s = head_dim`` for a fused
``[heads * head_dim, in]`` weight. The slots are, by what the leaf holds:

- query (``q_C``, or ``q_C`` and ``q_R`` fused): one per query head, the
  last ``rotary_dim`` entries of each rotary; rotary query: one per head;
- key: one per key head, its first ``key_dim`` entries keys, the rest values;
- qkv, ``"megatron"`` (Megatron-LM's ``linear_qkv``, ``[ng, (np/ng + 2) * hn]``
  in its ``get_query_key_value_tensors``): per key head ``j``, the ``g``
  query heads of its group, then key head ``j``, then value head ``j``;
- qkv, ``"concat"``: every query head, every key head, every value head;
  with ``qkv_axis``, the three parts along that axis (``[in, 3, heads, d]``).

Each entry's factor is ``gamma ** e`` of its key head's group, the exponent
set by its code: ``alpha`` (query), ``1 - alpha`` (key), ``1`` (rotary
query), ``0`` (values): entry ``(group, code)`` reads ``table[group, code]``.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optaxclip._attention.heads import KEY, QKV, QUERY, ROTARY, AttentionHeads, Part

# Exponent codes of an entry's factor: 1, gamma**alpha, gamma**(1-alpha), gamma.
ONE, Q, K, R = 0, 1, 2, 3


def head_factors(gamma: jax.Array, alpha: Any) -> jax.Array:
  """``[..., 4]``: the factor of each exponent code, for every group."""
  root = jnp.sqrt(gamma)  # the report's sqrt(gamma), correctly rounded
  if isinstance(alpha, float):
    query, key = (root, root) if alpha == 0.5 else (gamma ** alpha, gamma ** (1 - alpha))
  else:  # traced (optax.inject_hyperparams): 0.5 still takes the square root
    alpha = jnp.asarray(alpha, gamma.dtype)
    query = jnp.where(alpha == 0.5, root, gamma ** alpha)
    key = jnp.where(alpha == 0.5, root, gamma ** (1 - alpha))
  return jnp.stack([jnp.ones_like(gamma), query, key, gamma], axis=-1)


def _slot_size(fn: str, where: str, block: AttentionHeads, part: Part, length: int,
               slots: int, what: str, heads: int) -> int:
  """Entries per slot, checked against the declared (or inferred) heads."""
  if block.num_heads is None and length != slots:
    raise ValueError(
        f"`{fn}`: {where} leaf {part.path!r} has {length} entries along its head "
        f"axis ({part.head_axis}), but max_logits has {heads} heads ({slots} {what}). "
        f"Several entries per head (a fused [heads * head_dim, in] weight) need the "
        f"heads declared: AttentionHeads(..., num_heads={heads}) if that is right; "
        f"else max_logits or head_axis is wrong")
  if length % slots:
    raise ValueError(
        f"`{fn}`: {where} leaf {part.path!r} has {length} entries along its head "
        f"axis ({part.head_axis}), not a multiple of its {slots} {what}; check "
        f"head_axis, num_heads and kv_heads")
  return length // slots


def entry_codes(fn: str, where: str, block: AttentionHeads, part: Part,
                shape: tuple[int, ...], heads: int, kv: int) -> list[tuple[bool, np.ndarray]]:
  """The leaf's entries along its head axis, as pieces laid end to end (or
  stacked on ``qkv_axis``): ``(per query head, codes)`` holds one run of
  ``codes`` for every query head (else every key head), in head order."""
  length, g, fused = shape[part.head_axis], heads // kv, part.qkv_axis
  stacked = part.role == QKV and fused is not None
  if fused is not None and (shape[fused] != 3 or kv != heads):
    raise ValueError(
        f"`{fn}`: {where} leaf {part.path!r} has {shape[fused]} entries "
        f"along qkv_axis ({fused}) and {kv} key heads for {heads} heads; "
        f"a kernel [in, 3, heads, head_dim] needs 3 and kv_heads=None")
  slots = {QUERY: heads, ROTARY: heads, KEY: kv}.get(
      part.role, heads if stacked else heads + 2 * kv)
  what = "heads" if stacked else {
      QUERY: "query heads", ROTARY: "query heads", KEY: "key heads",
      QKV: f"query, key and value heads ({heads} + 2 x {kv})"}[part.role]
  size = _slot_size(fn, where, block, part, length, slots, what, heads)
  if part.role != QKV:
    return [(part.role != KEY, _entry_codes(fn, where, block, part, size))]
  if block.qkv_layout == "megatron":  # per key head: g queries, the key, the value
    return [(False, np.repeat([Q] * g + [K, ONE], size))]
  return [(True, np.full(size, Q)), (False, np.full(size, K)), (False, np.full(size, ONE))]


def _entry_codes(fn: str, where: str, block: AttentionHeads, part: Part, size: int
                 ) -> np.ndarray:
  """The code of each entry of one slot of a separate query or key leaf."""
  if part.role == ROTARY:
    return np.full(size, R)
  if part.role == QUERY:
    if not 0 <= block.rotary_dim < size:
      raise ValueError(f"`{fn}`: {where}.rotary_dim={block.rotary_dim} must be in "
                       f"[0, {size}) (entries per query head of {part.path!r})")
    return np.array([Q] * (size - block.rotary_dim) + [R] * block.rotary_dim)
  key_dim = size if block.key_dim is None else block.key_dim
  if not 0 < key_dim <= size:
    raise ValueError(f"`{fn}`: {where}.key_dim={block.key_dim} must be in "
                     f"[1, {size}] (entries per key head of {part.path!r})")
  return np.array([K] * key_dim + [ONE] * (size - key_dim))


def leaf_factor(table: jax.Array, group: int, pieces: list[tuple[bool, np.ndarray]],
                part: Part, ndim: int) -> jax.Array:
  """Each entry's factor, shaped to broadcast against the leaf.

  ``table`` is ``[kv, 4]`` or ``[layers, kv, 4]`` (``head_factors``),
  ``group`` the query heads per key head (``entry_codes`` the pieces); the
  result has the leaf's rank, its head (layer, qkv) axes full and every
  other axis 1. Codes are gathered along the table's last axis only, so a
  table sharded over heads keeps its sharding.
  """
  bases = {False: table, True: jnp.repeat(table, group, axis=-2) if group > 1 else table}
  runs = []
  for per_query_head, codes in pieces:
    run = jnp.take(bases[per_query_head], jnp.asarray(codes), axis=-1)  # [..., n, size]
    runs.append(run.reshape(*run.shape[:-2], -1))
  if part.qkv_axis is not None:
    per_entry = jnp.stack(runs, axis=-2)
  else:
    per_entry = runs[0] if len(runs) == 1 else jnp.concatenate(runs, axis=-1)
  axes = [a for a in (part.layer_axis, part.qkv_axis, part.head_axis) if a is not None]
  shape = [1] * ndim
  for axis, n in zip(axes, per_entry.shape):
    shape[axis] = n
  return jnp.transpose(per_entry, sorted(range(len(axes)), key=axes.__getitem__)
                       ).reshape(shape)
