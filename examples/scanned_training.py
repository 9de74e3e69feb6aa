"""Per-layer gradient norms of a scanned transformer, logged and plotted.

A small decoder-only transformer whose blocks are stacked on a leading axis
(``nnx.vmap`` builds them, ``nnx.scan`` applies them: one compiled block
whatever the depth) learns a synthetic sequence task on the CPU:
``x[t+1] = (x[t] + x[t-1]) mod vocab`` from two random starting tokens.
The optimizer is ``optax.chain(oc.clip_by_global_norm(1.0, leaf_norms=True,
layer_axis=...), optax.adamw(...))``: ``layer_axis`` marks axis 0 of the
stacked block parameters, so the clip's state keeps one norm per layer of
each stacked leaf, and ``oc.stats`` reports them as
``clip/layer_norm/blocks/<path>/<layer>``. Each step's stats are read inside
the jitted step; the plot shows, per layer, the gradient norm of the whole
block (the root of the sum of its leaves' squared norms), with the global
norm and the threshold, on a log scale.

    python examples/scanned_training.py                 # ~300 steps
    python examples/scanned_training.py --quick --out /tmp/layers.png
"""

import argparse
import collections
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import nnx

import optaxclip as oc

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB, LENGTH, WIDTH, HEADS = 64, 24, 64, 4


class Block(nnx.Module):
  """A pre-norm transformer block: causal self-attention, then an MLP."""

  def __init__(self, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
    self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
  """Embeddings, ``layers`` stacked blocks applied by ``nnx.scan``, a head."""

  def __init__(self, layers: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (LENGTH, WIDTH)))

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make_blocks(rngs):
      return Block(rngs)
    self.blocks = make_blocks(rngs)  # every parameter gets a leading [layers] axis
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.position[:tokens.shape[1]]

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def through(x, block):
      return block(x)
    return self.head(self.norm(through(x, self.blocks)))


def batches(seed: int, steps: int, batch: int) -> np.ndarray:
  """``steps`` batches of sequences with ``x[t+1] = (x[t] + x[t-1]) % VOCAB``."""
  columns = list(np.random.default_rng(seed).integers(0, VOCAB, (2, steps, batch)))
  for _ in range(LENGTH + 1 - 2):
    columns.append((columns[-1] + columns[-2]) % VOCAB)
  return np.stack(columns, axis=-1)


def layer_norms(history: list[dict[str, float]], layers: int) -> list[list[float]]:
  """Per step, each layer's gradient norm: the root of the sum of the
  squared per-layer leaf norms ``clip/layer_norm/blocks/.../<layer>``."""
  pattern = re.compile(r"^clip/layer_norm/blocks/.+/(\d+)$")
  out = []
  for row in history:
    squares: dict[int, float] = collections.defaultdict(float)
    for key, value in row.items():
      found = pattern.match(key)
      if found:
        squares[int(found[1])] += value ** 2
    assert sorted(squares) == list(range(layers)), sorted(squares)
    out.append([math.sqrt(squares[i]) for i in range(layers)])
  return out


def main():
  parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path,
                      default=ROOT / "docs" / "img" / "per_layer_norms.png",
                      help="the PNG to write (default: the one docs/logging.md shows)")
  parser.add_argument("--quick", action="store_true",
                      help="a few steps of a 2-layer model (a smoke test)")
  parser.add_argument("--layers", type=int, default=None, help="stacked blocks (6; quick 2)")
  parser.add_argument("--steps", type=int, default=None, help="training steps (300; quick 20)")
  args = parser.parse_args()
  layers = args.layers or (2 if args.quick else 6)
  steps = args.steps or (20 if args.quick else 300)
  max_norm = 1.0

  # Built under jit: one compile, not one per initializer op.
  model = nnx.jit(lambda: Transformer(layers, nnx.Rngs(0)))()
  graphdef, state = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(state)
  # Axis 0 of every parameter under `blocks` stacks the layers; the other
  # parameters stack nothing.
  layer_axis = {name: 0 if name == "blocks" else None for name in params}
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(20, steps // 2), steps)
  tx = optax.chain(oc.clip_by_global_norm(max_norm, leaf_norms=True, layer_axis=layer_axis),
                   optax.adamw(schedule))
  opt_state = jax.jit(tx.init)(params)

  @jax.jit
  def train_step(params, opt_state, tokens):
    def loss_fn(params):
      nnx.replace_by_pure_dict(state, params)
      logits = nnx.merge(graphdef, state)(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {
        "loss": loss, **oc.stats(opt_state)}

  data = batches(1, steps, batch=32)
  history = []
  for step in range(steps):
    params, opt_state, metrics = train_step(params, opt_state, data[step])
    history.append({k: v.item() for k, v in jax.device_get(metrics).items()})

  per_layer = layer_norms(history, layers)
  fig, ax = plt.subplots(figsize=(7, 4))
  colors = plt.get_cmap("viridis")
  for i in range(layers):
    ax.plot([row[i] for row in per_layer], color=colors(i / max(layers - 1, 1)),
            label=f"layer {i}")
  ax.plot([row["clip/norm"] for row in history], color="black", linestyle="--",
          label="global norm (clip/norm)")
  ax.axhline(max_norm, color="grey", linewidth=0.8, label="max_norm")
  ax.set(yscale="log", xlabel="step", ylabel="gradient norm",
         title=f"Per-layer gradient norms, {layers} scanned blocks")
  ax.legend(fontsize=8, ncol=2)
  fig.tight_layout()
  args.out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(args.out, dpi=100)

  first, last = history[0], history[-1]
  print(f"{steps} steps, {layers} layers: loss {first['loss']:.3f} -> {last['loss']:.3f}, "
        f"clip rate {last['clip/clip_rate']:.0%}")
  print("last step's layer norms: " + " ".join(f"{n:.4g}" for n in per_layer[-1]))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
