"""Regenerate the golden parity vectors in ``tests/golden/*.json``.

Run from the repository root with the reference libraries installed::

    python tests/golden/generate.py            # all four files
    python tests/golden/generate.py torch      # only torch.json (or tensorflow, optax,
                                               # gradscaler)

The output is deterministic (fixed seed): rerunning with the same library
versions rewrites identical files.

Every expected value is produced by calling the *real* reference library
(PyTorch, TensorFlow, Optax).  NumPy is only used for the seeded random inputs
and for serialization.  Inputs are float32; every float is written as the
``repr`` of the Python float that holds the exact float32 value, so reading a
number back and casting it to float32 reproduces the original bits.

The heavy imports happen inside the generator functions, so importing this
module (e.g. by ``pytest --doctest-modules``) needs neither torch nor
tensorflow.

``gradscaler.json`` holds float16 training runs under PyTorch's
``GradScaler`` (see ``gen_gradscaler``). The other files' layout::

    {
      "library": ..., "versions": {...}, "generator": "tests/golden/generate.py",
      "trees": {tree_name: {"scales": ..., "leaves": [nested lists, ...]}},
      <function name>: [ {"name": case_name, "tree": tree_name,
                          <arguments>, <results>}, ... ],
      ...
    }

A ``norm_type`` of infinity is stored as the string ``"inf"`` (JSON has no
infinity literal).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20240611

# (name, leaf shapes, per-leaf element scale)
TREE_SPECS = [
    ("vec3_s1", [(3,)], [1.0]),
    ("scalar_s1e-3", [(1,)], [1e-3]),
    ("mat45_vec3_s1", [(4, 5), (3,)], [1.0, 1.0]),
    ("3leaves_s1e3", [(2, 3, 4), (1,), (7, 1, 3)], [1e3] * 3),
    ("5leaves_s1", [(1,), (3,), (4, 5), (2, 3, 4), (7, 1, 3)], [1.0] * 5),
    ("4leaves_s1e-3", [(7, 1, 3), (4, 5), (3,), (1,)], [1e-3] * 4),
    ("2leaves_s1e3", [(4, 5), (2, 3, 4)], [1e3] * 2),
    ("4leaves_mixed", [(3,), (4, 5), (1,), (2, 3, 4)], [1e-3, 1.0, 1e3, 1.0]),
    # All-zero gradients: only the fixed thresholds apply (norm is 0).
    ("2leaves_zeros", [(4, 5), (3,)], [0.0, 0.0]),
]

NORM_TYPES = [1.0, 2.0, 3.0, math.inf]
TINY = 1e-5  # fixed threshold below every tree's norm
LARGE = 1e7  # fixed threshold above every tree's norm


def f32(x) -> float:
  """Python float holding the exact float32 value of ``x``."""
  return float(np.float32(x))


def to_list(a) -> list:
  """float32 array -> nested lists of Python floats (exact float32 values)."""
  a = np.asarray(a, dtype=np.float32)
  return a.astype(np.float64).tolist()


def make_trees() -> dict[str, dict]:
  rng = np.random.default_rng(SEED)
  trees = {}
  for name, shapes, scales in TREE_SPECS:
    leaves = []
    for shape, scale in zip(shapes, scales):
      x = rng.standard_normal(shape)
      # ``0 * x`` would give -0.0 for negative draws; use plain zeros.
      leaves.append((x * scale if scale else np.zeros(shape)).astype(np.float32))
    trees[name] = {"scales": scales, "leaves": leaves}
  return trees


def true_norm(leaves, p: float) -> float:
  """float64 reference norm; only used to place thresholds around the norm."""
  flat = np.concatenate([np.ravel(x).astype(np.float64) for x in leaves])
  if math.isinf(p):
    return float(np.max(np.abs(flat)))
  return float(np.sum(np.abs(flat) ** p) ** (1.0 / p))


def norm_thresholds(norm: float) -> list[tuple[str, float]]:
  fixed = [("tiny", f32(TINY)), ("large", f32(LARGE))]
  if norm == 0.0:
    return fixed
  return [
      ("half", f32(0.5 * norm)),
      ("double", f32(2.0 * norm)),
      ("atnorm", f32(norm)),
  ] + fixed


def value_thresholds(leaves) -> list[tuple[str, float]]:
  m = max(float(np.max(np.abs(x))) for x in leaves)
  fixed = [("tiny", f32(1e-4)), ("large", f32(LARGE))]
  if m == 0.0:
    return fixed
  return [("half_max", f32(0.5 * m)), ("double_max", f32(2.0 * m))] + fixed


def asym_bounds(leaves) -> list[tuple[str, float, float]]:
  m = max(float(np.max(np.abs(x))) for x in leaves)
  if m == 0.0:
    return [("fixed_asym", f32(-1e-4), f32(3e-4))]
  return [
      ("sym_half", f32(-0.5 * m), f32(0.5 * m)),
      ("asym_lo_small", f32(-0.2 * m), f32(0.7 * m)),
      ("asym_hi_small", f32(-0.9 * m), f32(0.1 * m)),
      ("both_positive", f32(0.1 * m), f32(0.4 * m)),
      ("both_negative", f32(-0.6 * m), f32(-0.05 * m)),
  ]


def per_leaf_thresholds(leaves) -> list[tuple[str, float]]:
  norms = sorted(float(np.linalg.norm(x.astype(np.float64))) for x in leaves)
  median = norms[len(norms) // 2]
  fixed = [("tiny", f32(TINY)), ("large", f32(LARGE))]
  if norms[-1] == 0.0:
    return fixed
  return [
      ("half_median_leaf", f32(0.5 * median)),
      ("double_max_leaf", f32(2.0 * norms[-1])),
  ] + fixed


def use_norm_cases(norm: float) -> list[tuple[str, float, float]]:
  """``(label, max_norm, use_norm)``: a given norm below, above and at the
  true one, and 0; for a zero tree, 0 and a norm it does not have."""
  if norm == 0.0:
    return [("use0-tiny", f32(TINY), 0.0), ("use0-large", f32(LARGE), 0.0),
            ("use1-tiny", f32(TINY), 1.0)]
  return [
      ("use_half", f32(norm), f32(0.5 * norm)),  # below max_norm: unchanged
      ("use_double", f32(norm), f32(2.0 * norm)),  # clipped by one half
      ("use_true-half", f32(0.5 * norm), f32(norm)),  # as without use_norm
      ("use0", f32(norm), 0.0),
  ]


def norm_name(p: float) -> str:
  return "inf" if math.isinf(p) else str(int(p))


def serialize_trees(trees) -> dict:
  return {
      name: {"scales": t["scales"], "leaves": [to_list(x) for x in t["leaves"]]}
      for name, t in trees.items()
  }


def base_versions() -> dict:
  return {"python": platform.python_version(), "numpy": np.__version__}


# Well-known documented examples (named cases).
EX_3445 = ("example_3_4__1_2", [[3.0, 4.0], [1.0, 2.0]])
EX_TORCH_DOC = (
    "example_torch_doc",
    [[[-0.1, -0.25, -0.1], [0.1, 0.25, 0.1]], [-0.5, 0.5]],
)


def add_example_trees(out_trees: dict) -> None:
  for name, leaves in (EX_3445, EX_TORCH_DOC):
    out_trees[name] = {
        "scales": None,
        "leaves": [to_list(np.asarray(x, np.float32)) for x in leaves],
    }


# --------------------------------------------------------------------------
# PyTorch
# --------------------------------------------------------------------------


def torch_clip_grad_norm(leaves, max_norm, norm_type):
  import torch

  params = []
  for x in leaves:
    p = torch.nn.Parameter(torch.zeros(x.shape, dtype=torch.float32))
    p.grad = torch.tensor(np.array(x, np.float32))
    params.append(p)
  total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
  return float(total), [p.grad.numpy().copy() for p in params]


def torch_clip_grads_with_norm(leaves, max_norm, total_norm):
  import torch

  params = []
  for x in leaves:
    p = torch.nn.Parameter(torch.zeros(x.shape, dtype=torch.float32))
    p.grad = torch.tensor(np.array(x, np.float32))
    params.append(p)
  torch.nn.utils.clip_grads_with_norm_(
      params, max_norm, torch.tensor(total_norm, dtype=torch.float32))
  return [p.grad.numpy().copy() for p in params]


def torch_clip_grad_value(leaves, clip_value):
  import torch

  params = []
  for x in leaves:
    p = torch.nn.Parameter(torch.zeros(x.shape, dtype=torch.float32))
    p.grad = torch.tensor(np.array(x, np.float32))
    params.append(p)
  torch.nn.utils.clip_grad_value_(params, clip_value)
  return [p.grad.numpy().copy() for p in params]


def gen_torch(trees) -> dict:
  import torch

  out = {
      "library": "torch",
      "versions": {**base_versions(), "torch": torch.__version__},
      "generator": "tests/golden/generate.py",
      "trees": serialize_trees(trees),
      "clip_grad_norm_": [],
      "clip_grad_value_": [],
      "clip_grads_with_norm_": [],
  }
  add_example_trees(out["trees"])
  for tname, t in trees.items():
    leaves = t["leaves"]
    for label, max_norm, use_norm in use_norm_cases(true_norm(leaves, 2.0)):
      out["clip_grads_with_norm_"].append({
          "name": f"{tname}-{label}",
          "tree": tname,
          "max_norm": max_norm,
          "total_norm": use_norm,
          "clipped": [to_list(c) for c in
                      torch_clip_grads_with_norm(leaves, max_norm, use_norm)],
      })
    for p in NORM_TYPES:
      for label, max_norm in norm_thresholds(true_norm(leaves, p)):
        total, clipped = torch_clip_grad_norm(leaves, max_norm, p)
        out["clip_grad_norm_"].append({
            "name": f"{tname}-p{norm_name(p)}-{label}",
            "tree": tname,
            "max_norm": max_norm,
            "norm_type": "inf" if math.isinf(p) else p,
            "total_norm": f32(total),
            "clipped": [to_list(c) for c in clipped],
        })
    for label, c in value_thresholds(leaves):
      clipped = torch_clip_grad_value(leaves, c)
      out["clip_grad_value_"].append({
          "name": f"{tname}-{label}",
          "tree": tname,
          "clip_value": c,
          "clipped": [to_list(x) for x in clipped],
      })
  # Documented examples.
  ex_cases = [(EX_3445, 5.0), (EX_TORCH_DOC, 0.5)]
  for (name, raw), max_norm in ex_cases:
    leaves = [np.asarray(x, np.float32) for x in raw]
    total, clipped = torch_clip_grad_norm(leaves, max_norm, 2.0)
    out["clip_grad_norm_"].append({
        "name": f"{name}-p2-max{max_norm:g}",
        "tree": name,
        "max_norm": f32(max_norm),
        "norm_type": 2.0,
        "total_norm": f32(total),
        "clipped": [to_list(c) for c in clipped],
    })
  name, raw = EX_TORCH_DOC
  leaves = [np.asarray(x, np.float32) for x in raw]
  out["clip_grad_value_"].append({
      "name": f"{name}-value0.1",
      "tree": name,
      "clip_value": f32(0.1),
      "clipped": [to_list(c) for c in torch_clip_grad_value(leaves, f32(0.1))],
  })
  return out


# --------------------------------------------------------------------------
# TensorFlow
# --------------------------------------------------------------------------


def gen_tensorflow(trees) -> dict:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow as tf

  out = {
      "library": "tensorflow",
      "versions": {**base_versions(), "tensorflow": tf.__version__},
      "generator": "tests/golden/generate.py",
      "trees": serialize_trees(trees),
      "clip_by_global_norm": [],
      "clip_by_norm": [],
      "clip_by_value": [],
      "clip_by_global_norm_use_norm": [],
  }
  add_example_trees(out["trees"])

  def tf_leaves(leaves):
    return [tf.constant(np.array(x, np.float32)) for x in leaves]

  for tname, t in trees.items():
    leaves = t["leaves"]
    for label, c, use_norm in use_norm_cases(true_norm(leaves, 2.0)):
      clipped, returned = tf.clip_by_global_norm(
          tf_leaves(leaves), c, use_norm=tf.constant(use_norm, tf.float32))
      out["clip_by_global_norm_use_norm"].append({
          "name": f"{tname}-{label}",
          "tree": tname,
          "clip_norm": c,
          "use_norm": f32(returned.numpy()),
          "clipped": [to_list(x.numpy()) for x in clipped],
      })

  def global_norm_case(name, tname, leaves, c):
    clipped, gnorm = tf.clip_by_global_norm(tf_leaves(leaves), c)
    return {
        "name": name,
        "tree": tname,
        "clip_norm": c,
        "global_norm": f32(gnorm.numpy()),
        "clipped": [to_list(x.numpy()) for x in clipped],
    }

  for tname, t in trees.items():
    leaves = t["leaves"]
    for label, c in norm_thresholds(true_norm(leaves, 2.0)):
      out["clip_by_global_norm"].append(
          global_norm_case(f"{tname}-{label}", tname, leaves, c))
    for label, c in per_leaf_thresholds(leaves):
      clipped = [tf.clip_by_norm(x, c).numpy() for x in tf_leaves(leaves)]
      out["clip_by_norm"].append({
          "name": f"{tname}-{label}",
          "tree": tname,
          "clip_norm": c,
          "clipped": [to_list(x) for x in clipped],
      })
    for label, lo, hi in asym_bounds(leaves):
      clipped = [tf.clip_by_value(x, lo, hi).numpy() for x in tf_leaves(leaves)]
      out["clip_by_value"].append({
          "name": f"{tname}-{label}",
          "tree": tname,
          "clip_value_min": lo,
          "clip_value_max": hi,
          "clipped": [to_list(x) for x in clipped],
      })
  name, raw = EX_3445
  leaves = [np.asarray(x, np.float32) for x in raw]
  out["clip_by_global_norm"].append(
      global_norm_case(f"{name}-max5", name, leaves, f32(5.0)))
  return out


# --------------------------------------------------------------------------
# Optax
# --------------------------------------------------------------------------


def gen_optax(trees) -> dict:
  import warnings

  import jax
  import jax.numpy as jnp
  import optax

  out = {
      "library": "optax",
      "versions": {**base_versions(), "optax": optax.__version__,
                   "jax": jax.__version__},
      "generator": "tests/golden/generate.py",
      "trees": serialize_trees(trees),
      "global_norm": [],
      "clip_by_global_norm": [],
      "clip": [],
  }
  add_example_trees(out["trees"])
  # optax.global_norm is the documented reference but deprecated upstream.
  warnings.filterwarnings("ignore", "optax.global_norm", DeprecationWarning)

  def jleaves(leaves):
    return [jnp.asarray(np.array(x, np.float32)) for x in leaves]

  for tname, t in trees.items():
    leaves = t["leaves"]
    out["global_norm"].append({
        "name": tname,
        "tree": tname,
        "global_norm": f32(np.asarray(optax.global_norm(jleaves(leaves)))),
    })
    for label, c in norm_thresholds(true_norm(leaves, 2.0)):
      tx = optax.clip_by_global_norm(c)
      g = jleaves(leaves)
      upd, _ = tx.update(g, tx.init(g))
      out["clip_by_global_norm"].append({
          "name": f"{tname}-{label}",
          "tree": tname,
          "max_norm": c,
          "clipped": [to_list(np.asarray(x)) for x in upd],
      })
    for label, d in value_thresholds(leaves):
      tx = optax.clip(d)
      g = jleaves(leaves)
      upd, _ = tx.update(g, tx.init(g))
      out["clip"].append({
          "name": f"{tname}-{label}",
          "tree": tname,
          "max_delta": d,
          "clipped": [to_list(np.asarray(x)) for x in upd],
      })
  name, raw = EX_3445
  leaves = [np.asarray(x, np.float32) for x in raw]
  tx = optax.clip_by_global_norm(5.0)
  g = jleaves(leaves)
  upd, _ = tx.update(g, tx.init(g))
  out["clip_by_global_norm"].append({
      "name": f"{name}-max5",
      "tree": name,
      "max_norm": f32(5.0),
      "clipped": [to_list(np.asarray(x)) for x in upd],
  })
  out["global_norm"].append({
      "name": name,
      "tree": name,
      "global_norm": f32(np.asarray(optax.global_norm(g))),
  })
  return out


# --------------------------------------------------------------------------
# PyTorch's GradScaler: float16 training runs (tests/test_loss_scale.py)
# --------------------------------------------------------------------------

# The recipe of docs/migration/pytorch.md#loss-scaling: a linear model in
# float16 maths (as under torch.autocast), a float32 loss, GradScaler with
# these settings, clip_grad_norm_ after unscale_, Adam.
GRADSCALER = {"init_scale": 2.0**16, "growth_interval": 4, "lr": 1e-2,
              "max_norm": 1.0}
# (name, seed, micro-batches, outlier micro-batches (targets x30: their
# scaled float16 gradients overflow), NaN micro-batches, micro-batches per
# optimizer step)
GRADSCALER_RUNS = [
    # the scale grows past 2**16 (a float16 scale would be Inf there)
    ("recipe", 0, 40, (13, 27), (), 1),
    # 25 NaN steps in a row: GradScaler's scale falls to 2**-8 (no floor)
    ("nan_steps", 1, 50, (), tuple(range(5, 30)), 1),
    # accumulation: the scale is fixed for a window, one back-off per window
    ("accumulation", 2, 120, (9, 41, 42, 80), (61, 62), 4),
]


def gradscaler_data(seed: int, steps: int, outliers) -> tuple[np.ndarray, np.ndarray]:
  """Micro-batches ``x`` (steps, 8, 4) and finite targets ``y`` (steps, 8, 1)."""
  rng = np.random.default_rng(seed)
  x = 0.1 * rng.normal(size=(steps, 8, 4)).astype(np.float32)
  y = x @ rng.normal(size=(4, 1)).astype(np.float32)
  y[list(outliers)] *= 30
  return x, y


def gradscaler_run(x, y, nan, k: int) -> dict:
  """Trains with GradScaler; per optimizer step the scale after
  ``scaler.update()`` and Adam's step count, and the final params."""
  import torch

  y = np.array(y, np.float32)
  y[list(nan)] = np.nan
  w = torch.nn.Parameter(torch.zeros(4, 1))
  b = torch.nn.Parameter(torch.zeros(1))
  opt = torch.optim.Adam([w, b], lr=GRADSCALER["lr"])
  scaler = torch.amp.GradScaler("cpu", init_scale=GRADSCALER["init_scale"],
                                growth_interval=GRADSCALER["growth_interval"])
  scales, steps = [], []
  for t in range(0, len(x), k):
    for xb, yb in zip(torch.tensor(x[t:t + k]), torch.tensor(y[t:t + k])):
      pred = (xb.half() @ w.half() + b.half()).float()
      loss = ((pred - yb) ** 2).mean()
      scaler.scale(loss / k).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_([w, b], GRADSCALER["max_norm"])
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scales.append(scaler.get_scale())
    steps.append(int(opt.state[w]["step"]) if opt.state else 0)
  return {"scales": scales, "adam_steps": steps,
          "params": {"w": to_list(w.detach().numpy()),
                     "b": to_list(b.detach().numpy())}}


def gen_gradscaler(trees=None) -> dict:
  import torch

  del trees
  out = {"library": "torch",
         "versions": {**base_versions(), "torch": torch.__version__},
         "generator": "tests/golden/generate.py", "settings": GRADSCALER,
         "runs": []}
  for name, seed, steps, outliers, nan, k in GRADSCALER_RUNS:
    x, y = gradscaler_data(seed, steps, outliers)
    out["runs"].append({"name": name, "k": k, "nan": list(nan),
                        "x": to_list(x), "y": to_list(y),
                        **gradscaler_run(x, y, nan, k)})
  return out


def _dumps(obj) -> str:
  return json.dumps(obj, allow_nan=False, separators=(",", ":"))


def write(name: str, data: dict) -> str:
  """Writes ``data`` as JSON with one tree / one case per line (readable diffs)."""
  parts = []
  for key, value in data.items():
    if isinstance(value, list):
      body = ",\n".join(_dumps(v) for v in value)
      parts.append(f"{_dumps(key)}:[\n{body}\n]")
    elif key == "trees":
      body = ",\n".join(f"{_dumps(k)}:{_dumps(v)}" for k, v in value.items())
      parts.append(f"{_dumps(key)}:{{\n{body}\n}}")
    else:
      parts.append(f"{_dumps(key)}:{_dumps(value)}")
  text = "{\n" + ",\n".join(parts) + "\n}\n"
  assert json.loads(text) == data
  path = os.path.join(HERE, name)
  with open(path, "w") as fh:
    fh.write(text)
  return path


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  which = set(argv) or {"torch", "tensorflow", "optax", "gradscaler"}
  trees = make_trees()
  gens = {"torch": gen_torch, "tensorflow": gen_tensorflow, "optax": gen_optax,
          "gradscaler": gen_gradscaler}
  for lib in ("torch", "tensorflow", "optax", "gradscaler"):
    if lib not in which:
      continue
    data = gens[lib](trees)
    path = write(f"{lib}.json", data)
    n = sum(len(v) for k, v in data.items() if isinstance(v, list))
    print(f"{path}: {n} cases, {os.path.getsize(path)} bytes")
  return 0


if __name__ == "__main__":
  sys.exit(main())
