"""What the targets compare: the clips, and the training step they sit in."""

from collections.abc import Callable
from typing import Any

import optax

import optaxclip as oc

# Fresh transforms for every measurement (compile-time targets build anew);
# by name, so that a measurement in another process can pick them.
CLIPS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "optaxclip": lambda: oc.clip_by_global_norm(1.0),
    "optaxclip clip_grad_norm": lambda: oc.clip_grad_norm(1.0),
    "optax clip": lambda: optax.clip_by_global_norm(1.0),
    "optax.scale": lambda: optax.scale(0.5),  # one elementwise pass: no clip
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
