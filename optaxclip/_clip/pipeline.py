"""Global, per-leaf, per-layer and per-expert norms of pipeline stages
that run as programs of their own.

Each stage measures its part of the gradients (``partial_norm``: each leaf,
or each layer / expert slice of a stacked leaf, measured alone), the
partials meet anywhere (``combine_norms``, ``combine_leaf_norms``), and
each stage clips by the combined norm (``clip_stage``, or
``clip_by_global_norm(..., use_norm=norm)``). The combination does not
depend on how the tree was split into stages (a scanned stack split between
stages included) nor on the order the partials arrive in: the same bits
every time (docs/distributed.md, "Pipeline stages").
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optaxclip import _core, _tree, _validation
from optaxclip._clip import scaling, stage_units
from optaxclip._clip.stage_units import Units
from optaxclip._types import AxisName, Ord, PyTree, Scalar


@dataclasses.dataclass(frozen=True)
class PartialNorm:
  """A stage's part of the norms of the whole model: its units' norms.

  A pytree whose only leaf is ``norms`` (the rest is static): a ``jit``
  output, ``jax.device_get``-able, sent between programs as any array.

  Attributes:
    norms: each unit's ``ord``-norm, float32 (float64 for float64 leaves),
      leaf after leaf: a leaf's own norm, or with ``layer_axis`` /
      ``expert_axis`` the norm of each of its layer (expert) slices, in C
      order of those axes; NaN or Inf where a unit holds them.
    paths: each leaf's place in the whole tree, ``prefix`` followed by its
      key path in the stage's tree: the order ``combine_norms`` sums in.
    ord: the norm order (a float; ``inf`` for the max-norm).
    units: per leaf, how its norms lie in ``norms`` and which global layers
      they are (``stage_units.Units``).
  """
  norms: jax.Array
  paths: tuple[str, ...]
  ord: float
  units: tuple[Units, ...] = ()

  def __post_init__(self):
    if not self.units:  # built by hand, as before units: one per leaf
      object.__setattr__(self, "units", (Units(),) * len(self.paths))


jax.tree_util.register_dataclass(
    PartialNorm, data_fields=["norms"], meta_fields=["paths", "ord", "units"])


class CombinedNorms(NamedTuple):
  """The norms of the whole model, from every stage's ``PartialNorm``.

  Attributes:
    total: the global norm (``combine_norms``'s).
    leaves: per leaf path, the leaf's whole norm (a scalar; of a stack
      split between stages, the norm of all its layers).
    units: per path of a leaf measured with ``layer_axis`` or
      ``expert_axis``, its per-layer (``[layers]``), per-expert
      (``[experts]``) or per layer x expert norms over all stages, indexed
      by global layer.
  """
  total: jax.Array
  leaves: dict[str, jax.Array]
  units: dict[str, jax.Array]


def _static_ord(fn: str, ord: Ord) -> float:
  """The order as a Python float: it is part of the partial's structure."""
  p = _validation.check_ord(fn, ord)
  if _validation.is_traced(p):
    raise TypeError(
        f"`{fn}(ord=...)` must be a Python number or 'inf' here (partials of "
        f"different orders must not combine), got a traced {ord!r:.60}; pass "
        f"the order as a constant")
  return float(p)


def partial_norm(tree: PyTree, ord: Ord = 2, *, prefix: str = "",
                 axis_name: AxisName = None, specs: PyTree = None,
                 layer_axis: PyTree = None, expert_axis: PyTree = None,
                 layers: Any = None) -> PartialNorm:
  """One pipeline stage's part of the norms of all stages.

  Each clippable leaf is measured on its own (overflow-safe, as
  ``global_norm`` of that leaf alone), or with ``layer_axis`` /
  ``expert_axis`` each of its layer (expert) slices on its own: a value
  never depends on what else the stage holds. Combine every stage's with
  ``combine_norms`` or ``combine_leaf_norms``.

  Args:
    tree: the stage's part of the gradients (a pytree of arrays).
    ord: the norm order: any number ``p > 0`` or ``inf``, as a constant.
    prefix: put before each leaf's key path. Paths must be unique over all
      stages (but for a stack split by ``layers``): give each stage its
      part of the whole tree keyed as there, or a prefix naming the part.
    axis_name: under ``shard_map``, the mesh axis name(s) the stage's leaves
      are split over (data or tensor parallel within the stage).
    specs: with ``axis_name``, the leaves' ``PartitionSpec`` (a tree prefix;
      a layer or expert axis itself must not be split).
    layer_axis: the axis that stacks scanned layers (an int, a tree prefix
      of int or None, or a callable of the tree), as in
      ``clip_by_global_norm(leaf_norms=True)``: one norm per layer.
    expert_axis: the axis that stacks experts (as ``layer_axis``).
    layers: where the stage's slice of a stack lies in the whole stack: the
      global index of its first layer (an int), or of each (a ``range``),
      or a tree prefix of those; None: from layer 0.

  Returns:
    A ``PartialNorm``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> F = oc.functional
    >>> first = F.partial_norm({"w1": jnp.array([3.0, 0.0])})
    >>> second = F.partial_norm({"w2": jnp.array([4.0, 1e20])})
    >>> first.paths, first.norms
    (("['w1']",), Array([3.], dtype=float32))
    >>> F.combine_norms([second, first])  # no overflow
    Array(1.e+20, dtype=float32)
    >>> top = F.partial_norm({"w": jnp.ones([2, 4])}, layer_axis=0, layers=6)
    >>> top.norms, top.units[0].layers  # layers 6 and 7 of the stack
    (Array([2., 2.], dtype=float32), (6, 7))
  """
  fn = "partial_norm"
  p = _static_ord(fn, ord)
  if not isinstance(prefix, str):
    raise TypeError(f"`{fn}(prefix=...)` must be a str, got {prefix!r:.60}")
  where = _core.Where.of(fn, axis_name, specs)
  _validation.check_tree(fn, "tree", tree)
  expert_axis, layer_axis = _validation.check_stack_axes(fn, expert_axis,
                                                         layer_axis)
  _validation.check_static(fn, "layers", layers, "an int, a range or None")
  norms, keep = _core.leaf_norms(fn, tree, p, where,
                                 _core.experts(expert_axis, layer_axis))
  with_paths = _tree.clippable_leaves_with_paths(tree)
  shapes = [tuple(x.shape) for _, x in with_paths]
  layer_keep = (None if layer_axis is None else
                _core.layers(layer_axis).axes(fn, tree, shapes))
  units = stage_units.describe_units(fn, tree, keep, layer_keep, layers)
  return PartialNorm(jnp.concatenate(norms) if norms else jnp.zeros([0]),
                     tuple(prefix + path for path, _ in with_paths), p, units)


def _checked(fn: str, partials: Sequence[PartialNorm]
             ) -> tuple[list[PartialNorm], float]:
  """``partials`` as a list, and their one order."""
  partials = list(partials) if isinstance(partials, (list, tuple)) else partials
  if not isinstance(partials, list) or not partials or not all(
      isinstance(part, PartialNorm) for part in partials):
    raise TypeError(
        f"`{fn}(partials=...)` must be a non-empty list of PartialNorm (what "
        f"`partial_norm` returns, one per stage), got {partials!r:.80}")
  orders = {part.ord for part in partials}
  if len(orders) > 1:
    raise ValueError(
        f"`{fn}(partials=...)` holds norms of orders {sorted(orders)}: take "
        f"every stage's `partial_norm` with the same ord")
  return partials, orders.pop()


def combine_norms(partials: Sequence[PartialNorm]) -> jax.Array:
  """The global norm of all stages, from their ``partial_norm``.

  Every unit norm (a leaf's, or a layer or expert slice's) is put in the
  order of its path and global index and the ``ord``-th powers summed in a
  fixed order, overflow-safe: the same bits whatever the split into stages
  and the order of ``partials``. Within a few ulps of ``global_norm`` of
  the whole tree (a NaN or Inf leaf gives NaN or Inf).

  Args:
    partials: every stage's ``PartialNorm`` (one order), in any order.

  Returns:
    A scalar array: the global norm, to pass on as ``use_norm=`` or
    ``grad_norm=``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> F = oc.functional
    >>> stages = [{"a": jnp.array([1.0, 2.0])}, {"b": jnp.array([2.0])}]
    >>> norm = F.combine_norms([F.partial_norm(s) for s in stages])
    >>> norm
    Array(3., dtype=float32)
    >>> F.clip_by_global_norm(stages[0], 1.0, use_norm=norm)[0]
    {'a': Array([0.33333334, 0.6666667 ], dtype=float32)}
  """
  fn = "combine_norms"
  partials, p = _checked(fn, partials)
  keys, _ = stage_units.unit_keys(fn, partials)
  order = tuple(sorted(range(len(keys)), key=keys.__getitem__))
  return _core.combined_norm([part.norms for part in partials], order, p)


def combine_leaf_norms(partials: Sequence[PartialNorm]) -> CombinedNorms:
  """The global norm, each leaf's norm and each layer's and expert's norms
  of all stages, from their ``partial_norm``.

  The same bits whatever the split into stages (a stack split between
  stages by ``layers`` included) and the order of ``partials``: a unit's
  norm is the one its stage measured, a leaf's and the total are combined
  in one fixed order (as ``combine_norms``). Within a few ulps of what
  ``clip_by_global_norm(leaf_norms=True, layer_axis=...)`` keeps.

  Args:
    partials: every stage's ``PartialNorm`` (one order), in any order.

  Returns:
    A ``CombinedNorms``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> F = oc.functional
    >>> stack = jnp.arange(1.0, 5.0)[:, None] * jnp.ones([4, 3])  # 4 layers
    >>> stages = [F.partial_norm({"w": stack[2:]}, layer_axis=0, layers=2),
    ...           F.partial_norm({"w": stack[:2]}, layer_axis=0)]
    >>> norms = F.combine_leaf_norms(stages)
    >>> norms.units["['w']"]  # layer l: (l + 1) * sqrt(3)
    Array([1.7320508, 3.4641016, 5.196152 , 6.928203 ], dtype=float32)
    >>> norms.total, norms.leaves["['w']"]
    (Array(9.486833, dtype=float32), Array(9.486833, dtype=float32))
  """
  fn = "combine_leaf_norms"
  partials, p = _checked(fn, partials)
  keys, shapes = stage_units.unit_keys(fn, partials)
  order = tuple(sorted(range(len(keys)), key=keys.__getitem__))
  acc = jnp.result_type(*[part.norms for part in partials])
  norms = jnp.concatenate([part.norms.astype(acc) for part in partials])
  ordered = norms[jnp.asarray(order, jnp.int32)] if order else norms
  leaves, units, start = {}, {}, 0
  for path in sorted(shapes):  # sorted keys: each path's units together
    shape, described = shapes[path]
    size = math.prod(shape)
    segment, start = ordered[start:start + size], start + size
    if described.axes:
      units[path] = segment.reshape(shape)
      leaves[path] = _core.combined_norm([segment], tuple(range(size)), p)
    else:
      leaves[path] = segment[0]
  return CombinedNorms(_core.combined_norm([norms], order, p), leaves, units)


def clip_stage(tree: PyTree, max_norm: Scalar, partial: PartialNorm,
               combined: "CombinedNorms | Scalar | None" = None, *,
               eps: Scalar = 0.0, per_layer: bool = False) -> PyTree:
  """One stage's gradients clipped as the whole model's would be.

  By default every leaf is scaled by the factor of the combined global
  norm (``clip_by_global_norm(tree, max_norm, use_norm=...)``). With
  ``per_layer``, each unit ``partial`` measured (a leaf, or a layer or
  expert slice of a stacked leaf) is scaled by its own norm's factor, as
  ``clip_by_norm(layer_axis=..., expert_axis=...)`` of the whole tree: a
  unit lies in one stage, so ``combined`` is not needed. The factor is
  ``max_norm / (norm + eps)`` where below 1.

  Args:
    tree: the stage's gradients, as measured by ``partial``.
    max_norm: the largest norm (a number >= 0; ``inf`` never clips).
    partial: the stage's ``partial_norm`` of ``tree``.
    combined: the ``combine_leaf_norms`` of every stage, or the global norm
      (``combine_norms``'s); not used with ``per_layer``.
    eps: added to the norm before dividing (``1e-6``: PyTorch's).
    per_layer: clip each unit by its own norm instead.

  Returns:
    The clipped tree, with each leaf's dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> F = oc.functional
    >>> stages = [{"a": jnp.array([[0.0, 4.0], [0.0, 3.0]])}, {"b": jnp.zeros(2)}]
    >>> parts = [F.partial_norm(s, layer_axis=0) for s in stages]
    >>> F.clip_stage(stages[0], 1.0, parts[0], F.combine_leaf_norms(parts))
    {'a': Array([[0. , 0.8],
           [0. , 0.6]], dtype=float32)}
    >>> F.clip_stage(stages[0], 1.0, parts[0], per_layer=True)  # each layer
    {'a': Array([[0., 1.],
           [0., 1.]], dtype=float32)}
  """
  fn = "clip_stage"
  max_norm = _validation.check_nonnegative(fn, "max_norm", max_norm,
                                           allow_inf=True)
  eps = _validation.check_nonnegative(fn, "eps", eps)
  _validation.check_bool(fn, "per_layer", per_layer)
  if not isinstance(partial, PartialNorm):
    raise TypeError(f"`{fn}(partial=...)` must be the stage's PartialNorm "
                    f"(`partial_norm(tree, ...)`), got {partial!r:.60}")
  _validation.check_tree(fn, "tree", tree)
  leaves = _tree.clippable_leaves(tree)
  _check_measured(fn, leaves, partial)
  if per_layer:
    factors = scaling.clip_factor(partial.norms, max_norm, eps)
    return scaling.scale_leaves(tree, _per_leaf(factors, leaves, partial))
  if combined is None:
    raise TypeError(
        f"`{fn}(combined=...)` is needed to clip by the global norm: pass "
        f"`combine_leaf_norms(partials)` or `combine_norms(partials)`")
  total = combined.total if isinstance(combined, CombinedNorms) else combined
  total = jnp.asarray(_validation.scalar(fn, "combined", total),
                      partial.norms.dtype)
  return scaling.scale_leaves(tree, scaling.clip_factor(total, max_norm, eps))


def _check_measured(fn: str, leaves: list[jax.Array], partial: PartialNorm
                    ) -> None:
  """``partial`` measured ``leaves``: as many, each with its units."""
  fits = len(leaves) == len(partial.units) and all(
      all(a < x.ndim and x.shape[a] == n for a, n in zip(units.axes, units.shape))
      for x, units in zip(leaves, partial.units))
  if not fits:
    raise ValueError(
        f"`{fn}(partial=...)` was measured on another tree: "
        f"{len(partial.units)} leaves ({partial.paths[:4]}...) with units "
        f"{[u.shape for u in partial.units][:4]}, but `tree` has "
        f"{len(leaves)} clippable leaves of shapes "
        f"{[x.shape for x in leaves][:4]}")


def _per_leaf(values: jax.Array, leaves: list[jax.Array],
              partial: PartialNorm) -> list[jax.Array]:
  """``values`` (one per unit of ``partial``) shaped onto each leaf."""
  out, start = [], 0
  for x, units in zip(leaves, partial.units):
    part, start = values[start:start + units.size], start + units.size
    out.append(part.reshape([x.shape[a] if a in units.axes else 1
                             for a in range(x.ndim)]))
  return out
