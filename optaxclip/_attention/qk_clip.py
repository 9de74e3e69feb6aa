"""QK-Clip (Kimi K2's MuonClip): rescaling the query and key weights of heads
whose attention logits grew past a threshold, after the optimizer.

For each head ``h`` with largest logit ``S_h`` this step (as the model
reports it), ``gamma_h = threshold / S_h`` when ``S_h > threshold`` (else
1); its query weights are multiplied by ``gamma_h ** alpha`` and its key
weights by ``gamma_h ** (1 - alpha)`` (the report's ``sqrt(gamma_h)`` each,
``alpha = 1/2``), so the logit ``q . k`` shrinks by ``gamma_h``: to the
threshold. MLA's rotary query takes all of ``gamma_h`` and the shared rotary
key none. With grouped-query attention (as Megatron-LM) a group's query
heads and their shared key head take the factor of the group's largest logit.
Fused QKV leaves (Megatron-LM's ``linear_qkv``) take on their query and key
entries the factors separate leaves take (``layout.py``), values none.

The transform returns updates ``u'`` such that ``params + u'`` is the
rescaled ``params + u``: ``u' = t - p``, rounded to the update's dtype (or
one ulp toward ``t`` where only that lands): bit for bit where ``t - p`` is a
float, else within one ulp of ``t - p`` (docs/qk_clip.md, Exactness).
"""

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import base as optax_base

from optaxclip import _validation
from optaxclip._attention import heads as _heads
from optaxclip._attention import layout as _layout
from optaxclip._attention.heads import AttentionHeads
from optaxclip._stats import counters, registry
from optaxclip._types import PyTree, Scalar

Blocks = AttentionHeads | Mapping[str, AttentionHeads]


class QKClipState(NamedTuple):
  """State of ``qk_clip``; every field is a scalar.

  Attributes:
    max_logit: float32 ``[]``: the largest attention logit of the last step,
      over every head of every block (NaN if one was).
    clipped_heads: int32 ``[]``: heads whose logit passed the threshold
      at the last step.
    count: int32 ``[]``: steps seen.
    clipped_count: int32 ``[]``: steps with at least one head clipped.
  """
  max_logit: jax.Array
  clipped_heads: jax.Array
  count: jax.Array
  clipped_count: jax.Array

  @classmethod
  def fresh(cls) -> "QKClipState":
    return cls(max_logit=jnp.zeros([], jnp.float32),
               clipped_heads=jnp.zeros([], jnp.int32),
               count=counters.zero(), clipped_count=counters.zero())


registry.register(QKClipState, "qk_clip", clips=False,
                  extras=lambda state: {"clip_rate": counters.clip_rate(state)})


def _logits(fn: str, blocks: dict[str | None, AttentionHeads], max_logits: Any
            ) -> dict[str | None, jax.Array]:
  """``max_logits`` by block name, each checked for its shape."""
  if max_logits is None:
    raise TypeError(
        f"`{fn}`: update needs the step's largest attention logit of every head: "
        f"`update(updates, state, params, max_logits=...)`")
  if None in blocks:  # one AttentionHeads: one array
    if isinstance(max_logits, Mapping):
      raise TypeError(
          f"`{fn}`: `update(max_logits=...)` must be one array [heads] when `heads` "
          f"is one AttentionHeads, got a dict with keys {sorted(map(str, max_logits))}; "
          f"pass the array, or name the block: heads={{'attn': AttentionHeads(...)}} "
          f"and max_logits={{'attn': ...}}")
    given: Mapping[Any, Any] = {None: max_logits}
  elif not isinstance(max_logits, Mapping) or set(max_logits) != set(blocks):
    raise ValueError(f"`{fn}`: `update(max_logits=...)` must be a dict with the "
                     f"keys of `heads` ({sorted(map(str, blocks))}), got "
                     f"{max_logits!r:.80}")
  else:
    given = max_logits
  found = {}
  for name, block in blocks.items():
    logits = jnp.asarray(given[name])
    rank = 1 if block.layer_axis is None else 2
    heads = logits.shape[-1] if logits.ndim else 0
    want = block.num_heads or (heads if heads and not heads % (block.kv_heads or 1) else -1)
    if logits.ndim != rank or heads != want or not jnp.issubdtype(logits.dtype, jnp.number):
      shape = "[heads]" if rank == 1 else "[layers, heads]"
      count = (f" with heads={block.num_heads} (num_heads)" if block.num_heads else
               f" with heads a multiple of kv_heads={block.kv_heads}" if block.kv_heads
               else "")
      raise ValueError(
          f"`{fn}`: `update(max_logits=...)` for {_heads.label(name)} must be real "
          f"numbers of shape {shape}{count}, got shape {logits.shape} ({logits.dtype})")
    found[name] = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  return found


def _factors(fn: str, blocks: dict[str | None, AttentionHeads], tree: PyTree,
             heads: dict[str | None, int], tables: dict[str | None, jax.Array] | None
             ) -> dict[int, Any]:
  """Each selected leaf's factor by leaf index (its entry codes if
  ``tables`` is None: the shapes checked, for ``init``)."""
  shapes = [np.shape(x) for x in jax.tree.leaves(tree)]
  out = {}
  for name, parts in _heads.resolve(fn, blocks, tree).items():
    block, where = blocks[name], _heads.label(name)
    for part in parts:
      shape = shapes[part.leaf]
      kv, layer = block.kv_heads or heads[name], part.layer_axis
      if tables is not None and layer is not None and shape[layer] != tables[name].shape[0]:
        raise ValueError(
            f"`{fn}`: {where} leaf {part.path!r} stacks {shape[layer]} layers on "
            f"layer_axis, max_logits {tables[name].shape[0]}")
      pieces = _layout.entry_codes(fn, where, block, part, shape, heads[name], kv)
      out[part.leaf] = pieces if tables is None else _layout.leaf_factor(
          tables[name], heads[name] // kv, pieces, part, len(shape))
  return out


def _plan(fn: str, blocks: dict[str | None, AttentionHeads], tree: PyTree,
          logits: dict[str | None, jax.Array], threshold: Any, alpha: Any
          ) -> tuple[dict[int, jax.Array], dict[str | None, jax.Array], jax.Array, jax.Array]:
  """Each selected leaf's factor (by leaf index), each block's factor per
  query head, the largest logit and the number of heads clipped."""
  tables, gammas, largest, clipped = {}, {}, [], []
  for name, block in blocks.items():
    m = logits[name]
    kv = block.kv_heads or m.shape[-1]
    group = jnp.max(m.reshape(*m.shape[:-1], kv, -1), axis=-1)
    passed = (group > threshold) & jnp.isfinite(group)  # NaN, Inf: no clip
    gamma = jnp.where(passed, threshold / jnp.where(passed, group, 1), 1).astype(m.dtype)
    tables[name] = _layout.head_factors(gamma, alpha)
    gammas[name] = jnp.repeat(gamma, m.shape[-1] // kv, axis=-1)
    largest.append(jnp.max(m))
    clipped.append(jnp.sum((m > threshold) & jnp.isfinite(m), dtype=jnp.int32))
  heads = {name: m.shape[-1] for name, m in logits.items()}
  factors = _factors(fn, blocks, tree, heads, tables)
  return (factors, gammas, jnp.max(jnp.stack(largest)).astype(jnp.float32),
          jnp.sum(jnp.stack(clipped)))


def rescaled_update(p: jax.Array, u: jax.Array, f: jax.Array) -> jax.Array:
  """The update that takes ``p`` to ``t``, the applied ``p + u`` times ``f``.

  ``t`` is computed as a user rescaling the applied weights would (float32
  at least, rounded to the parameter's dtype; every operation rounded).
  ``u1 = t - p`` lands on ``t`` whenever that difference is exact
  (Sterbenz: ``p/2 <= t <= 2p``); where its rounding makes ``p + u1``
  miss ``t``, the neighbour of ``u1`` on ``t``'s side is taken if it lands.
  Else ``p + u1`` is within one ulp of ``t - p`` of ``t``: before rounding it
  is off by ``t - p``'s rounding, and rounding to nearest moves it at most as
  far again. Entries with ``f == 1`` keep ``u`` bit for bit.
  """
  def apply(update):  # what optax.apply_updates computes
    return jnp.asarray(p + update).astype(p.dtype)
  # LLVM fuses a multiply feeding an add into one FMA (XLA:CPU and GPU),
  # and XLA drops optimization barriers inside a fusion: nextafter(x, x),
  # x itself, is opaque to both, so p + u and t - p each round on their own.
  u = jax.lax.nextafter(u, u)
  wide = jnp.promote_types(p.dtype, jnp.float32)
  t = (apply(u).astype(wide) * f.astype(wide)).astype(p.dtype)
  t = jax.lax.nextafter(t, t)
  sum_dtype = jnp.result_type(p, u)
  u1 = (t.astype(sum_dtype) - p.astype(sum_dtype)).astype(u.dtype)
  landed = apply(u1)
  toward = jnp.where(landed < t, jnp.inf, -jnp.inf).astype(u.dtype)
  u2 = jnp.nextafter(u1, toward)
  better = (landed != t) & (apply(u2) == t)
  return jnp.where(f == 1, u, jnp.where(better, u2, u1))


def _check(fn: str, threshold: Any, heads: Any, alpha: Any):
  threshold = _validation.check_positive(fn, "threshold", threshold, traced=math.inf)
  number = _validation.scalar(fn, "alpha", alpha)
  if _validation.is_traced(number):  # optax.inject_hyperparams: only arithmetic
    return threshold, _heads.check_blocks(fn, heads), _validation.clamp(number, 0, 1)
  if not 0 < number < 1:
    raise ValueError(f"`{fn}(alpha=...)` must be a number in (0, 1) (the share of "
                     f"the factor the queries take; 0.5 splits it evenly), got {alpha!r}")
  return threshold, _heads.check_blocks(fn, heads), float(number)


def qk_clip_fn(params: PyTree, max_logits: Any, threshold: Scalar = 100.0, *,
               heads: Blocks, alpha: Scalar = 0.5) -> tuple[PyTree, Any]:
  """Rescales the query and key weights of every head whose logit passed ``threshold``.

  The functional form of ``qk_clip``, for weights already updated: each
  head's query weights times ``gamma ** alpha``, its key weights times
  ``gamma ** (1 - alpha)``, ``gamma = threshold / max_logit`` where
  ``max_logit > threshold`` (else 1; NaN and Inf logits leave a head alone).

  Args:
    params: the weights, after the optimizer's step.
    max_logits: each head's largest attention logit this step: an array
      ``[heads]`` (``[layers, heads]`` with ``layer_axis``), or a dict of
      them with the keys of ``heads``.
    threshold: the largest logit a head may keep (a finite number > 0).
    heads: an ``AttentionHeads``, or a dict of them (one per block).
    alpha: the share of the factor taken by the queries (``0 < alpha < 1``).

  Returns:
    The rescaled weights, and each block's ``gamma`` per query head (as
    ``max_logits``; 1 for heads left alone).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> params = {"q": jnp.ones((2, 2)), "k": jnp.ones((2, 2))}  # [in, heads]
    >>> heads = oc.AttentionHeads(query="q", key="k", head_axis=-1)
    >>> params, gamma = oc.functional.qk_clip(params, jnp.array([400.0, 50.0]),
    ...                                       100.0, heads=heads)
    >>> params["q"], gamma  # head 0: sqrt(100 / 400) on each side
    (Array([[0.5, 1. ],
           [0.5, 1. ]], dtype=float32), Array([0.25, 1.  ], dtype=float32))
  """
  fn = "qk_clip"
  threshold, blocks, alpha = _check(fn, threshold, heads, alpha)
  logits = _logits(fn, blocks, max_logits)
  factors, gammas, _, _ = _plan(fn, blocks, params, logits, threshold, alpha)
  leaves, treedef = jax.tree.flatten(params)
  wide = [jnp.promote_types(jnp.result_type(x), jnp.float32) for x in leaves]
  out = [(x.astype(w) * factors[i].astype(w)).astype(x.dtype) if i in factors else x
         for i, (x, w) in enumerate(zip(leaves, wide))]
  return treedef.unflatten(out), gammas[None] if None in blocks else gammas


def qk_clip(threshold: Scalar = 100.0, *, heads: Blocks, alpha: Scalar = 0.5
            ) -> optax.GradientTransformationExtraArgs:
  """QK-Clip (Kimi K2's MuonClip): keeps attention logits at most ``threshold``.

  Chained after the optimizer. ``update(updates, state, params,
  max_logits=...)`` takes each head's largest attention logit of the step,
  as the model reports it, and returns updates that, applied, leave the
  query and key weights of every head whose logit passed ``threshold``
  rescaled as ``functional.qk_clip`` would rescale ``params + updates``
  (bit for bit where the new weight minus the old is a float, else within
  one ulp of that difference; [docs/qk_clip.md](../qk_clip.md), Exactness).
  Other entries' updates pass through untouched. Under
  ``optax.MultiSteps`` the rescale happens once per optimizer step: pass
  the window's running maximum of ``max_logits`` at every micro-step.

  Args:
    threshold: the largest logit a head may keep (K2: 100). Traced, a value
      that is not a finite number > 0 never clips.
    heads: an ``AttentionHeads`` (then ``max_logits`` is one array), or a
      dict of them by block name (then ``max_logits`` is a dict).
    alpha: the queries' share of the factor (Megatron-LM's
      ``--qk-clip-alpha``; the report's 0.5 is ``sqrt(gamma)`` each side).
      Traced (``optax.inject_hyperparams``), clamped to [0, 1].

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its state, a
    ``QKClipState``, logs the largest logit and the heads clipped.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optaxclip as oc
    >>> params = {"q": jnp.ones((2, 2)), "k": jnp.ones((2, 2)), "v": jnp.ones(2)}
    >>> tx = optax.chain(optax.sgd(0.5), oc.qk_clip(
    ...     100.0, heads=oc.AttentionHeads(query="q", key="k", head_axis=-1)))
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, tx.init(params), params,
    ...                            max_logits=jnp.array([400.0, 50.0]))
    >>> optax.apply_updates(params, updates)["k"]  # 0.5 * sqrt(1/4); 0.5
    Array([[0.25, 0.5 ],
           [0.25, 0.5 ]], dtype=float32)
    >>> state[1].clipped_heads, state[1].max_logit
    (Array(1, dtype=int32), Array(400., dtype=float32))

  References:
    Kimi Team, [Kimi K2: Open Agentic Intelligence](https://arxiv.org/abs/2507.20534),
    2025 (section 2.1, MuonClip).
  """
  fn = "qk_clip"
  threshold, blocks, alpha = _check(fn, threshold, heads, alpha)
  declared = {name: b.num_heads for name, b in blocks.items() if b.num_heads}

  def init_fn(params):
    _heads.resolve(fn, blocks, params)  # every block finds its leaves
    if declared:  # their leaves' shapes can be checked now
      _factors(fn, {name: blocks[name] for name in declared}, params, declared, None)
    return QKClipState.fresh()

  def update_fn(updates, state, params=None, *, max_logits=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError(f"`{fn}`: {optax_base.NO_PARAMS_MSG}")
    _validation.check_update(fn, updates, state, QKClipState)
    logits = _logits(fn, blocks, max_logits)
    factors, _, largest, clipped = _plan(fn, blocks, params, logits, threshold, alpha)
    p_leaves = jax.tree.leaves(params)
    u_leaves, treedef = jax.tree.flatten(updates)
    out = [rescaled_update(p_leaves[i], u, factors[i]) if i in factors else u
           for i, u in enumerate(u_leaves)]
    new_state = QKClipState(
        max_logit=largest, clipped_heads=clipped,
        count=counters.increment(state.count),
        clipped_count=counters.count_if(clipped > 0, state.clipped_count))
    return treedef.unflatten(out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
