"""Per-example clipping for differentially private SGD.

Every leaf carries a leading batch axis: row ``i`` of every leaf is example
``i``'s gradient. Each example is clipped by its own norm (of all leaves
together, or of each leaf) and the clipped examples are summed, as in
``optax.per_example_global_norm_clip`` and
``optax.per_example_layer_norm_clip``: same numbers, plus each example's
pre-clip norm for logging. The norms are the library's, the batch axis kept
as a layer axis is (one pass, one all-reduce, on any mesh): accumulated in
float32 whatever the leaf dtype and overflow-safe. The sums are accumulated
in float32 too (at full precision on every backend) and each leaf keeps its
dtype.

The result is a ``PerExampleClip`` named tuple ``(summed, num_clipped,
norms)``: code written for optax's pair swaps with one more name,
``summed, num_clipped, norms = ...`` (or ``...[:2]``).
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optaxclip import _core, _tree, _validation
from optaxclip._clip import scaling
from optaxclip._types import AxisName, Ord, PyTree, Scalar


class PerExampleClip(NamedTuple):
  """What the per-example clippers return."""
  summed: PyTree  # the sum over the batch of the clipped examples: each
  #                 leaf without its batch axis, in its own dtype
  num_clipped: Any  # int32 scalar: examples that were clipped (per layer:
  #                   a tree of them, one per leaf, as optax)
  norms: Any  # float32 [batch] (float64 for float64 leaves under x64): each
  #             example's pre-clip norm (per layer: a tree, one per leaf)


def _check(fn: str, grads: PyTree, max_norm: Scalar) -> Scalar:
  """``max_norm`` checked (clamped when traced), and the leaves of ``grads``.

  inf is allowed, as in optax: no clipping, only the sum and the norms.
  """
  _validation.check_tree(fn, "grads", grads)
  return _validation.check_nonnegative(fn, "max_norm", max_norm,
                                       allow_inf=True)


def _batch_size(fn: str, leaves: list[jax.Array]) -> int:
  """The common leading axis of ``leaves``, or a ValueError naming them."""
  if not leaves:
    return 0
  sizes = {x.shape[0] if x.ndim else None for x in leaves}
  if len(sizes) != 1 or None in sizes:
    shapes = [tuple(x.shape) for x in leaves]
    raise ValueError(
        f"`{fn}(grads=...)` needs a leading batch axis of the same size on "
        f"every floating leaf (example i's gradient is row i), got shapes "
        f"{shapes}")
  size = sizes.pop()
  assert size is not None
  return size


def _factors(norms: jax.Array, max_norm: Any) -> jax.Array:
  """Per-example factors; an example with a NaN norm is not clipped.

  As optax (``nan_to_num(min(c / norm, 1), nan=1)``): its NaN then reaches
  the sum, where it belongs. ``c = norm = 0`` and ``c = norm = inf`` give 1.
  """
  factors = scaling.clip_factor(norms, max_norm, 0.0)
  return jnp.where(jnp.isnan(factors), jnp.ones_like(factors), factors)


def _per_leaf_tree(tree: PyTree, values: list[Any], fill: Any) -> PyTree:
  """``values`` at the clippable leaves of ``tree``, ``fill`` elsewhere."""
  leaves, treedef = jax.tree.flatten(tree)
  it = iter(values)
  return treedef.unflatten(
      [next(it) if _tree.is_clippable(x) else fill for x in leaves])


def per_example_clip_by_global_norm(grads: PyTree, max_norm: Scalar, *,
                                    ord: Ord = 2, axis_name: AxisName = None,
                                    specs: PyTree = None) -> PerExampleClip:
  """Clips each example's gradient by its global norm and sums them.

  Example ``i`` (row ``i`` of every leaf) is multiplied by
  ``min(1, max_norm / norm_i)``, ``norm_i`` being the ``ord``-norm of all its
  leaves together, and the clipped examples are summed: the numbers of
  ``optax.per_example_global_norm_clip(grads, max_norm)``, the first step of
  DP-SGD's aggregation. Integer, boolean and ``None`` leaves pass through
  untouched.

  Args:
    grads: a pytree of per-example gradients, every floating leaf with the
      same leading batch axis.
    max_norm: the largest norm an example keeps (a number >= 0, or ``inf``).
      Traced (inside ``jit``), a negative or NaN value acts as 0.
    ord: the norm order: any number ``p > 0`` or ``inf`` (DP-SGD uses 2).
    axis_name: under ``shard_map``/``pmap``, the axis name(s) the leaves
      are split over: the norms are then global.
    specs: with ``axis_name``, the leaves' ``PartitionSpec`` (tree prefix).
      Where it splits the batch axis, each device clips and sums its own
      examples (sum the devices' sums, as a data-parallel step does).

  Returns:
    ``PerExampleClip(summed, num_clipped, norms)``: the summed clipped tree
    (no batch axis, each leaf's dtype), the number of clipped examples (int32)
    and each example's pre-clip norm (``[batch]``, float32; float64 for
    float64 leaves under x64).

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip.functional import per_example_clip_by_global_norm
    >>> grads = [jnp.array([[0.0, 0.0, 0.0], [0.0, 3.0, 4.0], [4.0, 0.0, 3.0]])]
    >>> summed, num_clipped, norms = per_example_clip_by_global_norm(grads, 1.25)
    >>> summed
    [Array([1. , 0.75, 1.75], dtype=float32)]
    >>> num_clipped, norms
    (Array(2, dtype=int32), Array([0., 5., 5.], dtype=float32))

  References:
    Abadi et al., [Deep Learning with Differential Privacy](https://arxiv.org/abs/1607.00133), 2016.
  """
  fn = "per_example_clip_by_global_norm"
  max_norm = _check(fn, grads, max_norm)
  p = _validation.check_ord(fn, ord)
  where = _core.Where.of(fn, axis_name, specs)
  leaves = _tree.clippable_leaves(grads)
  batch = _batch_size(fn, leaves)
  if not leaves:
    return PerExampleClip(grads, jnp.zeros([], jnp.int32),
                          jnp.zeros([batch], jnp.float32))
  measured = _core.measure(fn, grads, p, where,
                           _core.examples(across_leaves=True))
  (norms,) = measured.here()
  factors = _factors(norms, max_norm)
  sums = measured.sum_over_examples(factors)
  summed = _tree.map_clippable_indexed(lambda x, i: sums[i], grads)
  return PerExampleClip(summed, jnp.sum(factors < 1, dtype=jnp.int32), norms)


def _layer_thresholds(measured: _core.Measured, max_norm: Scalar,
                      uniform: bool) -> list[Any]:
  """Per leaf, the largest norm of each of its layers, as optax writes it
  (for the same rounding) for the unstacked layers: ``C / sqrt(K)``, or
  ``C * sqrt(D_k / D)``. Counted on the whole leaves: under ``shard_map`` a
  device holds shards. A stack of zero layers counts none; with no layer
  or no entry at all, every layer is empty and any threshold will do."""
  shapes = [shape[1:] for shape in measured.shapes]
  layers = [math.prod(units[1:]) for units in measured.unit_shapes()]
  if uniform:
    return [max_norm * (1.0 / max(sum(layers), 1)) ** 0.5] * len(shapes)
  total = max(sum(math.prod(shape) for shape in shapes), 1)
  return [max_norm * (math.prod(shape) // max(n, 1) / total) ** 0.5
          for shape, n in zip(shapes, layers)]


def per_example_clip_by_layer_norm(grads: PyTree, max_norm: Scalar, *,
                                   uniform: bool = True, axis_name: AxisName = None,
                                   specs: PyTree = None,
                                   layer_axis: PyTree = None) -> PerExampleClip:
  """Clips each example's gradient leaf by leaf and sums them.

  The numbers of ``optax.per_example_layer_norm_clip(grads, max_norm,
  uniform)``: with ``K`` floating leaves (layers), leaf ``k`` of every
  example is clipped by its own L2 norm to ``C_k = max_norm / sqrt(K)``
  (``uniform``) or ``C_k = max_norm * sqrt(D_k / D)`` (``D_k`` the leaf's
  size per example, ``D`` the total), so that each example's global norm is
  at most ``max_norm``. Then the examples are summed.

  Args:
    grads: a pytree of per-example gradients, every floating leaf with the
      same leading batch axis.
    max_norm: the overall budget ``C`` (a number >= 0, or ``inf``; traced:
      [docs/hyperparameters.md](../hyperparameters.md)).
    uniform: split ``C`` evenly over the leaves, or by their sizes.
    axis_name: under ``shard_map``/``pmap``, the axis name(s) the leaves
      are split over ([docs/distributed.md](../distributed.md)).
    specs: with ``axis_name``, the leaves' ``PartitionSpec`` (tree prefix);
      where it splits the batch, each device clips and sums its examples.
    layer_axis: the axis that stacks scanned layers in one example's
      gradient (the batch axis left out; an int or a tree prefix): each
      layer slice is a layer of its own (``K`` counts slices), as optax
      gives for the unstacked layers.

  Returns:
    ``PerExampleClip(summed, num_clipped, norms)``: the summed clipped tree,
    and trees like ``grads`` of, per leaf, the examples clipped (int32;
    ``[layers]`` with a layer axis) and each example's pre-clip norm
    (``[batch]`` or ``[batch, layers]``, float32; float64 for float64
    leaves under x64). Other leaves pass through, with 0 clipped.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip.functional import per_example_clip_by_layer_norm
    >>> grads = {"a": jnp.array([[3.0, 4.0], [0.3, 0.4]]), "b": jnp.array([[1.0], [0.0]])}
    >>> summed, num_clipped, norms = per_example_clip_by_layer_norm(grads, 2.0**0.5)
    >>> summed["a"], norms["a"]
    (Array([0.90000004, 1.2 ], dtype=float32), Array([5. , 0.5], dtype=float32))
    >>> stacked = jnp.array([[[3.0, 4.0], [0.3, 0.4]], [[0.3, 0.4], [0.3, 0.4]]])
    >>> summed, num_clipped, norms = per_example_clip_by_layer_norm(
    ...     [stacked], 2.0**0.5, layer_axis=0)
    >>> summed[0], num_clipped[0]  # example 0's layer 0 cut to norm 1
    (Array([[0.90000004, 1.2       ],
           [0.6       , 0.8       ]], dtype=float32), Array([1, 0], dtype=int32))

  References:
    McMahan et al., [Learning Differentially Private Recurrent Language
    Models](https://arxiv.org/abs/1710.06963), 2018.
  """
  fn = "per_example_clip_by_layer_norm"
  max_norm = _check(fn, grads, max_norm)
  _validation.check_bool(fn, "uniform", uniform)
  _validation.check_layer_axis(fn, layer_axis)
  where = _core.Where.of(fn, axis_name, specs)
  leaves = _tree.clippable_leaves(grads)
  batch = _batch_size(fn, leaves)
  if not leaves:
    return PerExampleClip(grads,
                          _per_leaf_tree(grads, [], jnp.zeros([], jnp.int32)),
                          _per_leaf_tree(grads, [], jnp.zeros([0], jnp.float32)))
  # With layer axes, every layer slice of every leaf is a layer of its own.
  measured = _core.measure(fn, grads, 2.0, where, _core.examples(layer_axis))
  norms = measured.here()
  thresholds = _layer_thresholds(measured, max_norm, uniform)
  factors = [_factors(n, c) for n, c in zip(norms, thresholds)]
  sums = measured.sum_over_examples(factors)
  return PerExampleClip(
      _tree.map_clippable_indexed(lambda x, i: sums[i], grads),
      _per_leaf_tree(grads, [jnp.sum(f < 1, axis=0, dtype=jnp.int32)
                             for f in factors], jnp.zeros([], jnp.int32)),
      _per_leaf_tree(grads, norms, jnp.zeros([batch], norms[0].dtype)))
