"""A float16 run behind the step guards: skipped steps and loss-scale changes.

A linear regression computed in float16 (the parameters are float32 master
weights, cast for the forward pass) trains with
``dynamic_loss_scale(inner=skip_step(chain(clip_by_global_norm(1.0), adam),
zscore=6, loss_zscore=6))``. The scale starts at ``2**8`` and doubles after
every 40 finite steps until the scaled float16 gradients overflow: that step
is dropped and the scale halved, a saw-tooth. Two batches have their targets
multiplied by 30 (a gradient-norm spike), one has small inputs and large
targets (a loss spike with an ordinary gradient): ``skip_step`` skips them.
One batch holds a NaN: an overflow for the loss scale. The plot marks each
skipped step and each overflow on the loss, the gradient norm and the loss
scale, read from ``optaxclip.stats`` inside the jitted step.

    python examples/guarded_training.py --out docs/img/guards_run.png
"""

import argparse
import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

import optaxclip as oc

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NORM_SPIKES = (100, 101)  # targets x30
LOSS_SPIKE = 170  # inputs x0.1, targets x10: the loss jumps, the gradient not
NAN_STEP = 250  # one input is NaN


def batches(steps: int):
  kx, kw, kn = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (steps, 64, 16))
  y = x @ jax.random.normal(kw, (16, 1)) / 4
  y = y + 0.1 * jax.random.normal(kn, y.shape)  # noise: the gradient stays O(0.1)
  y = y.at[jnp.array(NORM_SPIKES)].multiply(30.0)
  x, y = x.at[LOSS_SPIKE].multiply(0.1), y.at[LOSS_SPIKE].multiply(10.0)
  return x.at[NAN_STEP, 0, 0].set(jnp.nan), y


def run(steps: int):
  """Per-step loss, gradient norm, loss scale, skip and overflow flags."""
  tx = oc.dynamic_loss_scale(
      2.0**8, period=40,
      inner=oc.skip_step(optax.chain(oc.clip_by_global_norm(1.0), optax.adam(0.02)),
                         zscore=6.0, loss_zscore=6.0, warmup_steps=20))
  params = {"w": jnp.zeros((16, 1))}

  @jax.jit
  def step(params, opt_state, x, y):
    scale = oc.loss_scale(opt_state)

    def scaled_loss(p):  # float16 compute, float32 master weights
      pred = x.astype(jnp.float16) @ p["w"].astype(jnp.float16)
      loss = jnp.mean((pred - y.astype(jnp.float16)) ** 2)
      return loss * scale.astype(jnp.float16), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    loss = loss.astype(jnp.float32)
    updates, opt_state = tx.update(grads, opt_state, params, loss=loss)
    return optax.apply_updates(params, updates), opt_state, {
        "loss": loss, "scale": scale, **oc.stats(opt_state)}

  opt_state = tx.init(params)
  x, y = batches(steps)
  logs = []
  for t in range(steps):
    params, opt_state, log = step(params, opt_state, x[t], y[t])
    logs.append(log)
  logs = jax.tree.map(lambda *v: np.asarray(v), *logs)
  overflow = np.diff(logs["loss_scale/overflow_count"], prepend=0) > 0
  skipped = np.diff(logs["skip/skipped_count"], prepend=0) > 0
  return logs, overflow, skipped


def plot(logs, overflow, skipped, out: pathlib.Path):
  steps = np.arange(len(overflow))
  fig, (ax_loss, ax_norm, ax_scale) = plt.subplots(3, 1, sharex=True, figsize=(8, 7))
  ax_loss.semilogy(steps, logs["loss"], lw=1, label="loss (unscaled)")
  ax_norm.semilogy(steps, logs["skip/norm"], lw=1, label="gradient norm (unscaled)")
  ax_norm.axhline(1.0, color="gray", ls=":", label="clip threshold")
  ax_scale.semilogy(steps, logs["scale"], base=2, lw=1, drawstyle="steps-post",
                    label="loss scale")
  for ax, key in ((ax_loss, "loss"), (ax_norm, "skip/norm"), (ax_scale, "scale")):
    ax.scatter(steps[skipped], np.nan_to_num(logs[key][skipped], nan=1.0), marker="x",
               color="red", zorder=3, label="skipped by skip_step")
    if ax is ax_scale:
      ax.scatter(steps[overflow], logs[key][overflow], marker="v", color="black",
                 zorder=3, label="overflow: step dropped, scale halved")
    ax.legend(fontsize=8, loc="lower right" if ax is ax_scale else "upper right")
  ax_scale.set_xlabel("step")
  fig.suptitle("float16 regression: dynamic_loss_scale(skip_step(chain(clip, adam)))")
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, required=True, help="the PNG to write")
  parser.add_argument("--steps", type=int, default=600)
  args = parser.parse_args()
  logs, overflow, skipped = run(args.steps)
  plot(logs, overflow, skipped, args.out)
  print(f"{args.steps} steps: {int(overflow.sum())} overflows "
        f"(steps {np.flatnonzero(overflow).tolist()}), "
        f"{int(skipped.sum())} skipped by skip_step "
        f"(steps {np.flatnonzero(skipped).tolist()}), final loss {logs['loss'][-1]:.3g}")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
