"""Both norm kernels at their thresholds, jitted, against exact references.

Issue 32, defect 1: the one-pass kernel (the GPU/TPU one) computed
``medium * 2**-76 * 2**-76``, which XLA folds into ``medium * 0`` in
float32, and dropped every entry at or below ``2**32`` once one entry lay
above it; op by op the code was right. So every number here is computed by
a compiled program, for both kernels (``OPTAXCLIP_KERNEL``), every order
the one-pass kernel serves (its own 1 and 2, the pair orders, one above
their limit, inf, a traced one), float32, bfloat16, float16 and float64,
on the rows of ``kernel_table`` (entries below, at and above each
threshold, every combination of bands, each band's share dominant,
comparable or negligible), through ``global_norm``, the clip, per-layer and
per-expert norms, ``skip_step(max_norm=...)`` and ``dynamic_loss_scale``
with an inner clipper at a scale of 2**40. One program per (kernel, dtype,
order) takes the whole table as a batch.

Defect 5 (pair orders summed one entry after the other on the CPU) and
the compiled programs' constants are checked at the end.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_table import (
  GuardCase,
  close,
  guard_views,
  narrow_rows,
  norm_views,
  plain_sums_suffice,
  reference,
  report,
  skipped,
  table,
  zero_multiplies,
)

import optaxclip as oc

F = oc.functional
KERNELS = ("rescue", "one_pass")
# The one-pass kernel with the leaves grouped as on a GPU (merged) and on a
# TPU (leaves of one shape added entry by entry), run here.
LAYOUTS = ("one_pass_gpu", "one_pass_tpu")
DTYPES = ("float32", "bfloat16", "float16", "float64")
# 1 and 2: the one-pass kernel's own sums; 0.5, 2.5, 3: its pairs; 130:
# above the pairs' limit (120); inf: a maximum.
ORDERS = (1.0, 2.0, 0.5, 2.5, 3.0, 130.0, math.inf)


def _x64(name):
  return jax.enable_x64(name == "float64")


NORMS = {(kernel, p): jax.jit(functools.partial(norm_views, p=p))
         for kernel in KERNELS + LAYOUTS for p in ORDERS}
VIEWS = {kernel: jax.jit(guard_views) for kernel in KERNELS}


def _batches(rows, p, dtype):
  """The table, then its rows whose plain sums need no rescue (padded with
  copies of the first): the rescue kernel decides once per batch, so the
  second batch runs its plain branch."""
  if p == math.inf:
    return [rows]  # a maximum has no rescue
  plain = rows[plain_sums_suffice(rows, p, rows.size)]
  assert len(plain) > 10, "the table has too few ordinary rows"
  padded = np.concatenate([plain, np.repeat(plain[:1], len(rows) - len(plain), 0)])
  return [rows, padded.astype(dtype)]


ROWS = {"float32": narrow_rows(), "float64": table(np.float64)}
# float64: its own thresholds (2**-511, 2**256) with the orders of each path.
F64_ORDERS = (1.0, 2.0, 2.5, math.inf)


@pytest.mark.parametrize("p", ORDERS, ids=lambda p: f"p={p}")
@pytest.mark.parametrize("acc", ["float32", "float64"])
@pytest.mark.parametrize("kernel", KERNELS + LAYOUTS)
def test_norms_and_layer_norms_at_every_threshold(kernel, acc, p, monkeypatch):
  if p == math.inf and kernel == "one_pass":
    pytest.skip("a maximum: one kernel for both (the rescue's plain max)")
  if acc == "float64" and p not in F64_ORDERS:
    pytest.skip("float64: one order of each path")
  monkeypatch.setenv("OPTAXCLIP_KERNEL", kernel)
  with _x64(acc):
    compiled = NORMS[kernel, p].lower(ROWS[acc]).compile()
    assert zero_multiplies(compiled.as_text()) == []
    for rows in _batches(ROWS[acc], p, np.dtype(acc)):
      want = reference(rows, p)
      out = jax.device_get(compiled(rows))
      for view, got in out.items():
        ok = close(got, want, np.dtype(acc))
        assert ok.all(), report(rows, got, want, ok, view)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_dtype_reads_clips_and_guards_at_every_threshold(kernel, dtype,
                                                                monkeypatch):
  # The cases: the clipped tree's norm is max_norm; skip_step skips
  # above max_norm (and not below); dynamic_loss_scale at 2**40 around a
  # clip clips the unscaled gradients.
  monkeypatch.setenv("OPTAXCLIP_KERNEL", kernel)
  with _x64(dtype):
    case = GuardCase.of(dtype)
    compiled = VIEWS[kernel].lower(*case.args).compile()
    assert zero_multiplies(compiled.as_text()) == []
    case.check(jax.device_get(compiled(*case.args)))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_traced_order_at_every_threshold(kernel, monkeypatch):
  # float32 only: a traced order runs the same code for float64.
  monkeypatch.setenv("OPTAXCLIP_KERNEL", kernel)
  acc = "float32"

  @jax.jit
  def norms(rows, p):
    return jax.vmap(lambda v: F.global_norm(v, ord=p))(rows)

  with _x64(acc):
    rows = ROWS[acc]
    for p in (2.0, 2.5, 0.5):  # the switch's own 2, and the generic path
      want = reference(rows, p)
      got = np.asarray(norms(rows, jnp.asarray(p, acc)))
      ok = close(got, want, np.dtype(acc))
      assert ok.all(), report(rows, got, want, ok, f"traced p={p}")


# --------------------------------------------------------------------------
# The compiled programs hold no multiplication by a constant 0

def test_the_zero_multiply_finder_sees_a_folded_product():
  x = jax.ShapeDtypeStruct((4,), jnp.float32)
  folded = jax.jit(lambda x: x * 2.0 ** -76 * 2.0 ** -76).lower(x).compile().as_text()
  assert len(zero_multiplies(folded)) == 1
  kept = jax.jit(lambda x: x * 2.0 ** -76 * 2.0 ** 76).lower(x).compile().as_text()
  assert zero_multiplies(kept) == []


# --------------------------------------------------------------------------
# Issue 32, defect 5: sums of many entries, whatever order the backend adds in

SUM_ORDERS = (1.0, 2.0, 0.5, 2.5, 3.0)


def _many_entries():
  n = 1 << 20
  rng = np.random.default_rng(5)
  spike = np.full(n, 1e7)
  spike[0] = 5e9  # the issue's: 1.118e10, read as 5e9 by the folded kernel
  return np.stack([np.full(n, 0.1), rng.standard_normal(n),
                   rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n)),
                   spike]).astype(np.float32)


def _groups():
  """16 leaves too large to be grouped with others: one holds 1, fifteen
  hold just under half an ulp of 1 (for p = 1; their roots for p = 2).
  Added one after the other, each group's sum is lost."""
  from optaxclip._core._batching import GROUP_LIMIT
  leaves = [np.zeros(GROUP_LIMIT + 1, np.float32) for _ in range(16)]
  leaves[0][0] = 1.0
  for leaf in leaves[1:]:
    leaf[0] = 0.99 * 2.0 ** -24
  return leaves


@pytest.mark.parametrize("kernel", KERNELS)
def test_sums_of_a_million_entries_keep_their_error_bound(kernel, monkeypatch):
  monkeypatch.setenv("OPTAXCLIP_KERNEL", kernel)
  rows, leaves = _many_entries(), _groups()

  @jax.jit
  def norms(rows, leaves):
    roots = [leaves[0]] + [jnp.sqrt(x) for x in leaves[1:]]
    return ({p: jax.vmap(lambda v, p=p: F.global_norm(v, ord=p))(rows)
             for p in SUM_ORDERS},
            {1.0: F.global_norm(leaves, ord=1), 2.0: F.global_norm(roots)})

  by_order, by_groups = jax.device_get(norms(rows, leaves))
  u = 2.0 ** -24  # float32's unit roundoff
  wide = np.abs(rows.astype(np.float64))
  for p, got in by_order.items():
    # float64 sums (numpy's are pairwise): 2**-40 relative at worst here.
    error = np.abs(got / np.sum(wide ** p, axis=1) ** (1 / p) - 1)
    # log2(n) roundings of a balanced sum; one variadic reduction added one
    # entry after the other on the CPU: 62000 u off (p = 0.5).
    assert np.all(error <= math.log2(rows.shape[1]) * u), (p, error / u)
  exact = 1 + 15 * 0.99 * 2.0 ** -24
  for p, got in by_groups.items():
    error = abs(float(got) / exact ** (1 / p) - 1)
    # Pairwise: log2(16) roundings at most; one after the other: 15 u lost.
    assert error <= 4 * u, (p, error / u)


# --------------------------------------------------------------------------
# A subnormal norm against its threshold: XLA:CPU (and TPUs) read a subnormal
# as 0 in a float comparison or division, GPUs do not; the clip compares and
# divides from the bits, so every platform clips and counts alike (a norm of
# 2**-148 was "at most" a max_norm of 0, and counted unclipped, on the CPU).

SUBNORMAL = 2.0 ** -149  # the smallest float32


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_subnormal_norm_is_compared_and_divided_alike_everywhere(kernel, monkeypatch):
  monkeypatch.setenv("OPTAXCLIP_KERNEL", kernel)
  grads = {"w": jnp.full((4,), SUBNORMAL, jnp.float32)}  # norm 2**-148
  rows = jnp.full((3, 4), SUBNORMAL, jnp.float32)  # three examples, each 2**-148
  # max_norm (a constant, which XLA folds): the factor, and whether clipped.
  for max_norm, factor in ((0.0, 0.0), (SUBNORMAL, 0.5), (3 * SUBNORMAL, 1.0)):
    tx = oc.clip_by_global_norm(max_norm)

    def clip(grads, rows, tx=tx, max_norm=max_norm):
      _, state = tx.update(grads, tx.init(grads))
      _, clipped, _ = F.per_example_clip_by_global_norm(rows, max_norm)
      return state, clipped, skipped(grads["w"], max_norm, 2.0)

    for run in (clip, jax.jit(clip)):
      state, clipped, stepped_over = run(grads, rows)
      shown = f"max_norm {max_norm}, {'jit' if run is not clip else 'eager'}"
      assert float(state.norm) == 2 * SUBNORMAL, shown
      assert float(state.scale) == factor, shown
      assert int(state.clipped_count) == int(factor < 1), shown
      assert int(clipped) == 3 * int(factor < 1), shown
      assert int(stepped_over) == int(factor < 1), shown  # skip_step(max_norm=...)
