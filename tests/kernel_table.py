"""Vectors that straddle the norm kernels' thresholds, and exact references.

The one-pass kernel (``_core._one_pass``) sums an entry in one of three
accumulators by its magnitude: below ``2**small`` scaled up, above
``2**big`` scaled down, the rest as it is (and, for ``p = 1``, below
``2**tiny`` scaled up); the rescue kernel (``_core._sums``) redoes the sums
when they leave the float range. A row of the table holds entries of one
to three of the bands these thresholds cut (as many as the input dtype
reaches), each band holding a dominant, comparable or negligible share of
the total, with entries placed at the thresholds themselves, next to them
and at the dtype's extremes.

References are exact to far below the kernels' rounding: each row scaled
by a power of two (exact), its powers summed in 80-bit extended precision.
"""

import dataclasses
import itertools
import math
import re
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxclip as oc
from optaxclip._core._one_pass import _Blue

WIDTH = 12  # entries per row (zeros pad the rest)
# A band's weight in the row's total (of squares): dominant, comparable, negligible.
SHARES = (1.0, 2.0 ** -7, 2.0 ** -30)


def accumulation(dtype) -> np.dtype:
  return np.dtype(np.float64 if jnp.dtype(dtype) == np.float64 else np.float32)


def cuts(dtype) -> list[float]:
  """The one-pass kernel's thresholds for ``dtype``'s accumulation type."""
  blue = _Blue.of(accumulation(dtype))
  return [2.0 ** blue.tiny, 2.0 ** blue.small, 2.0 ** blue.big]


def _bands(dtype) -> list[tuple[float, float]]:
  """The ``[low, high]`` magnitudes of each band ``dtype`` reaches: between
  consecutive thresholds (each threshold in the band above it). A dtype
  that reaches fewer than three (float16: one) is cut at its smallest
  normal number and at 1 instead, so that its rows mix magnitudes too."""
  info = jnp.finfo(dtype)
  lowest, highest = float(info.smallest_subnormal), float(info.max)
  inside = [c for c in cuts(dtype) if lowest < c <= highest]
  if len(inside) < 2:
    inside = [float(info.tiny), 1.0]
  below = [float(np.nextafter(np.asarray(c, dtype), np.asarray(0, dtype)))
           for c in inside]
  return list(zip([lowest] + inside, below + [highest]))


def _row(values, dtype, rng) -> np.ndarray:
  row = np.zeros(WIDTH, np.float64)
  row[:len(values)] = np.asarray(values) * rng.choice([-1.0, 1.0], len(values))
  return rng.permutation(row).astype(dtype)


def table(dtype, seed: int = 0) -> np.ndarray:
  """The rows for ``dtype``: every subset of up to three bands, every
  assignment of ``SHARES`` to them, around every threshold and extreme."""
  rng = np.random.default_rng(seed)
  info = jnp.finfo(dtype)
  bands = _bands(dtype)
  centers = [c for c in cuts(dtype) + [1.0, float(info.smallest_subnormal),
                                        float(info.tiny), float(info.max)]
             if float(info.smallest_subnormal) <= c <= float(info.max)]
  rows = []
  for center in centers:
    for k in range(1, 4):
      for chosen in itertools.combinations(bands, k):
        for shares in itertools.product(SHARES, repeat=k):
          if max(shares) < 1:
            continue
          values = []
          for i, ((lo, hi), share) in enumerate(zip(chosen, shares)):
            count = 1 + (i + len(rows)) % 3
            jitter = 1 + 0.5 * rng.random(count)
            with np.errstate(over="ignore"):  # at float64's largest
              values.extend(np.clip(center * math.sqrt(share / count) * jitter, lo, hi))
          rows.append(_row(values, dtype, rng))
  rows.extend(_row(values, dtype, rng) for values in _edges(dtype))
  return np.unique(np.stack(rows), axis=0)


def _edges(dtype) -> list[list[float]]:
  """Entries at the thresholds: each threshold, its neighbours, and one
  entry just above it among equal ones at it (the issue's 5e9 among 4e9s)."""
  out = []
  info = jnp.finfo(dtype)
  for cut in cuts(dtype):
    if not float(info.tiny) <= cut <= float(info.max) / 2:
      continue  # outside this dtype's normal range
    c = np.asarray(cut, dtype)
    up = float(np.nextafter(c, np.asarray(np.inf, dtype)))
    down = float(np.nextafter(c, np.asarray(0, dtype)))
    out += [[cut] * 4, [up, cut, cut, cut], [down, cut], [up, down],
            [cut * 1.25, cut * 0.9375, cut * 0.9375, cut * 0.9375]]
  return out


def reference(rows: np.ndarray, p: float) -> np.ndarray:
  """The ``p``-norm of each row, to within half a float64 ulp: each row
  scaled by the power of two of its largest entry (exactly), then summed in
  80-bit extended precision (11 more bits than float64)."""
  x = np.abs(rows.astype(np.float64))
  if p == math.inf:
    return np.max(x, axis=1)
  exponent = np.frexp(np.max(x, axis=1))[1]
  with np.errstate(under="ignore", over="ignore"):
    scaled = np.ldexp(x, -exponent[:, None]).astype(np.longdouble)
    total = np.sum(scaled ** np.longdouble(p), axis=1)
    root = (total ** (np.longdouble(1) / np.longdouble(p))).astype(np.float64)
    return np.ldexp(root, exponent)


def log2_power_sum(rows: np.ndarray, p: float) -> np.ndarray:
  """``log2(sum |x|**p)`` per row (-inf for a zero row), without overflow."""
  x = np.abs(rows.astype(np.float64))
  with np.errstate(divide="ignore"):
    logs = np.where(x > 0, p * np.log2(np.where(x > 0, x, 1)), -np.inf)
  top = np.max(logs, axis=1, keepdims=True)
  finite = np.isfinite(top)
  shifted = np.where(finite, logs - np.where(finite, top, 0), -np.inf)
  with np.errstate(divide="ignore", invalid="ignore"):  # zero rows: -inf
    return np.where(finite[:, 0], top[:, 0] + np.log2(np.sum(np.exp2(shifted), axis=1)),
                    -np.inf)


def plain_sums_suffice(rows: np.ndarray, p: float, entries: int) -> np.ndarray:
  """The rows whose plain power sums (in the accumulation type) neither
  overflow nor fall under the rescue's precision floor, with a margin: the
  rescue kernel takes its plain branch for a batch of them."""
  info = np.finfo(accumulation(rows.dtype))
  x = np.abs(rows.astype(np.float64))
  normal = np.all((x == 0) | (x >= info.tiny), axis=1)
  logs = log2_power_sum(rows, p)
  floor = math.log2(float(info.tiny) / float(info.eps) * entries)
  return normal & (logs > floor + 2) & (logs < info.maxexp - 2)


# Rounding allowed, in units of the accumulation type's epsilon: a dozen
# terms summed, a root, a division (measured: at most 3).
ULPS = 8


def close(got, want, acc, ulps=ULPS) -> np.ndarray:
  """Where ``got`` is within ``ulps`` epsilons of ``want`` rounded to
  ``acc`` (inf where it overflows, or where it is that close to overflowing),
  or one subnormal step."""
  info = np.finfo(acc)
  got = np.asarray(got, np.float64)
  with np.errstate(over="ignore"):
    want = np.asarray(want, np.float64).astype(acc).astype(np.float64)
  bound = ulps * float(info.eps) * np.abs(want) + float(info.smallest_subnormal)
  with np.errstate(invalid="ignore", over="ignore"):
    top = (got == np.inf) & (want + bound > float(info.max))
    return (got == want) | (np.abs(got - want) <= bound) | top


def report(rows, got, want, ok, what) -> str:
  bad = np.flatnonzero(~ok)[:5]
  return (f"{what}: {np.sum(~ok)} of {ok.size} rows off, e.g. " + "; ".join(
      f"{rows[i].astype(np.float64).tolist()} -> {float(got[i])!r}, "
      f"exact {float(want[i])!r}" for i in bad))


def narrow_rows() -> np.ndarray:
  """The float32, bfloat16 and float16 tables, widened to float32 (exactly):
  the one kernel that accumulates all three in float32 reads them all in
  one batch (the widening inside it: ``test_every_dtype_reads_...``)."""
  return np.concatenate([table(jnp.dtype(name)).astype(np.float32)
                         for name in ("float32", "bfloat16", "float16")])


# What the compiled programs must not hold: a multiplication by a constant 0

_INSTRUCTION = re.compile(r"%(\S+) = (\w+)\[[^\]]*\]\S* ([\w-]+)\(([^)]*)\)")
_SMALLEST_NORMAL = {"f32": 2.0 ** -126, "bf16": 2.0 ** -126, "f16": 2.0 ** -14,
                    "f64": 2.0 ** -1022}


def zero_multiplies(hlo: str | None) -> list[str]:
  """The multiplications, in compiled HLO text, by a float constant that is
  0 or subnormal (hardware that flushes subnormals reads one as 0), or by
  a broadcast of one: what XLA leaves of a product of constants that fell
  out of the float range (``x * 2**-76 * 2**-76`` in float32)."""
  zeros, found = set(), []
  for line in (hlo or "").splitlines():
    match = _INSTRUCTION.search(line)
    if not match:
      continue
    name, dtype, op, args = match.groups()
    operands = re.findall(r"%([\w.\-]+)", args)
    if op == "constant" and dtype in _SMALLEST_NORMAL:
      try:
        value = float(args)
      except ValueError:
        continue  # an array constant
      if abs(value) < _SMALLEST_NORMAL[dtype]:
        zeros.add(name)
    elif op in ("broadcast", "copy", "bitcast", "reshape", "convert") and (
        operands and operands[0] in zeros):
      zeros.add(name)
    elif op == "multiply" and any(o in zeros for o in operands):
      found.append(line.strip())
  return found


# --------------------------------------------------------------------------
# What reads the norm, run on the table's rows (one program each, jitted, or
# compiled for an accelerator by tests/test_deviceless.py)

def layer_norms(rows, p, **axis):
  """The stacked rows' per-layer (``layer_axis``) or per-expert
  (``expert_axis``) norms, as the clip's state holds them."""
  tx = oc.clip_by_global_norm(math.inf, ord=p, leaf_norms=True, **axis)
  _, state = tx.update({"w": rows}, tx.init({"w": rows}))
  return cast(Any, state).leaf_norms["w"]


def skipped(row, max_norm, p):
  """Whether ``skip_step(max_norm=...)`` skips the step of gradient ``row``."""
  tx = oc.skip_step(optax.sgd(1.0), max_norm=max_norm, ord=p)
  _, state = tx.update(row, tx.init(row), row)
  return cast(Any, state).stats.skipped_count


def _loss_scaled(row, max_norm):
  """The update of ``dynamic_loss_scale`` at a scale of 2**40 around a clip
  to ``max_norm`` and SGD, for the loss-scaled gradient ``row``."""
  inner = optax.chain(oc.clip_by_global_norm(max_norm), optax.sgd(1.0))
  tx = oc.dynamic_loss_scale(initial_scale=2.0 ** 40, inner=inner)
  updates, _ = tx.update(row, tx.init(row), row)
  return updates


def norm_views(rows, p):
  """The rows' norms as totals (``global_norm`` of each row, and of each
  row cut in three leaves of one shape: a group of leaves) and as units
  (per-layer norms of the stacked rows)."""
  thirds = lambda v: [v[..., :4], v[..., 4:8], v[..., 8:]]  # noqa: E731
  return {"global_norm": jax.vmap(lambda v: oc.functional.global_norm(v, ord=p))(rows),
          "global_norm, 3 leaves": jax.vmap(
              lambda v: oc.functional.global_norm(thirds(v), ord=p))(rows),
          "per_layer": layer_norms(rows, p, layer_axis=0)}


def guard_views(rows, clip_to, skip_below, skip_above, loss_clip_to):
  """Everything else that reads the 2-norm: per-expert norms, the clip,
  ``skip_step(max_norm=...)`` below and above the norm, and
  ``dynamic_loss_scale`` around a clip (``GuardCase`` gives the numbers)."""
  skips = jax.vmap(lambda v, m: skipped(v, m, 2.0))
  return {
      "per_expert": layer_norms(rows, 2.0, expert_axis=0),
      "clip": jax.vmap(lambda v, m: oc.functional.clip_by_global_norm(v, m)[0])(
          rows, clip_to),
      "skipped_below": skips(rows, skip_below),
      "skipped_above": skips(rows, skip_above),
      "loss_scale": jax.vmap(_loss_scaled)(rows, loss_clip_to)}


def _ulp(values: np.ndarray, dtype) -> np.ndarray:
  """One unit in the last place of each of ``values`` in ``dtype``."""
  info = jnp.finfo(dtype)
  exponent = np.floor(np.log2(np.maximum(np.abs(values), float(info.tiny))))
  return np.exp2(exponent - info.nmant)


def _check_scaled(rows, got, factor, dtype, acc, what):
  """``got`` is ``rows * factor`` in ``dtype``, to an ulp (a result below
  the normal range may be flushed to 0, as XLA:CPU does)."""
  want = rows.astype(np.float64) * factor
  got = np.asarray(got, np.float64)
  info = jnp.finfo(dtype)
  bound = _ulp(want, dtype) + ULPS * float(np.finfo(acc).eps) * np.abs(want)
  flushed = (np.abs(want) < float(info.tiny)) & (got == 0)
  ok = np.all((np.abs(got - want) <= bound) | flushed, axis=1)
  assert ok.all(), report(rows, got[:, 0], want[:, 0], ok, what)


@dataclasses.dataclass(frozen=True)
class GuardCase:
  """``guard_views``' arguments for the table of one dtype, and the checks
  of its results: the clipped row's norm is 3/4 of its norm; ``skip_step``
  skips a row whose norm is just above its ``max_norm``, and not one just
  below; ``dynamic_loss_scale`` at 2**40 around a clip clips the unscaled
  gradients. Rows whose norm is near the dtype's ends are left out."""
  dtype: Any
  rows: np.ndarray
  want: np.ndarray  # each row's norm (1 where unusable)
  usable: np.ndarray
  args: tuple[np.ndarray, ...]

  @classmethod
  def of(cls, dtype) -> "GuardCase":
    dtype = jnp.dtype(dtype)
    acc = accumulation(dtype)
    rows = table(dtype)
    want = reference(rows, 2.0)
    tiny = float(np.finfo(acc).tiny)
    with np.errstate(over="ignore"):
      usable = (want > tiny * 2.0 ** 30) & (want.astype(acc) < np.inf)
    want = np.where(usable, want, 1.0)
    clip_to = (0.75 * want).astype(acc)
    near = 64 * float(np.finfo(acc).eps)
    with np.errstate(over="ignore"):
      above = np.minimum(want * (1 + near), float(np.finfo(acc).max)).astype(acc)
    args = (rows, clip_to, (want * (1 - near)).astype(acc), above,
            (clip_to / 2.0 ** 40).astype(acc))
    return cls(dtype, rows, want, usable, args)

  def check(self, out: dict[str, Any], where: str = "") -> None:
    rows, want, usable, dtype = self.rows, self.want, self.usable, self.dtype
    acc = accumulation(dtype)
    ok = close(out["per_expert"], want, acc) | ~usable
    assert ok.all(), report(rows, out["per_expert"], want, ok, f"{where}per_expert")
    _check_scaled(rows[usable], out["clip"][usable], 0.75, dtype, acc, f"{where}clip")
    assert np.all(out["skipped_below"][usable] == 1), f"{where}skip_step(max_norm) let a step by"
    assert np.all(out["skipped_above"][usable] == 0), f"{where}skip_step(max_norm) skipped"
    if dtype != jnp.float16:  # float16 gradients overflow at a scale of 2**40
      x = np.abs(rows.astype(np.float64))
      fits = usable & np.all((x == 0) | (x >= float(np.finfo(acc).tiny) * 2.0 ** 41), axis=1)
      _check_scaled(rows[fits], out["loss_scale"][fits], -0.75 / 2.0 ** 40,
                    dtype, acc, f"{where}dynamic_loss_scale(clip)")
