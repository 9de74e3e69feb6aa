"""What many test files share: float64 reference norms, the stacked-layer
gradient tree, meshes and HLO counts, gradient sequences with spikes, and
running a subprocess.

(Hypothesis strategies for random trees and hyperparameters are in
``fuzzing.py``; outlier sequences for the adaptive clippers in
``outliers.py``.)
"""

import math
import os
import pathlib
import re
import signal
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding

# Whether this run sends every norm through the GPU/TPU kernel on the CPU
# (``make test`` runs the numerics tests once more that way, with the
# leaves grouped as on a TPU: ``one_pass_tpu``), and with which grouping:
# the CPU's (``one_pass``) or a platform's.
KERNEL = os.environ.get("OPTAXCLIP_KERNEL", "auto")
ONE_PASS = KERNEL.startswith("one_pass")

# --------------------------------------------------------------------------
# float64 references

def f64(x) -> np.ndarray:
  """The values as stored, in float64 (bfloat16 and float16 through float32;
  float64 values, and Python floats, as they are)."""
  x = np.asarray(x)
  return x if x.dtype == np.float64 else np.asarray(np.asarray(x, np.float32), np.float64)


def f64_leaves(tree) -> list[np.ndarray]:
  return [f64(x) for x in jax.tree.leaves(tree)]


def _wide(x) -> np.ndarray:
  """|x| of the values as stored, in float64 (complex leaves by modulus)."""
  if np.iscomplexobj(x) or jnp.issubdtype(jnp.result_type(x), jnp.complexfloating):
    return np.abs(np.asarray(x, np.complex128))
  return np.abs(f64(x))


def np_norm(leaves, ord=2) -> float:
  """The float64 ``ord``-norm of all values of ``leaves`` (a list) together.

  Scaled by the largest |x| first, so that no power overflows or underflows
  (orders up to 1e5, values up to 3e38); the inf-norm is the largest |x|.
  NaN anywhere gives NaN, an Inf (and no NaN) Inf.
  """
  flat = np.concatenate([_wide(x).ravel() for x in leaves] + [np.zeros(0)])
  peak = float(flat.max(initial=0.0)) if not np.isnan(flat).any() else math.nan
  if ord in (math.inf, "inf") or peak == 0 or not math.isfinite(peak):
    return peak
  p = float(ord)
  return peak * float(np.sum((flat / peak) ** p)) ** (1 / p)


def np_leaf_norm(x, ord=2, layer_axis=None):
  """The float64 ``ord``-norm of the array ``x``, or with ``layer_axis`` of
  each of its slices along that axis (a vector)."""
  if layer_axis is None:
    return np_norm([x], ord)
  return np.asarray([np_norm([layer], ord)
                     for layer in np.moveaxis(_wide(x), layer_axis, 0)])


def np_factor(norm, max_norm, eps=0.0) -> np.ndarray:
  """The clip factor: 1 when ``norm + eps <= max_norm``, else
  ``max_norm / (norm + eps)`` (elementwise for arrays of norms)."""
  norm = np.asarray(norm, np.float64) + eps
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(norm <= max_norm, 1.0, max_norm / norm)


def ulps(a, b) -> int:
  """How many float32 values lie between ``a`` and ``b``."""
  a, b = np.float32(a), np.float32(b)
  return abs(int(a.view(np.int32)) - int(b.view(np.int32)))


class Largest:
  """The largest relative difference seen per quantity (printed by the tests)."""

  def __init__(self):
    self.seen = {}

  def check(self, name, actual, expected, rtol=1e-5, floor=1e-30):
    """Relative difference, taken against ``max(|expected|, floor)``."""
    actual = np.asarray(np.asarray(actual, np.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    difference = np.abs(actual - expected) / np.maximum(np.abs(expected), floor)
    largest = float(np.max(difference, initial=0.0))
    self.seen[name] = max(self.seen.get(name, 0.0), largest)
    assert largest <= rtol, f"{name}: relative difference {largest:.3g}"

  def report(self, title):
    print(f"\n{title}: largest relative differences: " + ", ".join(
        f"{k} {v:.2e}" for k, v in sorted(self.seen.items())))


# --------------------------------------------------------------------------
# Small trees

def random_tree(seed, scale=1.0):
  """Three float32 leaves of N(0, scale) values: a matrix, a vector and a
  3-D leaf in a list."""
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(4, 5)) * scale, jnp.float32),
          "b": jnp.asarray(rng.normal(size=(5,)) * scale, jnp.float32),
          "layers": [jnp.asarray(rng.normal(size=(2, 3, 4)) * scale, jnp.float32)]}


def tree_like(dtype=jnp.float32, scale=1.0, seed=0):
  """The contract's tree (test_contract.py): a dense layer and a norm."""
  rng = np.random.default_rng(seed)
  tree = {"dense": {"w": rng.normal(size=(8, 4)), "b": rng.normal(size=(4,))},
          "norm": [rng.normal(size=(3,))]}
  return jax.tree.map(lambda x: jnp.asarray(x * scale, dtype), tree)


def warm(tx, grads, steps=3, growth=0.1):
  """A state that has seen ``steps`` updates, the k-th scaled by 1 + growth*k."""
  state = tx.init(grads)
  for k in range(steps):
    scaled = jax.tree.map(lambda x: x * (1 + growth * k), grads)
    _, state = jax.jit(tx.update)(scaled, state)
  return state


def bad_grads():
  """A NaN in ``['encoder']['w']`` and an Inf in ``['head'][0]``."""
  return {"encoder": {"w": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2)},
          "head": [jnp.array([jnp.inf, 0.0]), jnp.ones(3)]}


# --------------------------------------------------------------------------
# Gradient sequences: norms around 1 with spikes, and trees that have them

STEPS = 200
SPIKES = {30: 10.0, 77: 100.0, 150: 50.0, 151: 20.0}  # step -> norm multiplier


def norm_sequence(seed=0, base=1.0, spikes=None):
  """``STEPS`` norms ``base`` with 10% noise, multiplied at ``spikes``
  (step -> factor; ``SPIKES`` by default)."""
  rng = np.random.default_rng(seed)
  norms = base * (1.0 + 0.1 * rng.standard_normal(STEPS))
  for step, factor in (SPIKES if spikes is None else spikes).items():
    norms[step] *= factor
  return norms


def longest_run(flags) -> int:
  """The longest run of true values in ``flags``."""
  best = run = 0
  for flag in flags:
    run = run + 1 if flag else 0
    best = max(best, run)
  return best


def gradient_steps(norms, seed=1):
  """One float32 gradient tree per step, with the given global norms."""
  rng = np.random.default_rng(seed)
  steps = []
  for norm in norms:
    tree = {"w": rng.normal(size=(8, 4)), "b": rng.normal(size=(4,))}
    total = np.sqrt(sum(np.sum(x ** 2) for x in tree.values()))
    steps.append({k: np.float32(x * norm / total) for k, x in tree.items()})
  return steps


# --------------------------------------------------------------------------
# A tree with stacked layers, for leaf_norms, layer_axis and groups

def stacked_gradients(dtype=jnp.float32, scale=1.0, seed=0):
  """A tree with stacked layers (axis 0 and, for one leaf, the last axis),
  plain leaves, an int leaf, a None and a MaskedNode."""
  rng = np.random.default_rng(seed)

  def leaf(*shape):
    return jnp.asarray(rng.normal(size=shape) * scale, dtype)

  return {"layers": {"attn": {"kernel": leaf(4, 3, 5)},
                     "mlp": [leaf(4, 5), leaf(5, 4)]},
          "emb": leaf(6, 2), "bias": leaf(3),
          "step": jnp.int32(7), "frozen": None, "masked": optax.MaskedNode()}


LAYER_AXIS = {"layers": {"attn": 0, "mlp": [0, -1]}, "emb": None, "bias": None,
              "step": None, "frozen": None, "masked": None}
# Per float leaf of `stacked_gradients()`: the axis its layer norms keep.
LEAF_AXES = {"kernel": 0, "mlp0": 0, "mlp1": 1, "bias": None, "emb": None}


def named_leaves(tree):
  """The float leaves of a `stacked_gradients()` tree, by name."""
  return {"kernel": tree["layers"]["attn"]["kernel"],
          "mlp0": tree["layers"]["mlp"][0], "mlp1": tree["layers"]["mlp"][1],
          "bias": tree["bias"], "emb": tree["emb"]}


def norm_of_named(tree, ord=2) -> float:
  """The float64 norm of all float leaves of a `stacked_gradients()` tree."""
  return np_norm(list(named_leaves(tree).values()), ord)


def expected_norm_tree(tree, ord, layer_axis=True):
  """The state's leaf-norm tree for a `stacked_gradients()` tree, in numpy:
  per layer (``layer_axis``) or per leaf; None at the int leaf."""
  axes = LEAF_AXES if layer_axis else dict.fromkeys(LEAF_AXES)
  n = {k: np_leaf_norm(x, ord, axes[k]) for k, x in named_leaves(tree).items()}
  return {"layers": {"attn": {"kernel": n["kernel"]},
                     "mlp": [n["mlp0"], n["mlp1"]]},
          "emb": n["emb"], "bias": n["bias"], "step": None, "frozen": None,
          "masked": optax.MaskedNode()}


def assert_norm_tree(got, want, rtol=1e-6):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == jnp.float32 and g.shape == np.shape(w)
    np.testing.assert_allclose(f64(g), w, rtol=rtol, atol=0)


def assert_scaled_by_layer(out, tree, factors, rtol=1e-6):
  """Each float leaf of ``out`` is its leaf of the `stacked_gradients()` tree
  ``tree`` times its factor (by name: a number, or per layer a vector along
  the leaf's layer axis)."""
  for name, x in named_leaves(tree).items():
    y = named_leaves(out)[name]
    assert y.dtype == x.dtype and y.shape == x.shape
    s = np.asarray(factors[name])
    if s.ndim:
      s = np.expand_dims(s, [a for a in range(x.ndim) if a != LEAF_AXES[name]])
    tol = rtol if x.dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(f64(y), f64(x) * s, rtol=tol, atol=0)
  np.testing.assert_array_equal(out["step"], tree["step"])
  assert out["frozen"] is None and out["masked"] == optax.MaskedNode()


def run(tx, grads, jit=True, state=None):
  """One update of ``tx`` on ``grads`` from a fresh state (or ``state``)."""
  update = jax.jit(tx.update) if jit else tx.update
  return update(grads, tx.init(grads) if state is None else state)


# --------------------------------------------------------------------------
# What optaxclip.stats reports for each kind of state

CLIP_KEYS = {"norm", "scale", "count", "clipped_count", "nonfinite_count",
             "min_scale", "floor_count", "clip_rate"}
ZCLIP_KEYS = {"norm", "mean", "std", "z", "threshold", "scale", "count",
              "clipped_count", "spike_count", "nonfinite_count", "clip_rate"}
SKIP_KEYS = {"norm", "count", "skipped_count", "forced_count", "nonfinite_count",
             "max_norm_count", "zscore_count", "ema_count", "norm_mean",
             "norm_var", "norm_std", "skip_rate", "skipped_by_norm",
             "skipped_by_loss", "loss", "loss_zscore", "loss_zscore_count",
             "loss_nonfinite_count", "loss_ema_count", "loss_mean", "loss_var",
             "loss_std"}


def keys(prefix, fields):
  """The stats keys of ``fields`` under ``prefix``."""
  return {f"{prefix}/{f}" for f in fields}


# --------------------------------------------------------------------------
# Meshes and HLO

AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def make_mesh(shape, names, axis_type="explicit"):
  return jax.make_mesh(shape, names,
                       axis_types=(AXIS_TYPES[axis_type],) * len(names))


def shard(tree, mesh, specs):
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                      tree, specs)


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(")
# Tuple shapes carry comments holding "=" ("/*index=5*/"): dropped before
# matching, or a tuple-shaped op (an all-reduce of many leaves) goes uncounted.
_COMMENT = re.compile(r"/\*.*?\*/")
_REFERENCE = re.compile(r"%([\w.\-]+)")


def hlo_ops(hlo: str, op: str) -> tuple[int, int]:
  """How many ``op`` instructions run on the main path and how many only
  inside the branches of a ``conditional`` (and what those branches call)."""
  computations, entry, current = {}, None, None
  for line in hlo.splitlines():
    if current is None:
      match = _COMPUTATION.match(line)
      if match:
        current = match.group(2)
        computations[current] = []
        if match.group(1):
          entry = current
    elif line.strip() == "}":
      current = None
    else:
      match = _INSTRUCTION.search(_COMMENT.sub("", line))
      if match:
        computations[current].append((match.group(1), line))
  assert entry is not None, "no ENTRY computation in the HLO"
  main, branches, stack = set(), set(), [(entry, False)]
  while stack:
    name, in_branch = stack.pop()
    seen = branches if in_branch else main
    if name in seen:
      continue
    seen.add(name)
    for opcode, line in computations[name]:
      for ref in _REFERENCE.findall(line):
        if ref in computations and ref != name:
          stack.append((ref, in_branch or opcode == "conditional"))

  def count(names):
    return sum(opcode in (op, op + "-start")
               for name in names for opcode, _ in computations[name])

  return count(main), count(branches - main)


# --------------------------------------------------------------------------
# Subprocesses

ROOT = pathlib.Path(__file__).resolve().parents[1]


def checkout_env(**extra) -> dict[str, str]:
  """This process's environment, ``extra`` added, with this checkout first on
  ``PYTHONPATH``: a script run in a subprocess imports the optaxclip under
  test, not whichever one the environment installed."""
  path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  return {**os.environ, **extra, "PYTHONPATH": path}


def run_process(args, **kwargs) -> subprocess.CompletedProcess:
  """Runs ``args`` to the end and returns its exit status and output.

  No time limit: a loaded machine is slow, not wrong. The process runs in a
  session of its own; when it ends, or when the test is interrupted while
  it runs, whatever it started that is still running (a pool's worker, a
  spawned job) is killed with it. Its output goes to files, not pipes: a
  process it left behind would hold a pipe open, and reading to the end
  would wait for it.
  """
  with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    process = subprocess.Popen(args, stdout=out, stderr=err, text=True,
                               start_new_session=True, **kwargs)
    try:
      process.wait()
    finally:
      kill_process_group(process)
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(args, process.returncode, out.read(), err.read())


def kill_process_group(process: subprocess.Popen) -> None:
  """Kills ``process`` (started with ``start_new_session=True``) and every
  process of its group still running."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass  # the group is gone
  process.wait()
