"""Global norms of pipeline stages that run as programs of their own.

Each stage measures its part of the gradients (``partial_norm``), the
partials meet anywhere (``combine_norms``), and each stage clips by the
combined norm (``clip_by_global_norm(..., use_norm=norm)``). The
combination does not depend on how the tree was split into stages nor on
the order the partials arrive in: the same bits every time
(docs/distributed.md, "Pipeline stages").
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from optaxclip import _core, _tree, _validation
from optaxclip._types import AxisName, Ord, PyTree


@dataclasses.dataclass(frozen=True)
class PartialNorm:
  """A stage's part of a global norm: the norm of each of its leaves.

  A pytree whose only leaf is ``norms`` (the rest is static): a ``jit``
  output, ``jax.device_get``-able, sent between programs as any array.

  Attributes:
    norms: each clippable leaf's ``ord``-norm, float32 (float64 for float64
      leaves), shape ``[len(paths)]``, NaN or Inf where the leaf holds them.
    paths: each leaf's place in the whole tree, ``prefix`` followed by its
      key path in the stage's tree: the order ``combine_norms`` sums in.
    ord: the norm order (a float; ``inf`` for the max-norm).
  """
  norms: jax.Array
  paths: tuple[str, ...]
  ord: float


jax.tree_util.register_dataclass(
    PartialNorm, data_fields=["norms"], meta_fields=["paths", "ord"])


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
                 axis_name: AxisName = None, specs: PyTree = None
                 ) -> PartialNorm:
  """One pipeline stage's part of the global ``ord``-norm of all stages.

  Each clippable leaf is measured on its own (overflow-safe, as
  ``global_norm`` of that leaf alone): its value does not depend on which
  other leaves share the stage. Combine every stage's with
  ``combine_norms``.

  Args:
    tree: the stage's part of the gradients (a pytree of arrays).
    ord: the norm order: any number ``p > 0`` or ``inf``, as a constant.
    prefix: put before each leaf's key path. Paths must be unique over all
      stages: give each stage its part of the whole tree keyed as there
      (``{"layer_3": ...}``), or a prefix naming the part.
    axis_name: under ``shard_map``, the mesh axis name(s) the stage's leaves
      are split over (data or tensor parallel within the stage).
    specs: with ``axis_name``, the leaves' ``PartitionSpec`` (a tree prefix).

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
  """
  fn = "partial_norm"
  p = _static_ord(fn, ord)
  if not isinstance(prefix, str):
    raise TypeError(f"`{fn}(prefix=...)` must be a str, got {prefix!r:.60}")
  where = _core.Where.of(fn, axis_name, specs)
  _validation.check_tree(fn, "tree", tree)
  paths = tuple(prefix + path for path, _ in
                _tree.clippable_leaves_with_paths(tree))
  norms = _core.leaf_norms(fn, tree, p, where)
  return PartialNorm(jnp.stack(norms) if norms else jnp.zeros([0]), paths, p)


def combine_norms(partials: Sequence[PartialNorm]) -> jax.Array:
  """The global norm of all stages, from their ``partial_norm``.

  Every leaf norm is put in the order of its path and the ``ord``-th powers
  summed in a fixed order, overflow-safe: the same bits whatever the split
  into stages and the order of ``partials``. Within a few ulps of
  ``global_norm`` of the whole tree (a NaN or Inf leaf gives NaN or Inf).

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
  paths = [path for part in partials for path in part.paths]
  if len(set(paths)) < len(paths):
    twice = sorted({path for path in paths if paths.count(path) > 1})
    raise ValueError(
        f"`{fn}(partials=...)` holds leaves with the same path in several "
        f"stages: {twice[:5]}; pass each stage's part keyed as in the whole "
        f"tree, or `partial_norm(..., prefix=...)` naming the stage's part")
  order = tuple(sorted(range(len(paths)), key=paths.__getitem__))
  return _core.combined_norm([part.norms for part in partials], order,
                             orders.pop())
