"""The norm of some leaves as a differentiable, compiled function.

``norm_of_leaves`` (all leaves together, a scalar) and ``unit_norms`` (one
norm per unit: per leaf, per layer, per AGC unit, per example) are
compiled once per tree structure, order, reduction and kept axes (called
eagerly, a norm would otherwise re-trace its rescue's ``lax.cond`` at
every call; inside a user's ``jit`` the inner jit is inlined). A traced
order (``optax.inject_hyperparams``) dispatches with ``lax.switch``: the
usual orders keep their fast, exact formulations. Gradients follow the
formula of ``_tangents`` (a custom JVP), not the computation.
"""

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from optaxclip import _tree
from optaxclip._core._batching import CPU, GPU, TPU, Grouped, Layout
from optaxclip._core._mesh import LOCAL, Keep, Reduction, mesh_platform
from optaxclip._core._one_pass import norms_one_pass
from optaxclip._core._sums import is_order, norms_of, rescue_enabled
from optaxclip._core._tangents import norm_tangents

KERNELS = ("auto", "rescue", "one_pass", "one_pass_gpu", "one_pass_tpu")
# The layout each platform's one-pass kernel groups leaves by.
_LAYOUTS = {"cpu": CPU, "tpu": TPU}


def kernel() -> str:
  """Which norm kernel runs: ``OPTAXCLIP_KERNEL`` in the environment.

  ``auto`` (the default) picks by the platform the norm is traced for:
  the rescue (``_sums``: plain sums, and a ``lax.cond`` that redoes them
  only when they overflowed or underflowed) on the CPU, where the branch not
  taken costs nothing; the one-pass kernel (``_one_pass``) on GPU and TPU,
  where XLA would turn that ``lax.cond`` into a select that runs both
  sides. ``rescue`` or ``one_pass`` runs that kernel everywhere: the tests
  run their numbers through the GPU/TPU kernel on the CPU this way.
  ``one_pass_gpu`` and ``one_pass_tpu`` run it with the leaves grouped as
  on that platform (``_batching.GPU``, ``TPU``), to test those numbers
  here. Read each time a norm is called (a compiled norm is kept per
  kernel; a program the user compiled keeps the kernel it was traced
  with).
  """
  choice = os.environ.get("OPTAXCLIP_KERNEL", "auto")
  if choice not in KERNELS:
    raise ValueError(f"OPTAXCLIP_KERNEL must be one of {KERNELS}, got {choice!r}")
  return choice


def _target_platform(leaves) -> str:
  """The platform the norm is traced for: that of the devices of the
  leaves' mesh (inputs with a ``NamedSharding``, sharded ``jit``,
  ``shard_map``), else of the mesh set around the trace (``jax.set_mesh``:
  how to lower for another platform than the default backend, as
  deviceless compiles do), else the default backend. Only the kernel that
  will run is traced (``lax.platform_dependent`` would trace both: on the
  CPU, 1.3-1.6x the compile time of the one taken)."""
  for x in leaves:
    platform = mesh_platform(x)
    if platform is not None:
      return platform
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()


def _platform(leaves, choice: str) -> str:
  """The platform whose groups of leaves a norm takes: the one it is traced
  for, or the one ``choice`` names (``one_pass_gpu``, ``one_pass_tpu``)."""
  if choice.startswith("one_pass_"):
    return choice.removeprefix("one_pass_")
  return _target_platform(leaves)


def _layout_of(platform: str) -> Layout:
  """How ``platform`` groups leaves (a GPU's: any platform but "cpu" and
  "tpu", as "cuda" or "rocm")."""
  return _LAYOUTS.get(platform, GPU)


def layout_for(leaves) -> Layout:
  """How the platform ``leaves`` are traced for groups them for a total."""
  return _layout_of(_platform(leaves, kernel()))


def _norms_by_platform(leaves, grouped: Callable[[Layout | None], Grouped],
                       p, acc, reduction: Reduction, choice: str, *,
                       total: bool, divisor=None) -> jax.Array:
  """The norms from the kernel ``choice`` names (``kernel()``), each over
  the leaves grouped as suits its platform: the same numbers within the
  accuracy contract, each the same on every platform."""
  target = _platform(leaves, choice)
  # Layouts differ by platform; numbers only within the contract.
  layout = _layout_of(target)
  if not rescue_enabled() or choice == "rescue" or (
      choice == "auto" and target == "cpu"):
    return norms_of(grouped(CPU), p, acc, reduction, total=total,
                    divisor=divisor)
  if is_order(p, math.inf):
    # A maximum needs no rescue: the plain one, over the platform's groups
    # (the CPU's would concatenate 256 small leaves: a copy on GPU and TPU).
    return norms_of(grouped(layout), p, acc, reduction, total=total,
                    divisor=divisor)
  return norms_one_pass(grouped(layout), p, acc, reduction, total=total,
                        divisor=divisor)


def _roots_of_sizes(leaves, keep, reduction: Reduction, acc) -> np.ndarray:
  """Per unit of every device, the square root of its entries over all
  devices (an empty unit counts 1): what turns a 2-norm into an RMS. A
  numpy constant: a custom derivative may not close over a staged one."""
  sizes = [reduction.whole_count(i, math.prod(
      d for a, d in enumerate(x.shape) if a not in kept))
           for i, (x, kept) in enumerate(zip(leaves, keep))]
  units = reduction.unit_counts(tuple(
      math.prod(x.shape[a] for a in kept) for x, kept in zip(leaves, keep)))
  sizes = np.repeat(np.asarray(sizes, np.float64), units)
  return np.sqrt(np.where(sizes > 0, sizes, 1)).astype(acc)


def _p_norms(leaves, p, reduction: Reduction, keep: tuple[Keep, ...] | None,
             choice: str = "auto", *, total: bool, rms: bool = False
             ) -> jax.Array:
  """The ``p``-norm of each unit (a vector in the accumulation dtype, in
  unit order: see ``Grouped``) or, with ``total``, of all leaves together
  (a scalar), differentiable by formula; with ``rms``, each unit's 2-norm
  divided by the root of its size, finite where the norm would overflow.
  A traced order is an argument of its own (a custom derivative may not
  close over a traced value), with its derivative too.
  """
  leaves = [jnp.asarray(x) for x in leaves]
  acc = _tree.accumulation_dtype(leaves)
  if not leaves:
    return jnp.zeros([] if total else [0], acc)
  if total:
    keep = None  # a total keeps nothing
  roots = (_roots_of_sizes(leaves, keep or ((),) * len(leaves), reduction, acc)
           if rms else None)

  def grouped(leaves, layout: Layout | None = CPU):
    # A total needs no per-leaf partials: small leaves of any shape merge.
    merge = total and reduction.replicated_axes is None
    return Grouped(leaves, keep, layout=layout, merge=merge)

  def tangents(leaves, dots, out, p, dp=None):
    if roots is not None:  # d(norm / root) = d norm / root
      return norm_tangents(grouped(leaves), dots, out * roots, p, acc,
                           reduction, total=total) / roots
    return norm_tangents(grouped(leaves), dots, out, p, acc, reduction,
                         total=total, dp=dp)

  @functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
  def static(leaves, p):
    return _norms_by_platform(leaves, functools.partial(grouped, leaves), p,
                              acc, reduction, choice, total=total,
                              divisor=roots)

  @static.defjvp
  def static_jvp(p, primals, dots):
    (leaves,), (dots,) = primals, dots
    out = static(leaves, p)
    return out, tangents(leaves, dots, out, p)

  @jax.custom_jvp
  def traced(leaves, p):
    return _norms_by_platform(leaves, functools.partial(grouped, leaves), p,
                              acc, reduction, choice, total=total)

  def traced_jvp(primals, dots):
    (leaves, p), (dots, dp) = primals, dots
    out = traced(leaves, p)
    dots = [jnp.zeros(x.shape, x.dtype) if isinstance(d, SymbolicZero) else d
            for x, d in zip(leaves, dots)]
    dp = None if isinstance(dp, SymbolicZero) else dp
    return out, tangents(leaves, dots, out, p, dp=dp)

  # Symbolic zeros: no pass over the leaves for the order's derivative
  # unless the order is differentiated.
  traced.defjvp(traced_jvp, symbolic_zeros=True)
  if isinstance(p, jax.Array):
    return traced(leaves, p)
  return static(leaves, p)


def _switch_on_order(norm_fn, p: jax.Array) -> jax.Array:
  """Runs ``norm_fn`` with a traced order: the usual orders keep their own
  formulations, any other runs the generic ``|x| ** p`` path; only the
  selected branch runs."""
  branches = [lambda: norm_fn(2.0), lambda: norm_fn(1.0),
              lambda: norm_fn(math.inf), lambda: norm_fn(p)]
  index = jnp.select([p == 2, p == 1, p == jnp.inf], [0, 1, 2], 3)
  return lax.switch(index, branches)


def _by_order(total: bool, rms: bool = False) -> Callable[..., jax.Array]:
  """``_p_norms(leaves, p, reduction, keep)``, compiled once per tree
  structure, order, reduction, kept axes and kernel; a traced order
  dispatches with ``lax.switch``."""
  norm_fn = functools.partial(_p_norms, total=total, rms=rms)
  compiled = jax.jit(norm_fn, static_argnums=(1, 2, 3, 4))

  def call(leaves: list[jax.Array], p: Any, reduction: Reduction = LOCAL,
           keep: tuple[Keep, ...] | None = None) -> jax.Array:
    choice = kernel()
    if not isinstance(p, jax.Array):
      return compiled(leaves, p, reduction, keep, choice)
    return _switch_on_order(
        lambda q: (norm_fn if isinstance(q, jax.Array) else compiled)(
            leaves, q, reduction, keep, choice), p)

  return call


# The p-norm of all leaves taken together, as a scalar.
norm_of_leaves = _by_order(total=True)
# The p-norm of each unit (per leaf, the axes `keep` gives it keeps), as a
# vector in unit order, holding every device's units where a kept axis is
# sharded (``Reduction.local``).
unit_norms = _by_order(total=False)
# Each unit's root mean square: its 2-norm over the root of its size.
unit_rms = _by_order(total=False, rms=True)
