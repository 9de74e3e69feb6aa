"""Gradient clipping at work: exploding gradients, and loss spikes under Adam.

Part 1: exploding gradients in a vanilla RNN
--------------------------------------------

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
pre-clip gradient norm per step).

Part 2: loss spikes from outlier batches under Adam
---------------------------------------------------

Large trainings meet another kind of spike: a few bad batches (corrupted
data, a unit bug in one shard) whose gradient is orders of magnitude larger
than usual. The second part trains a small MLP (8 -> 64 -> 64 -> 1, tanh,
read-out initialised at zero) with ``optax.adamw(1e-3)`` to imitate a fixed
random "teacher" network (a regression without noise; the targets have a
standard deviation of about 0.2), and multiplies the targets of the batches
at steps 400, 401, 402, 900 and 1200 (of 1500) by 100. The gradient norm,
about 0.02 by then and below 1 from the first step, jumps to 70-110. The
loss is measured after every step on a fixed clean batch, so the curves show
what the outliers did to the model, not the outliers' own loss. Five runs
share the seed, the initial weights and every batch:

1. a reference: ``optax.adamw`` on the same batches *without* the outliers,
2. no clipping,
3. ``optaxclip.clip_by_global_norm(1.0)``, the customary fixed threshold,
4. ``optaxclip.zclip()`` with its defaults: ZClip (Kumar et al., "ZClip:
   Adaptive Spike Mitigation for LLM Pre-Training", 2025, arXiv:2504.02507)
   tracks the mean and standard deviation of the norm with an EMA, and cuts
   a norm whose z-score exceeds 2.5 back to about the mean,
5. ``optaxclip.skip_step(optax.adamw(1e-3), zscore=6.0, warmup_steps=50)``:
   a step whose norm is more than 6 standard deviations above its running
   mean is dropped (zero update, optimizer state untouched). PaLM (Chowdhery
   et al. 2022, arXiv:2204.02311) skipped the batches around each loss spike
   by hand, restarting from an earlier checkpoint; OLMo-core's skip-step
   optimizers do it on the fly (see also OLMo Team, "2 OLMo 2 Furious",
   2025, arXiv:2501.00656, on loss spikes).

Adam divides each coordinate by the running RMS of its gradients, so what
counts is a gradient's size *relative to the usual one*, and an outlier also
inflates the second moments, which decay over about 1000 steps
(``b2=0.999``) and slow the following updates down. Without clipping, the
outliers (4000 times the usual norm) throw the model far off and stall it:
the loss peaks over 1000 times above the reference's and ends several
times above it. The fixed threshold of 1.0 never acts on an ordinary step,
so that run follows the reference up to step 400; but a clipped outlier is
still 50 times the usual norm: the loss jumps about 100-fold, and ends some
1.5 times above the reference's. ZClip's threshold follows the norm, so an
outlier is cut to about an ordinary step (0.015-0.025) and the curve stays
within a few percent of the reference; ``skip_step`` drops the five
outliers and follows the reference. ZClip's z-score of 2.5 also catches a
few percent of ordinary steps; these are only trimmed.

It prints a second table (loss at the end, worst loss within 50 steps after
an outlier, clip or skip rate from ``optaxclip.stats``, steps skipped) and
writes ``spikes.png`` next to ``demo.png`` (clean loss and pre-clip
gradient norm per step). Usage::

    python examples/demo.py            # both parts, about a minute on CPU
    python examples/demo.py --quick    # a tiny smoke-test configuration
    python examples/demo.py --steps 5000   # steps of the RNN part
"""

import argparse
import functools
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
SPIKES_PNG = "spikes.png"  # part 2's figure, written next to part 1's

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
    params = optax.apply_updates(params, updates)
    return (params, opt_state), {"loss": loss, "norm": norm}

  @jax.jit
  def train_chunk(params, opt_state, steps):
    return jax.lax.scan(train_step, (params, opt_state), steps)

  return train_chunk


def train(name, tx, cfg):
  """Trains from the shared initial weights; returns per-step logs."""
  params = init_params(jax.random.PRNGKey(SEED), cfg["hidden"])
  return run_chunks(name, make_train_chunk(tx, cfg), params, tx.init(params),
                    cfg)


def run_chunks(name, train_chunk, params, opt_state, cfg):
  """Calls ``train_chunk`` until ``cfg["steps"]``; returns per-step logs."""
  chunks = []
  for start in range(0, cfg["steps"], cfg["chunk"]):
    steps = jnp.arange(start, min(start + cfg["chunk"], cfg["steps"]))
    (params, opt_state), log = train_chunk(params, opt_state, steps)
    chunks.append(jax.device_get(log))
    progress(name, start + len(steps), cfg["steps"], chunks[-1]["loss"][-1])
  print(file=sys.stderr)
  logs = jax.tree.map(lambda *steps: np.concatenate(steps), *chunks)
  return {**logs, "opt_state": opt_state}


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


def print_rows(rows):
  """Prints a table: a header, then rows; the first column left-aligned."""
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  for i, row in enumerate(rows):
    cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                         zip(row[1:], widths[1:])]
    print("  ".join(cells))
    if i == 0:
      print("  ".join("-" * w for w in widths))


def print_table(runs, logs):
  rows = [("run", "final loss", "NaN steps", "clip rate")]
  for (name, _, threshold), log in zip(runs, logs):
    last = log["loss"][-20:]
    final = "nan" if np.isnan(last).any() else f"{last.mean():.4f}"
    rows.append((name, final, str(int(np.isnan(log["loss"]).sum())),
                 clip_rate(log, threshold)))
  print_rows(rows)
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


# Part 2: loss spikes from outlier batches under Adam.

SPIKES_FULL = dict(steps=1500, outliers=(400, 401, 402, 900, 1200),
                   hidden=64, batch=64, eval_batch=1024, chunk=100)
SPIKES_QUICK = dict(steps=100, outliers=(60, 61, 80), hidden=16, batch=16,
                    eval_batch=128, chunk=50)
ADAM_LR = 1e-3
INPUTS, TEACHER_HIDDEN = 8, 32
TARGET_SCALE = 0.25  # the teacher's outputs, times this, are the targets
OUTLIER_SCALE = 100.0  # and an outlier batch's targets are multiplied by it
CLIP = 1.0  # the fixed global-norm threshold
ZSCORE = 6.0  # skip_step's threshold
AFTER = 50  # the table's "after an outlier": the 50 steps from one on


@functools.partial(jax.jit, static_argnums=1)  # one compilation, not many
def init_mlp(key, sizes):
  """A tanh MLP with the layer widths ``sizes`` (a tuple), as a list."""
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
          for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def mlp(params, inputs):
  for layer in params[:-1]:
    inputs = jnp.tanh(inputs @ layer["w"] + layer["b"])
  return (inputs @ params[-1]["w"] + params[-1]["b"])[:, 0]


def mse(params, inputs, targets):
  return jnp.mean((mlp(params, inputs) - targets) ** 2)


def teacher_batch(key, size):
  """Inputs [size, INPUTS] and targets [size] from a fixed random network."""
  teacher = init_mlp(jax.random.PRNGKey(SEED + 2), (INPUTS, TEACHER_HIDDEN, 1))
  inputs = jax.random.normal(key, (size, INPUTS))
  return inputs, TARGET_SCALE * mlp(teacher, inputs)


@functools.cache  # runs with the same optimizer share one compilation
def make_spike_chunk(tx, batch, eval_batch, outliers):
  """Like ``make_train_chunk``, for the teacher-student regression.

  ``train_chunk(params, opt_state, steps, scale)`` multiplies the targets
  of the batches at the steps in ``outliers`` by ``scale``. It logs, per
  step, the loss on a fixed clean batch after the update, the pre-clip norm
  and the optaxclip statistics of the optimizer state.
  """
  data_key = jax.random.PRNGKey(SEED + 1)
  outliers = jnp.asarray(outliers, jnp.int32)

  def train_step(carry, step, scale, clean):
    params, opt_state = carry
    inputs, targets = teacher_batch(jax.random.fold_in(data_key, step),
                                    batch)  # the same in every run
    targets *= jnp.where(jnp.any(step == outliers), scale, 1.0)
    grads = jax.grad(mse)(params, inputs, targets)
    norm = oc.functional.global_norm(grads)  # before clipping
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), {"loss": mse(params, *clean), "norm": norm,
                                 "stats": oc.stats(opt_state)}

  @jax.jit
  def train_chunk(params, opt_state, steps, scale):
    clean = teacher_batch(jax.random.PRNGKey(SEED + 3), eval_batch)
    step_fn = functools.partial(train_step, scale=scale, clean=clean)
    return jax.lax.scan(step_fn, (params, opt_state), steps)

  return train_chunk


def train_spikes(name, tx, cfg, scale):
  """Trains with the targets of the outlier batches multiplied by ``scale``."""
  params = init_mlp(jax.random.PRNGKey(SEED),
                    (INPUTS, cfg["hidden"], cfg["hidden"], 1))
  # A zero read-out starts at output 0: the gradient norm then stays below
  # CLIP from the first step, and the fixed clip leaves the run as the
  # reference's up to the first outlier.
  params[-1] = jax.tree.map(jnp.zeros_like, params[-1])
  train_chunk = make_spike_chunk(tx, cfg["batch"], cfg["eval_batch"],
                                 cfg["outliers"])
  return run_chunks(name, functools.partial(train_chunk, scale=scale), params,
                    tx.init(params), cfg)


def after_outliers(cfg):
  """A mask of the steps at most ``AFTER - 1`` steps after an outlier."""
  mask = np.zeros(cfg["steps"], bool)
  for step in cfg["outliers"]:
    mask[step:step + AFTER] = True
  return mask


def print_spike_table(runs, logs, cfg):
  after = after_outliers(cfg)
  reference_peak = logs[0]["loss"][after].max()  # run 0 saw no outlier
  rows = [("run", "final loss", "worst after outliers", "clip/skip rate",
           "steps skipped")]
  for (name, _, _), log in zip(runs, logs):
    stats = oc.stats(log["opt_state"])
    rates = [v for k, v in stats.items()
             if k.endswith(("/clip_rate", "/skip_rate"))]
    skipped = stats.get("skip/skipped_count")
    peak = log["loss"][after].max()
    rows.append((name, f"{log['loss'][-AFTER:].mean():.2e}",
                 f"{peak:.2e} ({peak / reference_peak:.1f}x)",
                 f"{float(rates[0]):.1%}" if rates else "-",
                 "-" if skipped is None else str(int(skipped))))
  print_rows(rows)
  print(f"(loss on a clean batch. final: mean of the last {AFTER} steps; "
        f"worst: the highest\nwithin {AFTER} steps of an outlier batch, and "
        "how many times the reference's)")
  for (name, _, _), log in zip(runs, logs):
    if "zclip/spike_count" in log["stats"]:  # which steps ZClip cut back
      flagged = np.flatnonzero(np.diff(log["stats"]["zclip/spike_count"],
                                       prepend=0))
      caught = np.isin(cfg["outliers"], flagged).sum()
      print(f"({name} cut back {len(flagged)} steps: {caught} of the "
            f"{len(cfg['outliers'])} outliers, and {len(flagged) - caught} "
            "ordinary steps\nwith a z-score above 2.5)")


def plot_spikes(runs, logs, cfg, path):
  fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(13, 5))
  steps = np.arange(cfg["steps"])
  outliers = list(cfg["outliers"])
  for i, ((name, _, _), log) in enumerate(zip(runs, logs)):
    # The reference is a wide grey band, under the runs that follow it; the
    # last run is dashed, to show the one under it.
    color, width = ("0.7", 4) if i == 0 else (f"C{i - 1}", 1)
    ax_loss.plot(steps, log["loss"], color=color, lw=width, label=name,
                 ls="--" if i == len(runs) - 1 else "-", zorder=i)
    ax_norm.plot(steps, log["norm"], color=color, lw=width * 0.6, alpha=0.7,
                 zorder=i)
    # The norm that each clipper handed on to Adam at the outliers.
    scales = [v for k, v in log["stats"].items() if k.endswith("/scale")]
    if scales:
      ax_norm.plot(outliers, (log["norm"] * scales[0])[outliers], "v",
                   color=color, mec="black", ms=8, zorder=10,
                   label=f"{name}: norm after clipping")
  for step in outliers:
    for ax in (ax_loss, ax_norm):
      ax.axvline(step, color="gray", lw=0.8, ls=":", zorder=-1)
  ax_norm.axhline(CLIP, color="black", lw=1, ls="-.",
                  label=f"fixed clip threshold ({CLIP:g})")
  ax_loss.set(yscale="log", xlabel="step",
              title="loss on a clean batch (dotted: outlier batches)")
  low, high = y_range(logs, "norm")
  ax_norm.set(yscale="log", ylim=(low, high * 30), xlabel="step",
              title="global gradient norm before clipping")
  ax_loss.legend(fontsize=8, loc="upper right")
  ax_norm.legend(fontsize=8, loc="upper right")
  fig.suptitle(f"MLP regression with Adam (lr {ADAM_LR:g}); targets "
               f"x{OUTLIER_SCALE:g} at steps " + ", ".join(map(str, outliers)))
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def spikes_part(quick, out):
  cfg = dict(SPIKES_QUICK if quick else SPIKES_FULL)
  adamw = optax.adamw(ADAM_LR)
  runs = [  # (name, transformation, what the outliers' targets are scaled by)
      ("reference (no outliers)", adamw, 1.0),
      ("no clipping", adamw, OUTLIER_SCALE),
      (f"clip_by_global_norm({CLIP:g})",
       optax.chain(oc.clip_by_global_norm(CLIP), adamw), OUTLIER_SCALE),
      ("zclip()", optax.chain(oc.zclip(), adamw), OUTLIER_SCALE),
      (f"skip_step(zscore={ZSCORE:g})",
       oc.skip_step(adamw, zscore=ZSCORE, warmup_steps=50), OUTLIER_SCALE),
  ]
  print(f"\nregression with outliers: MLP {INPUTS}-{cfg['hidden']}-"
        f"{cfg['hidden']}-1, batch {cfg['batch']}, {cfg['steps']} steps of "
        f"adamw (lr {ADAM_LR:g}); targets x{OUTLIER_SCALE:g} at steps "
        + ", ".join(map(str, cfg["outliers"])), flush=True)
  start = time.perf_counter()
  logs = [train_spikes(name, tx, cfg, scale) for name, tx, scale in runs]
  print(f"trained {len(runs)} runs in {time.perf_counter() - start:.1f} s\n")
  print_spike_table(runs, logs, cfg)
  plot_spikes(runs, logs, cfg, out)
  print(f"\nwrote {out}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int,
                      help="training steps per run of part 1 (the RNN)")
  parser.add_argument("--quick", action="store_true",
                      help="a tiny configuration, for smoke tests")
  parser.add_argument("--out", type=pathlib.Path, default=OUTPUT,
                      help=f"where to write part 1's PNG (default {OUTPUT}); "
                      f"part 2's goes next to it as {SPIKES_PNG}")
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
  spikes_part(args.quick, args.out.with_name(SPIKES_PNG))


if __name__ == "__main__":
  main()
