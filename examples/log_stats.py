"""Logs ``optaxclip.stats`` while training: one CSV row per step, and a plot.

A tiny linear regression trained with Adam behind ``skip_step`` and a
global-norm clip; every few steps one batch is corrupted (targets x100) to
make a gradient spike. Each step's ``optaxclip.stats(opt_state)``
(``clip/norm``, ``skip/skipped_count``, ...), read inside the jitted step,
goes to ``DIR/stats.csv``; ``DIR/stats.png`` plots the loss and the norms.

    python examples/log_stats.py --out /tmp/logstats
"""

import argparse
import csv
import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import optax

import optaxclip as oc

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, required=True,
                      help="folder for stats.csv and stats.png")
  parser.add_argument("--steps", type=int, default=60)
  args = parser.parse_args()
  args.out.mkdir(parents=True, exist_ok=True)

  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (args.steps, 32, 8))
  y = x @ jax.random.normal(kw, (8, 1))
  y = y.at[10::15].multiply(100.0)  # the spikes
  params = {"w": jnp.zeros((8, 1)), "b": jnp.zeros(1)}
  tx = oc.skip_step(optax.chain(oc.clip_by_global_norm(1.0),
                                optax.adam(0.05)), zscore=6.0, warmup_steps=5)

  @jax.jit
  def step(params, opt_state, x, y):
    def loss_fn(p):
      return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {
        "loss": loss, **oc.stats(opt_state)}

  opt_state = tx.init(params)
  rows = []
  for i in range(args.steps):
    params, opt_state, logs = step(params, opt_state, x[i], y[i])
    rows.append({"step": i, **{k: v.item() for k, v in logs.items()}})

  with open(args.out / "stats.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)

  fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
  steps = [r["step"] for r in rows]
  ax1.semilogy(steps, [r["loss"] for r in rows]), ax1.set_ylabel("loss")
  ax2.semilogy(steps, [r["skip/norm"] for r in rows], label="skip/norm")
  ax2.semilogy(steps, [r["clip/norm"] for r in rows], label="clip/norm")
  ax2.set(xlabel="step", ylabel="gradient norm")
  ax2.legend()
  fig.tight_layout()
  fig.savefig(args.out / "stats.png", dpi=100)
  last = rows[-1]
  print(f"wrote {args.out / 'stats.csv'} and {args.out / 'stats.png'}: "
        f"{len(rows)} steps, skipped {last['skip/skipped_count']}, "
        f"clip rate {last['clip/clip_rate']:.0%}, loss {last['loss']:.3g}")


if __name__ == "__main__":
  main()
