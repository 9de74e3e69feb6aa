"""Clipping before ``optax.contrib.muon``: the 60-step comparison of docs/muon.md, plotted.

The network of docs/muon.md ("Trained side by side"): a small tanh layer
whose extra matrix ``mix`` has gradients of about 1e10 (a badly scaled
layer), trained 60 steps with ``optax.contrib.muon(0.02)`` after each of:
no clip, a global clip (every leaf scaled by the total norm), the AdamW
leaves clipped by their own norm (``optax.masked``), and ``scale_only``
(every leaf measured, the AdamW leaves scaled). The plot shows each run's
mean squared error per step and the clip factor (``clip/scale``).

    python examples/muon_clipping.py --out docs/img/muon_clipping.png
"""

import argparse
import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from optax.contrib import muon

import optaxclip as oc

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def adam_mask(tree):  # True for the leaves optax.contrib.muon gives to AdamW
  return jax.tree.map(lambda x: x.ndim != 2, tree)


kx, k1, k2 = jax.random.split(jax.random.key(0), 3)
X = jax.random.normal(kx, (64, 8))
Y = jnp.sin(2.0 * X[:, :1])
PARAMS = {"w1": 0.3 * jax.random.normal(k1, (8, 32)), "b1": jnp.zeros(32),
          "w2": 0.3 * jax.random.normal(k2, (32, 1)), "b2": jnp.zeros(1),
          "mix": jnp.zeros((4, 4))}


def loss_fn(p):
  pred = jnp.tanh(X @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
  mse = jnp.mean((pred - Y) ** 2)
  return mse + 1e11 * jnp.mean((p["mix"] - jnp.eye(4)) ** 2), mse


def train(clip, steps):
  """The mse before each step and after the last, and each step's factor."""
  tx = optax.chain(clip, muon(0.02)) if clip is not None else muon(0.02)
  state = tx.init(PARAMS)

  @jax.jit
  def step(p, state):
    (_, mse), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
    updates, state = tx.update(grads, state, p)
    scale = oc.stats(state).get("clip/scale", jnp.ones([]))
    return optax.apply_updates(p, updates), state, mse, scale

  p, mses, scales = PARAMS, [], []
  for _ in range(steps):
    p, state, mse, scale = step(p, state)
    mses.append(float(mse))
    scales.append(float(scale))
  return np.array(mses + [float(loss_fn(p)[1])]), np.array(scales)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, required=True, help="the PNG to write")
  parser.add_argument("--steps", type=int, default=60)
  args = parser.parse_args()
  runs = {
      "no clip": None,
      "global clip": oc.clip_by_global_norm(1.0),
      "AdamW leaves only (optax.masked)": optax.masked(oc.clip_by_global_norm(1.0), adam_mask),
      "scale_only=adam_mask": oc.clip_by_global_norm(1.0, scale_only=adam_mask),
  }
  fig, (ax_mse, ax_scale) = plt.subplots(1, 2, figsize=(10, 4))
  # "no clip" wide and grey under the others: the masked run lies on it.
  styles = (dict(color="0.7", lw=5), dict(color="C1"), dict(color="C2"),
            dict(color="C3", ls="--"))
  for (name, clip), style in zip(runs.items(), styles):
    mses, scales = train(clip, args.steps)
    # mses[steps - 1]: the last step's mse, before its update (docs/muon.md's)
    print(f"{name:34} mse {mses[args.steps - 1]:.3f} (after the last step "
          f"{mses[-1]:.3f}), smallest factor {scales.min():.1e}")
    ax_mse.semilogy(mses, label=name, **style)
    if clip is not None:
      ax_scale.semilogy(np.arange(1, args.steps + 1), scales, label=name, **style)
  ax_mse.set(xlabel="step", ylabel="mean squared error",
             title="fit of the AdamW and Muon leaves")
  ax_scale.set(xlabel="step", ylabel="clip/scale",
               title="the clip factor (1: not clipped)")
  ax_mse.legend(fontsize=8)
  ax_scale.legend(fontsize=8)
  fig.tight_layout()
  args.out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(args.out, dpi=100)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
