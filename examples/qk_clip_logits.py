"""Attention logits with and without ``optaxclip.qk_clip``: a plot.

A one-layer, two-head attention model learns to copy the token at a marked
position of a random sequence, with Adam at a high learning rate: the
largest attention logit grows with training. The same run with
``qk_clip(threshold)`` chained after Adam keeps every head's logit near
``threshold``: each step rescales by the logits the model reported before
that step's update, so a step's own growth shows. Both runs are one
compiled program. Writes the plot to ``--out``.

    python examples/qk_clip_logits.py --out docs/img/qk_clip.png
"""

import argparse
import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import optax

import optaxclip as oc

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

VOCAB, SEQ, DIM, HEADS, HEAD_DIM = 16, 12, 32, 2, 16


def init(key):
  keys = jax.random.split(key, 5)
  def dense(k, *shape):
    return jax.random.normal(k, shape) / jnp.sqrt(shape[0])
  return {"embed": dense(keys[0], VOCAB + SEQ, DIM),
          "attn": {"query": dense(keys[1], DIM, HEADS, HEAD_DIM),
                   "key": dense(keys[2], DIM, HEADS, HEAD_DIM),
                   "value": dense(keys[3], DIM, HEADS, HEAD_DIM)},
          "out": dense(keys[4], HEADS * HEAD_DIM, VOCAB)}


def loss_fn(params, tokens, marked):
  """Cross-entropy of the token at ``marked``, read at the last position,
  and the largest attention logit of each head."""
  x = params["embed"][tokens] + params["embed"][VOCAB + jnp.arange(SEQ)]
  x = x.at[jnp.arange(len(tokens)), marked].add(params["embed"][VOCAB + SEQ - 1])
  attn = params["attn"]
  q = jnp.einsum("btd,dhk->bthk", x[:, -1:], attn["query"])
  k = jnp.einsum("btd,dhk->bthk", x, attn["key"])
  logits = jnp.einsum("bqhk,bthk->bhqt", q, k) / jnp.sqrt(HEAD_DIM)
  v = jnp.einsum("btd,dhk->bthk", x, attn["value"])
  mixed = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(logits, -1), v)
  out = mixed.reshape(len(tokens), -1) @ params["out"]
  target = tokens[jnp.arange(len(tokens)), marked]
  loss = optax.softmax_cross_entropy_with_integer_labels(out, target).mean()
  return loss, jnp.max(logits, axis=(0, 2, 3))  # [heads]


HEADS_DECL = oc.AttentionHeads(query="attn/query", key="attn/key", head_axis=-2)


def train(threshold, steps, lr=0.05):
  """The largest logit of every step (before its update), and the loss, of
  Adam followed by ``qk_clip(threshold)``: ``threshold=inf`` never clips,
  which is Adam alone (a traced threshold that is not a finite number > 0
  never clips)."""
  tx = optax.chain(optax.adam(lr), oc.qk_clip(threshold, heads=HEADS_DECL))

  def step(carry, key):
    params, state = carry
    tokens = jax.random.randint(key, (64, SEQ), 0, VOCAB)
    marked = jax.random.randint(jax.random.fold_in(key, 1), (64,), 0, SEQ - 1)
    (loss, max_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, tokens, marked)
    updates, state = tx.update(grads, state, params, max_logits=max_logits)
    return (optax.apply_updates(params, updates), state), (jnp.max(max_logits), loss)

  params = init(jax.random.key(0))
  keys = jax.vmap(jax.random.key)(jnp.arange(steps))
  return jax.lax.scan(step, (params, tx.init(params)), keys)[1]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--threshold", type=float, default=30.0)
  args = parser.parse_args()
  # Both runs, without and with QK-Clip, in one compiled program.
  run = jax.jit(jax.vmap(train, in_axes=(0, None)), static_argnums=1)
  logits, losses = run(jnp.array([jnp.inf, args.threshold]), args.steps)
  (plain, clipped), (plain_loss, clipped_loss) = logits.tolist(), losses.tolist()
  print(f"largest logit without qk_clip: {max(plain):.1f}")
  # A step's own growth shows before its rescale: bounded, not capped.
  print(f"largest logit with qk_clip({args.threshold:g}): {max(clipped):.1f}")
  print(f"final loss: {plain_loss[-1]:.3f} without, {clipped_loss[-1]:.3f} with")

  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(plain, label="Adam")
  ax.plot(clipped, label=f"Adam + qk_clip({args.threshold:g})")
  ax.axhline(args.threshold, color="gray", linestyle=":", label="threshold")
  ax.set_xlabel("step")
  ax.set_ylabel("largest attention logit")
  # Log scale: the unclipped run reaches ~2e4; the clipped one and the
  # threshold (30) would lie flat on 0 on a linear axis.
  ax.set_yscale("log")
  ax.legend()
  fig.tight_layout()
  args.out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
  main()
