"""What a clipper does when the gradient norm is NaN or Inf.

``"propagate"`` leaves the arithmetic alone (the NaN/Inf reaches the update,
as in Optax, PyTorch and TensorFlow), ``"zero"`` replaces the whole update by
zeros, and ``"raise"`` stops with an error naming the leaves that hold NaN or
Inf, eagerly and under ``jit`` alike.
"""

import functools
from typing import Any, get_args

import jax
import jax.numpy as jnp
from jax import lax
from jax.core import Tracer

from optaxclip import _tree
from optaxclip._types import NonFinite

PyTree = Any
MODES = get_args(NonFinite)


class NonFiniteGradientError(RuntimeError):
  """Gradients held NaN or Inf where a clipper was asked to raise.

  Under ``jit`` JAX reports it wrapped in its ``JaxRuntimeError``, which is a
  ``RuntimeError`` too, with this message at its end.
  """


def _message(fn: str, norm: float, paths: list[str]) -> str:
  where = (", ".join(paths) if paths else
           "none on this device (another shard holds them)")
  return (f"`{fn}`: the gradient norm is {norm}, not finite, so it cannot be "
          f"clipped. Leaves holding NaN or Inf: {where}. Pass "
          f"nonfinite='zero' to skip such updates, or 'propagate' to keep them.")


def _raise_if_bad(fn: str, paths: tuple[str, ...], norm, leaf_ok) -> None:
  # Under vmap the cond below becomes a select and this runs on every step,
  # so it decides from the values, not from being called.
  norm = float(norm)
  if jnp.isfinite(norm):
    return
  bad = [path for path, ok in zip(paths, leaf_ok) if not ok]
  raise NonFiniteGradientError(_message(fn, norm, bad))


def raise_if_nonfinite(fn: str, tree: PyTree, norm: jax.Array) -> None:
  """Raises ``NonFiniteGradientError`` when ``norm`` is NaN or Inf."""
  with_paths = _tree.clippable_leaves_with_paths(tree)
  if not with_paths:
    return  # no floating leaf: nothing to be NaN
  paths = tuple(path for path, _ in with_paths)

  def leaf_ok():
    return jnp.stack([jnp.all(jnp.isfinite(x)) for _, x in with_paths])

  if not isinstance(norm, Tracer):  # eager: a plain Python raise
    if not jnp.isfinite(norm):
      _raise_if_bad(fn, paths, norm, leaf_ok())
    return
  report = functools.partial(_raise_if_bad, fn, paths)
  lax.cond(jnp.isfinite(norm), lambda: None,
           lambda: jax.debug.callback(report, norm, leaf_ok()))


def guard(mode: NonFinite, fn: str, updates: PyTree, norm: jax.Array,
          factors: list[jax.Array], finite: list[jax.Array]
          ) -> list[jax.Array]:
  """The factors for ``mode``, one per norm (one norm, or one per group):
  ``"raise"`` raises when ``norm`` (the largest) is NaN or Inf,
  ``"zero"`` makes a factor 0 where its norm is not ``finite``."""
  if mode == "raise":
    raise_if_nonfinite(fn, updates, norm)
  if mode == "zero":
    return [jnp.where(ok, f, 0) for f, ok in zip(factors, finite)]
  return factors


def zeroed(mode: NonFinite, clipped: PyTree,
           finite: jax.Array | list[jax.Array]) -> PyTree:
  """With ``"zero"``, each clippable leaf zeros where its norm's
  ``finite`` (one for all, or one per leaf) is False: a NaN times a factor
  of 0 is still NaN."""
  if mode != "zero":
    return clipped
  def zero(x, i):
    ok = finite if isinstance(finite, jax.Array) else finite[i]
    return jnp.where(ok, x, jnp.zeros_like(x))
  return _tree.map_clippable_indexed(zero, clipped)
