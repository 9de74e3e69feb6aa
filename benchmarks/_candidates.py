"""What the targets compare: the clips, and the training step they sit in;
the least programs that do the same work, as floors."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

import optaxclip as oc


def minimal_norm_clip(max_norm: float) -> optax.GradientTransformation:
  """The least global-norm clip: one concatenate of every leaf, one
  `jnp.sum(x * x)`, an `rsqrt` factor; no state, no overflow care.

  What any global clip must compile at least: the baseline of the compile
  targets' "optaxclip's extra / the minimal norm's extra".
  """
  def update(updates, state, params=None):
    del params
    leaves = jax.tree.leaves(updates)
    flat = jnp.concatenate([jnp.ravel(x) for x in leaves])
    factor = jnp.minimum(1.0, max_norm * lax.rsqrt(jnp.sum(flat * flat)))  # 1 at 0: rsqrt is inf
    return jax.tree.map(lambda x: x * factor.astype(x.dtype), updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def floor_norm(tree: Any) -> jax.Array:
  """The least global norm a run time can reach: one read of every leaf
  (a sum of squares per leaf, in float32), no overflow care."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in jax.tree.leaves(tree)))


def floor_clip(tree: Any) -> Any:
  """The least global clip at `max_norm` 1: `floor_norm`, then one read and
  one write of every leaf to scale."""
  factor = jnp.minimum(1.0, 1.0 / floor_norm(tree))  # 1 at 0: 1 / 0 is inf
  return jax.tree.map(lambda x: x * factor.astype(x.dtype), tree)


# Fresh transforms for every measurement (compile-time targets build anew);
# by name, so that a measurement in another process can pick them.
CLIPS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "optaxclip": lambda: oc.clip_by_global_norm(1.0),
    "optaxclip clip_grad_norm": lambda: oc.clip_grad_norm(1.0),
    "optax clip": lambda: optax.clip_by_global_norm(1.0),
    "optax.scale": lambda: optax.scale(0.5),  # one elementwise pass: no clip
    "minimal norm": lambda: minimal_norm_clip(1.0),
}


def adamw_step(clip: optax.GradientTransformation | None
               ) -> tuple[optax.GradientTransformation, Callable[..., Any]]:
  """`(tx, step)`: `tx` is `clip` (when given) chained before AdamW, and
  `step(grads, state, params) -> (params, state)` applies its update, as a
  training loop's step does after the backward pass."""
  adamw = optax.adamw(1e-3)
  tx = optax.chain(clip, adamw) if clip is not None else adamw

  def step(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx, step


# optax.adamw(1e-3)'s settings.
LEARNING_RATE, B1, B2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 1e-4


def handwritten_adamw_init(params: Any) -> tuple[jax.Array, Any, Any]:
  """`(count, mu, nu)` of `handwritten_adamw_step`, as optax.adamw's."""
  return (jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params),
          jax.tree.map(jnp.zeros_like, params))


def handwritten_adamw_step(rollback: bool) -> Callable[..., Any]:
  """`step(grads, state, params, skip) -> (params, state)`: optax.adamw's
  step written out by hand; with `rollback`, a skipped step (`skip`, a bool
  input) leaves the parameters and moments exactly as they were
  (`jnp.where(skip, old, new)`): the least a guard that skips steps adds."""
  def step(grads, state, params, skip):
    count, mu, nu = state
    new_count = count + 1
    new_mu = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, mu, grads)
    new_nu = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, nu, grads)
    t = new_count.astype(jnp.float32)
    mu_c, nu_c = 1 - B1**t, 1 - B2**t  # bias corrections

    def update(m, v, p):
      return -LEARNING_RATE * ((m / mu_c) / (jnp.sqrt(v / nu_c) + EPS) + WEIGHT_DECAY * p)

    updates = jax.tree.map(update, new_mu, new_nu, params)
    if rollback:
      keep = lambda new, old: jnp.where(skip, old, new)
      updates = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), updates)
      new_count = keep(new_count, count)
      new_mu, new_nu = jax.tree.map(keep, new_mu, mu), jax.tree.map(keep, new_nu, nu)
    return jax.tree.map(jnp.add, params, updates), (new_count, new_mu, new_nu)

  return step
