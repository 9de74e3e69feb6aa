"""The clip factor and the one way leaves are multiplied by it.

Every transform that rescales gradients computes a factor with
``clip_factor`` (or its own rule) and applies it with ``scale_leaves``: a
multiply by a scalar, rather than a ``select`` between the gradient and a
clipped copy, lets XLA fuse the factor into whatever reads the update next
(inside ``optax.chain(clip, adamw)``: the optimizer's own pass).
"""

import jax
import jax.numpy as jnp

from optaxclip import _core, _tree
from optaxclip._types import PyTree


def clip_factor(norm: jax.Array, max_norm: jax.typing.ArrayLike,
                eps: jax.typing.ArrayLike) -> jax.Array:
  """The factor that brings ``norm`` down to ``max_norm`` (1 when below).

  A NaN norm gives a NaN factor and an infinite norm gives 0, as in the
  reference libraries; ``max_norm = inf`` (never clip) gives 1 for every
  finite norm and NaN for an infinite one (``inf / inf``, as in PyTorch's
  ``clip_grad_norm_`` and Optax). The division only sees a positive
  denominator, so gradients through the factor stay finite at zero norm. A
  factor below the smallest normal float (a norm over ~1e38 times
  ``max_norm``) flushes to zero on hardware that flushes subnormals: the
  update is then zero.
  """
  eps = jnp.asarray(eps, norm.dtype)
  max_norm = jnp.asarray(max_norm, norm.dtype)
  # A subnormal norm is compared and divided by from its bits (hardware
  # that flushes subnormals reads it as 0): the same factor on every
  # platform. `norm + 0` would flush it too.
  denominator = jnp.where(eps == 0, norm, norm + eps)
  # False for NaN (NaN propagates) and for an Inf norm, even under an
  # infinite max_norm.
  unclipped = _core.at_most(denominator, max_norm) & (denominator < jnp.inf)
  safe = jnp.where(unclipped, 1, denominator)
  return jnp.where(unclipped, 1, _core.quotient(max_norm, safe))


def zero_unless(keep: jax.Array, tree: PyTree) -> PyTree:
  """``tree``, with every clippable leaf replaced by zeros unless ``keep``.

  Integer, boolean and other non-clippable leaves pass through untouched,
  as in every transform (a step counter must not be zeroed with the step).
  """
  return _tree.map_clippable(lambda x: jnp.where(keep, x, jnp.zeros_like(x)),
                             tree)


def _scale_leaf(x: jax.Array, factor: jax.Array) -> jax.Array:
  scaled = x * factor
  # Half-precision leaves are scaled in float32 and rounded once. (The check
  # saves a no-op cast per leaf from the trace of trees with many leaves.)
  return scaled if scaled.dtype == x.dtype else scaled.astype(x.dtype)


def scale_leaves(tree: PyTree, factors: jax.Array | list[jax.Array]
                 ) -> PyTree:
  """Multiplies the clippable leaves by one factor (scalar) or one each (a
  vector of scalars, or a list of arrays that broadcast against them: one
  factor per layer or unit, as ``Measured.to_leaves`` lays them out).

  One multiply per leaf and nothing else: each leaf's pass is the cheapest
  fusion XLA can compile, and it fuses into the optimizer's next pass.
  """
  if not isinstance(factors, list) and factors.ndim == 0:
    return _tree.map_clippable_indexed(lambda x, _: _scale_leaf(x, factors),
                                       tree)
  return _tree.map_clippable_indexed(lambda x, i: _scale_leaf(x, factors[i]),
                                     tree)


def scale_some(tree: PyTree, factor: jax.Array, only: list[bool]) -> PyTree:
  """Multiplies the clippable leaves that ``only`` marks (one bool each, in
  tree order) by ``factor``; the others are returned as they are, not
  multiplied by 1 (no pass over them, the same bits)."""
  return _tree.map_clippable_indexed(
      lambda x, i: _scale_leaf(x, factor) if only[i] else x, tree)
