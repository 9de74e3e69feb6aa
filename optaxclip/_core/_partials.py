"""Partial norms of pipeline stages, combined in one fixed order.

A stage (a program of its own) measures each of its leaves on its own, with
the same overflow-safe norm as the one-program norm of that leaf alone:
a leaf's value never depends on the other leaves of its stage (the
one-program norm groups small leaves, and takes one rescue decision for a
group). A stacked leaf's layer (expert) slices, which a stack split between
stages spreads over several programs of different shapes, are each reduced
by ``_rows``: a maximum (exact in any order) and a sum by halves of
elementwise operations, whose bits depend on the slice's entries alone. The
combination sorts every stage's unit norms by a position that does not
depend on the split (the leaf's key path, the unit's global index), then
reduces them the same way: any split of the tree into stages, and any order
of arrival, gives the same bits.

Overflow safety: values are scaled by the power of two of their largest
(read from its bits, subnormal ones too), so their ``p``-th powers lie in
``[0, 1]`` (``[0, 2**(p/2)]`` for complex entries), and the result is
scaled back exactly. The norm of every unit is finite wherever the whole
tree's is.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from optaxclip import _tree
from optaxclip._core import _exact
from optaxclip._core._kept import PER_LEAF, Kept
from optaxclip._core._mesh import (
  LOCAL,
  Keep,
  Reduction,
  Where,
  _leaf_specs,
  reduction,
  whole_shapes,
)
from optaxclip._core._norms import norm_of_leaves

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
    norms.append(_unit_norms(x, axes, p, red))
  return norms, keep


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _unit_norms(x: jax.Array, axes: Keep, p, red: Reduction) -> jax.Array:
  """The norm of each slice of ``x`` along its kept ``axes`` (C order), one
  program per leaf shape (a few operations called one by one would each
  compile their own)."""
  units = jnp.moveaxis(x, axes, range(len(axes)))
  return _rows(units.reshape(math.prod(units.shape[:len(axes)]), -1), p, red)


# Halves at least this wide are written out before the next level is added:
# each level is then a kernel of its own (all the GPU's threads at work, not
# one per row); narrower ones fuse.
_MATERIALIZED_WIDTH = 1024


def _fixed_sum(terms: jax.Array) -> jax.Array:
  """The sum of each row (the last axis), by halves (padded with zeros to a
  power of two): elementwise additions in an order fixed by the row's
  length alone, which no compiler may reorder (the powers are written out
  first: no multiply-add is contracted into a fused one)."""
  n = terms.shape[-1]
  size = 1 << max(n - 1, 0).bit_length()
  terms = lax.optimization_barrier(
      jnp.pad(terms, [(0, 0)] * (terms.ndim - 1) + [(0, size - n)]))
  while size > 1:
    size //= 2
    terms = terms[..., :size] + terms[..., size:]
    if size >= _MATERIALIZED_WIDTH:
      terms = lax.optimization_barrier(terms)
  return terms[..., 0]


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


@functools.partial(jax.jit, static_argnums=(1, 2))
def _rows(rows: jax.Array, p: float, red: Reduction = LOCAL) -> jax.Array:
  """The ``p``-norm of each row of ``rows`` (any float or complex dtype),
  from the largest ``|x|``'s power of two (a max: exact in any order) and a
  fixed pairwise sum of the scaled powers: a row's bits depend on its
  entries alone, whatever else a program computes beside it (with ``red``'s
  mesh axes, on its devices' parts: one ``pmax`` and one ``psum``).
  Compiled once per shape, dtype, order and reduction."""
  acc = _tree.accumulation_dtype([rows])
  parts = ([jnp.real(rows), jnp.imag(rows)] if jnp.iscomplexobj(rows)
           else [rows])
  top = functools.reduce(jnp.maximum, [  # NaN above Inf above the rest
      jnp.max(_exact.magnitude_bits(part.astype(acc)), axis=-1, initial=0)
      for part in parts])
  if red.axis_names:
    top = lax.pmax(top, red.axis_names)
  peak = lax.bitcast_convert_type(top, acc)
  if p == math.inf:
    return peak if len(parts) == 1 else red.max(jnp.max(
        jnp.abs(rows).astype(acc), axis=-1, initial=0))
  usable = (top > 0) & (top < _exact.bits(jnp.asarray(jnp.inf, acc)))
  exponent = jnp.where(usable, _exact.exponent_of_bits(top, acc), 0)
  scale = _exact.Scale.by(-exponent[..., None], acc)
  scaled = scale.magnitude(rows, acc)  # exact; the largest in [0.5, 1.5)
  largest = jnp.ones(top.shape, acc)
  if p > _SCALED_ORDER_LIMIT:
    largest = jnp.where(usable, red.max(jnp.max(scaled, axis=-1, initial=0)), 1)
    scaled = scaled / largest[..., None]
  sums = _fixed_sum(_power(scaled, p))
  if red.axis_names:
    sums = red.sum(sums, (sums.shape[0],))
  root = _root(sums, p) * largest
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
  return _rows(norms[jnp.asarray(order, jnp.int32)][None], p)[0]
