"""Partial norms of pipeline stages, combined in one fixed order.

A stage (a program of its own) measures each of its leaves on its own, with
the same overflow-safe norm as the one-program norm of that leaf alone:
a leaf's value never depends on the other leaves of its stage (the
one-program norm groups small leaves, and takes one rescue decision for a
group). The combination sorts every stage's leaf norms by a position that
does not depend on the split (the leaf's key path), then reduces them in a
fixed pairwise order of elementwise operations, which a compiler may not
reorder: any split of the tree into stages, and any order of arrival,
gives the same bits.

Overflow safety: the leaf norms are scaled by the power of two of their
largest (read from its bits, subnormal ones too), so their ``p``-th powers
lie in ``[0, 1]``, and the result is scaled back exactly. The norm of
every leaf is finite wherever the whole tree's is.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from optaxclip import _tree
from optaxclip._core import _exact
from optaxclip._core._kept import PER_LEAF, Kept
from optaxclip._core._mesh import Keep, Where, _leaf_specs, reduction, whole_shapes
from optaxclip._core._norms import kernel, norm_of_leaves

# Above this order, powers of values in [0.5, 1) may leave the normal range:
# the scaled norms are divided by their largest first (one more rounding).
_SCALED_ORDER_LIMIT = 64


def leaf_norms(fn: str, tree, p, where: Where, kept: Kept = PER_LEAF
               ) -> tuple[list[jax.Array], tuple[Keep, ...]]:
  """Per clippable leaf of ``tree``, the ``p``-norm of each of its units
  (``kept``: a leaf, or each layer / expert slice), a vector in C order of
  its kept axes, each unit measured alone (with ``where``'s axes: over every
  device of the stage, one all-reduce per whole leaf or per unit; XLA may
  combine independent ones); and per leaf its kept axes."""
  reduction(fn, tree, where)  # checks the specs once, naming the tree's paths
  leaves = jax.tree.leaves(tree)
  specs = ([None] * len(leaves) if where.specs is None
           else _leaf_specs(fn, tree, where.specs))
  clippable = [(x, spec) for x, spec in zip(map(_tree.as_array, leaves), specs)
               if _tree.is_clippable(x)]
  keep = kept.axes(fn, tree, whole_shapes(fn, tree, where)) or (
      ((),) * len(clippable))
  paths = [path for path, _ in _tree.clippable_leaves_with_paths(tree)]
  norms = []
  for (x, spec), axes, path in zip(clippable, keep, paths):
    leaf_where = Where(where.axis_names, None if spec is None else [spec])
    red = reduction(fn, [x], leaf_where, [axes])
    if red.split_kept_axes is not None:
      raise ValueError(
          f"`{fn}(specs=...)` splits leaf {path} over the mesh along an axis "
          f"its norms keep (layer_axis or expert_axis {axes}): measure each "
          f"device's slice as a stage of its own, or gather it first")
    red = reduction(fn, [x], leaf_where)
    if not axes:  # a whole leaf: its norm alone, as global_norm of it
      norms.append(norm_of_leaves([x], p, red)[None])
      continue
    units = jnp.moveaxis(x, axes, range(len(axes)))
    units = units.reshape((-1,) + units.shape[len(axes):])
    norms.append(_each_alone(units, p, red, kernel()))
  return norms, keep


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _each_alone(units: jax.Array, p, red, choice: str) -> jax.Array:
  """The norm of each ``units[i]``, one at a time in a loop whose body is the
  same program for every count of units (``choice``: the kernel, read when
  it was traced): a unit's bits never depend on the other units beside it,
  as the one-program norm's, which takes one rescue decision for a group,
  would."""
  del choice
  acc = _tree.accumulation_dtype([units])
  return lax.map(lambda unit: norm_of_leaves([unit], p, red).astype(acc), units)


def _fixed_sum(terms: jax.Array) -> jax.Array:
  """The sum of a vector, by halves (padded with zeros to a power of two):
  elementwise additions in an order fixed by its length alone."""
  size = 1 << max(terms.shape[0] - 1, 0).bit_length()
  terms = jnp.pad(terms, (0, size - terms.shape[0]))
  while size > 1:
    size //= 2
    terms = terms[:size] + terms[size:]
  return terms[0]


def _root(s: jax.Array, p: float) -> jax.Array:
  """``s ** (1/p)`` for ``s > 0``."""
  if p == 1:
    return s
  return jnp.sqrt(s) if p == 2 else s ** (1 / p)


def _power(y: jax.Array, p: float) -> jax.Array:
  """``y ** p`` for ``0 <= y <= 1`` (0 stays 0, with no ``log(0)``)."""
  if float(p).is_integer() and p <= _SCALED_ORDER_LIMIT:
    return lax.integer_pow(y, int(p))
  positive = y > 0
  return jnp.where(positive, jnp.where(positive, y, 1) ** p, 0)


@functools.partial(jax.jit, static_argnums=2)
def _combined(norms: jax.Array, order: jax.Array, p: float) -> jax.Array:
  """``combined_norm`` of the concatenated leaf norms, compiled once per
  count, dtype and order ``p`` (not per split into stages)."""
  acc = norms.dtype
  norms = norms[order]
  if p == math.inf:
    return jnp.max(norms)
  top = jnp.max(_exact.magnitude_bits(norms))  # NaN above Inf above the rest
  peak = lax.bitcast_convert_type(top, acc)
  usable = (top > 0) & (top < _exact.bits(jnp.asarray(jnp.inf, acc)))
  exponent = jnp.where(usable, _exact.exponent_of_bits(top, acc), 0)
  scale = _exact.Scale.by(-exponent, acc)
  scaled = scale.apply(norms)  # exact; the largest in [0.5, 1)
  largest = jnp.ones([], acc)
  if p > _SCALED_ORDER_LIMIT:
    largest = jnp.where(usable, scale.apply(peak), 1)
    scaled = scaled / largest
  root = _root(_fixed_sum(_power(scaled, p)), p) * largest
  return jnp.where(usable, _exact.unscaled(root, exponent), peak)


def combined_norm(parts: list[jax.Array], order: tuple[int, ...], p: float
                  ) -> jax.Array:
  """The ``p``-norm of leaf norms: ``parts`` (vectors, one per stage)
  concatenated and taken in ``order`` (a permutation, the canonical order
  of their leaves), reduced in a fixed order; NaN, Inf and 0 as a sum of
  powers gives them."""
  acc = jnp.result_type(*parts)
  norms = jnp.concatenate([part.astype(acc) for part in parts])
  if not norms.size:
    return jnp.zeros([], acc)
  return _combined(norms, jnp.asarray(order, jnp.int32), p)
