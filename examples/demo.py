"""Exploding gradients in a vanilla RNN, and what clipping does about them.

The setting is that of Pascanu, Mikolov & Bengio (2013), "On the difficulty
of training recurrent neural networks", ICML 2013 (arXiv:1211.5063):

* Task: the *adding problem*. Each sequence has 50 steps of two inputs: a
  value drawn uniformly from [0, 1] and a marker. Exactly two steps are
  marked, one in the first 10% of the sequence and one in the second half;
  the target is the sum of the two marked values. Predicting the mean (1.0)
  gives a mean squared error of 1/6 ~ 0.167; doing better needs the network
  to carry a value across most of the sequence.
* Model: a vanilla tanh RNN, ``h_t = tanh(h_{t-1} W + x_t U + b)`` unrolled
  with ``jax.lax.scan``, with a linear read-out of the last state. ``W`` is
  initialised with spectral radius 1.2 > 1, the regime in which the paper
  shows that gradients can explode: most steps have a modest gradient norm,
  but now and then the loss surface has a "cliff" and the norm jumps by
  orders of magnitude.
* Optimizer: SGD with momentum. Without clipping, each cliff throws the
  weights away, the loss stays at the trivial 0.167, and one cliff finally
  sends it to inf and NaN. The same optimizer behind a global-norm
  clip (the paper's remedy) learns the task.

Five runs share the seed, the initial weights and every batch:

1. no clipping,
2. ``optax.clip_by_global_norm(1.0)``,
3. ``optaxclip.clip_by_global_norm(1.0)`` (a drop-in for 2, with stats),
4. ``optaxclip.clip_grad_norm(1.0)`` (PyTorch's ``clip_grad_norm_``),
5. ``optaxclip.clip_by_value(0.01)`` (element-wise; changes the direction).

Runs 2-4 clip the same way up to the last bit of rounding (4 divides by
``norm + 1e-6``, as PyTorch does), but training at this learning rate is
chaotic: their curves part after a few hundred steps and tell the same story.

It prints a summary table and writes ``examples/output/demo.png`` (loss and
pre-clip gradient norm per step). Usage::

    python examples/demo.py            # the full demo, under a minute on CPU
    python examples/demo.py --quick    # a tiny smoke-test configuration
    python examples/demo.py --steps 5000
"""

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

import optaxclip as oc

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

SEED = 0
THRESHOLD = 1.0  # the global-norm threshold of runs 2-4
VALUE_THRESHOLD = 0.01  # run 5, per element: ~ THRESHOLD / sqrt(4353 params)
OUTPUT = pathlib.Path(__file__).resolve().parent / "output" / "demo.png"

FULL = dict(steps=3000, length=50, hidden=64, batch=64, chunk=100)
QUICK = dict(steps=60, length=20, hidden=16, batch=16, chunk=20)
LEARNING_RATE, MOMENTUM, SPECTRAL_RADIUS = 0.07, 0.6, 1.2


def adding_problem(key, batch, length):
  """One batch: inputs [batch, length, 2] and targets [batch]."""
  k_values, k_first, k_second = jax.random.split(key, 3)
  values = jax.random.uniform(k_values, (batch, length))
  first = jax.random.randint(k_first, (batch,), 0, max(length // 10, 1))
  second = jax.random.randint(k_second, (batch,), length // 2, length)
  markers = jax.nn.one_hot(first, length) + jax.nn.one_hot(second, length)
  return jnp.stack([values, markers], axis=-1), jnp.sum(values * markers, 1)


def init_params(key, hidden):
  k_w, k_u, k_v = jax.random.split(key, 3)
  w = np.asarray(jax.random.normal(k_w, (hidden, hidden))) / np.sqrt(hidden)
  w *= SPECTRAL_RADIUS / np.max(np.abs(np.linalg.eigvals(w)))
  return {"W": jnp.asarray(w, jnp.float32),
          "U": jax.random.normal(k_u, (2, hidden)),
          "b": jnp.zeros(hidden),
          "V": jax.random.normal(k_v, (hidden,)) / np.sqrt(hidden),
          "c": jnp.ones(())}  # start at the mean of the target


def loss_fn(params, inputs, targets):
  def cell(h, x_t):
    return jnp.tanh(h @ params["W"] + x_t @ params["U"] + params["b"]), None

  h0 = jnp.zeros((inputs.shape[0], params["W"].shape[0]))
  h, _ = jax.lax.scan(cell, h0, jnp.swapaxes(inputs, 0, 1))  # scan over time
  return jnp.mean((h @ params["V"] + params["c"] - targets) ** 2)


def make_train_chunk(tx, cfg):
  """A jitted function running ``tx`` for a chunk of consecutive steps."""
  data_key = jax.random.PRNGKey(SEED + 1)

  def train_step(carry, step):
    params, opt_state = carry
    batch = adding_problem(jax.random.fold_in(data_key, step), cfg["batch"],
                           cfg["length"])  # the same batches in every run
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    norm = oc.functional.global_norm(grads)  # before clipping
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), (loss, norm)

  @jax.jit
  def train_chunk(params, opt_state, steps):
    return jax.lax.scan(train_step, (params, opt_state), steps)

  return train_chunk


def train(name, tx, cfg):
  """Trains from the shared initial weights; returns per-step logs."""
  params = init_params(jax.random.PRNGKey(SEED), cfg["hidden"])
  opt_state = tx.init(params)
  train_chunk = make_train_chunk(tx, cfg)
  losses, norms = [], []
  for start in range(0, cfg["steps"], cfg["chunk"]):
    steps = jnp.arange(start, min(start + cfg["chunk"], cfg["steps"]))
    (params, opt_state), (loss, norm) = train_chunk(params, opt_state, steps)
    losses.append(np.asarray(loss))
    norms.append(np.asarray(norm))
    progress(name, start + len(steps), cfg["steps"], losses[-1][-1])
  print(file=sys.stderr)
  return {"loss": np.concatenate(losses), "norm": np.concatenate(norms),
          "opt_state": opt_state}


def progress(name, done, total, loss, width=30):
  filled = width * done // total
  bar = "#" * filled + "." * (width - filled)
  print(f"\r{name:<34} [{bar}] {done:>5}/{total}  loss {loss:9.4f}",
        end="", file=sys.stderr, flush=True)


def clip_rate(log, threshold):
  """The fraction of steps that were clipped, as a string."""
  rates = [v for k, v in oc.stats(log["opt_state"]).items()
           if k.endswith("/clip_rate")]
  if rates:  # an optaxclip clipper counted them itself
    return f"{float(rates[0]):.1%}"
  if threshold is None:  # no clipping, or clipping that has no single norm
    return "-"
  norm = log["norm"]
  return f"{np.mean(np.isfinite(norm) & (norm > threshold)):.1%}"


def print_table(runs, logs):
  rows = [("run", "final loss", "NaN steps", "clip rate")]
  for (name, _, threshold), log in zip(runs, logs):
    last = log["loss"][-20:]
    final = "nan" if np.isnan(last).any() else f"{last.mean():.4f}"
    rows.append((name, final, str(int(np.isnan(log["loss"]).sum())),
                 clip_rate(log, threshold)))
  widths = [max(len(row[i]) for row in rows) for i in range(4)]
  for i, row in enumerate(rows):
    cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                         zip(row[1:], widths[1:])]
    print("  ".join(cells))
    if i == 0:
      print("  ".join("-" * w for w in widths))
  print("(final loss: mean of the last 20 steps; predicting the mean gives "
        f"{1 / 6:.3f})")


def smooth(x, window=50):
  window = min(window, len(x))
  return np.convolve(x, np.ones(window) / window, mode="valid")


def y_range(logs, key):
  values = np.concatenate([log[key] for log in logs])
  values = values[np.isfinite(values) & (values > 0)]
  return values.min() / 1.5, values.max() * 1.5


def plot(runs, logs, path):
  fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(13, 4.5))
  styles = ["-", "-", "--", ":", "-"]
  for i, ((name, _, _), log, style) in enumerate(zip(runs, logs, styles)):
    steps = np.arange(len(log["loss"]))
    (line,) = ax_loss.plot(steps[len(steps) - len(smooth(log["loss"])):],
                           smooth(log["loss"]), style, label=name, lw=1.5)
    color = line.get_color()
    ax_loss.plot(steps, log["loss"], color=color, lw=0.5, alpha=0.2)
    ax_norm.plot(steps, log["norm"], style, color=color, lw=0.6, alpha=0.7,
                 label=name, zorder=len(runs) - i)  # the first run on top
    if np.isnan(log["loss"]).any():  # mark where the run died
      first = int(np.argmax(np.isnan(log["loss"])))
      for ax in (ax_loss, ax_norm):
        ax.axvline(first, color=color, lw=1, ls=(0, (1, 3)))
      ax_loss.annotate(f"{name}: NaN from step {first}", (first, 1),
                       xytext=(-5, 0), textcoords="offset points",
                       ha="right", fontsize=8, color=color)
  ax_loss.axhline(1 / 6, color="gray", lw=1, ls="-.", label="predict the mean")
  ax_norm.axhline(THRESHOLD, color="black", lw=1, ls="-.",
                  label=f"clip threshold ({THRESHOLD:g})")
  # A diverging run reaches 1e30 and more: cut the axes where the others live.
  ax_loss.set(yscale="log", ylim=(y_range(logs, "loss")[0], 3), xlabel="step",
              title="training loss (faint: per step; solid: 50-step mean)")
  low, high = y_range(logs, "norm")
  ax_norm.set(yscale="log", ylim=(low, min(high, 1e5)), xlabel="step",
              title="global gradient norm before clipping")
  ax_loss.legend(fontsize=8, loc="lower left")
  ax_norm.legend(fontsize=8, loc="upper left")
  fig.suptitle("Vanilla tanh RNN on the adding problem "
               "(Pascanu, Mikolov & Bengio, 2013)")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, help="training steps per run")
  parser.add_argument("--quick", action="store_true",
                      help="a tiny configuration, for smoke tests")
  parser.add_argument("--out", type=pathlib.Path, default=OUTPUT,
                      help=f"where to write the PNG (default {OUTPUT})")
  args = parser.parse_args()
  cfg = dict(QUICK if args.quick else FULL)
  if args.steps is not None:
    if args.steps < 1:
      parser.error("--steps must be at least 1")
    cfg["steps"] = args.steps

  sgd = optax.sgd(LEARNING_RATE, momentum=MOMENTUM)
  runs = [  # (name, transformation, norm threshold used for the clip rate)
      ("no clipping", sgd, None),
      ("optax.clip_by_global_norm(1)",
       optax.chain(optax.clip_by_global_norm(THRESHOLD), sgd), THRESHOLD),
      ("optaxclip.clip_by_global_norm(1)",
       optax.chain(oc.clip_by_global_norm(THRESHOLD), sgd), THRESHOLD),
      ("optaxclip.clip_grad_norm(1)",
       optax.chain(oc.clip_grad_norm(THRESHOLD), sgd), THRESHOLD),
      (f"optaxclip.clip_by_value({VALUE_THRESHOLD:g})",
       optax.chain(oc.clip_by_value(VALUE_THRESHOLD), sgd), None),
  ]
  print(f"adding problem: length {cfg['length']}, hidden {cfg['hidden']}, "
        f"batch {cfg['batch']}, {cfg['steps']} steps of SGD (lr "
        f"{LEARNING_RATE}, momentum {MOMENTUM}), spectral radius "
        f"{SPECTRAL_RADIUS}, on {jax.devices()[0].platform}", flush=True)
  start = time.perf_counter()
  logs = [train(name, tx, cfg) for name, tx, _ in runs]
  print(f"trained {len(runs)} runs in {time.perf_counter() - start:.1f} s\n")
  print_table(runs, logs)
  plot(runs, logs, args.out)
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
