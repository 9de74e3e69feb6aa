"""The one norm implementation every clipper uses.

``p``-norms are ``(sum |x|**p) ** (1/p)`` of absolute values, and ``inf`` is
``max |x|``; complex leaves use ``|x|``. Each leaf is reduced to one partial
value (its power sum, or its max) in float32 at least, whatever its dtype:
squares of fp16 overflow above 256 and bf16 squares would keep 8 bits. The
partials of all leaves travel together, so a distributed norm costs one
all-reduce of a small vector per step.

The plain power sum overflows float32 for |x| above ~1.8e19 (squares) and
loses everything below ~1e-19 (squares flush to zero). Only then, decided at
run time by ``lax.cond``, a second pass sums rescaled values. For ``p = 2``
(the common case) the scale is a fixed power of two, chosen by which end
failed, so the rescue is one more pass and nothing else; other orders first
find the largest |x| and rescale by the power of two just above it. Sums of
``|x|`` (``p = 1``) and maxima (``inf``) overflow only when the norm itself
does, and need no rescue. Finite input therefore gives the right finite norm,
and ordinary input pays nothing for the safety net.
"""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optaxclip import _tree, _validation

PyTree = Any


class Reduction(NamedTuple):
  """Combines per-leaf partials across the devices of ``axis_names``.

  Under ``shard_map``/``pmap`` each device holds a shard of every split leaf,
  so partial sums are added over the named axes. A leaf that ``specs`` marks
  as replicated on some axis holds the same values on each device of that
  axis: only the device at index 0 of such an axis contributes, so the leaf
  is counted once. All leaves then share one ``psum``: one all-reduce.
  Hashable, so compiled norms are cached per reduction.
  """
  axis_names: tuple[Any, ...]
  replicated_axes: tuple[tuple[Any, ...], ...] | None = None  # per leaf;
  #                                               None: every leaf is split

  def sum(self, partials: jax.Array) -> jax.Array:
    if not self.axis_names:
      return partials
    if self.replicated_axes is not None:
      partials = partials * self._first_copy_mask(partials.dtype)
    return lax.psum(partials, self.axis_names)

  def max(self, partials: jax.Array) -> jax.Array:
    # Replicated leaves need no mask: max ignores repeated values.
    return lax.pmax(partials, self.axis_names) if self.axis_names else partials

  def device_count(self) -> int:
    return lax.psum(1, self.axis_names) if self.axis_names else 1

  def _first_copy_mask(self, dtype) -> jax.Array:
    assert self.replicated_axes is not None
    masks = []
    for axes in self.replicated_axes:
      is_first = jnp.bool_(True)
      for axis in axes:
        is_first = is_first & (lax.axis_index(axis) == 0)
      masks.append(is_first)
    return jnp.stack(masks).astype(dtype)


LOCAL = Reduction(())


def _spec_axes(spec: jax.sharding.PartitionSpec) -> set[Any]:
  """The mesh axes a PartitionSpec splits an array over."""
  axes = set()
  for entry in spec:
    if entry is None:
      continue
    axes.update(entry if isinstance(entry, tuple) else (entry,))
  return axes


def _is_spec(x: Any) -> bool:
  return x is None or isinstance(x, jax.sharding.PartitionSpec)


def _leaf_specs(fn: str, tree: PyTree, specs: PyTree) -> list[Any]:
  """One PartitionSpec per leaf of ``tree`` (``specs`` is a tree prefix)."""
  def broadcast(spec, subtree):
    if not _is_spec(spec):
      raise TypeError(
          f"`{fn}(specs=...)` must hold PartitionSpecs (or None), got "
          f"{spec!r} of type {type(spec).__name__}")
    spec = jax.sharding.PartitionSpec() if spec is None else spec
    return jax.tree.map(lambda _: spec, subtree)

  try:
    leaf_specs = jax.tree.map(broadcast, specs, tree, is_leaf=_is_spec)
  except ValueError as error:
    raise ValueError(
        f"`{fn}(specs=...)` must be a PartitionSpec or a tree prefix of the "
        f"gradients with PartitionSpec leaves (as shard_map's in_specs); "
        f"it does not match the gradient tree: {error}") from None
  return jax.tree.leaves(
      leaf_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def clippable_leaf_specs(fn: str, tree: PyTree, specs: PyTree) -> list[Any]:
  """The PartitionSpec of every clippable leaf (None each when no specs)."""
  if specs is None:
    return [None] * len(_tree.clippable_leaves(tree))
  return [spec for spec, leaf in zip(_leaf_specs(fn, tree, specs),
                                     jax.tree.leaves(tree))
          if _tree.is_clippable(leaf)]


def make_reduction(fn: str, tree: PyTree, axis_name: Any,
                   specs: PyTree) -> Reduction:
  """The reduction for ``tree``'s clippable leaves given the user's options."""
  axis_names = _validation.check_axis_name(fn, axis_name)
  if specs is None:
    return Reduction(axis_names)
  if not axis_names:
    raise ValueError(
        f"`{fn}(specs=...)` needs `axis_name`: specs say how leaves are split "
        f"over the named axes of shard_map/pmap")
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  replicated = []
  for (path, leaf), spec in zip(with_paths, _leaf_specs(fn, tree, specs)):
    if not _tree.is_clippable(leaf):
      continue
    split = _spec_axes(spec)
    if split - set(axis_names):
      raise ValueError(
          f"`{fn}(specs=...)` splits leaf {jax.tree_util.keystr(path)} over "
          f"mesh axes {sorted(map(str, split - set(axis_names)))} that are not "
          f"in axis_name={axis_name!r}: its norm would differ per device. Add "
          f"them to axis_name")
    replicated.append(tuple(a for a in axis_names if a not in split))
  return Reduction(axis_names, tuple(replicated))


def _is_order(p: Any, value: float) -> bool:
  """Whether the norm order is statically ``value`` (a traced order never is)."""
  return not isinstance(p, jax.Array) and p == value


def _integer_power(p: Any) -> int | None:
  if isinstance(p, jax.Array) or not float(p).is_integer() or p > 64:
    return None
  return int(p)


def magnitude(x: jax.Array, acc: jnp.dtype) -> jax.Array:
  """``|x|`` in ``acc``; a complex leaf's in its own precision (no upcast)."""
  return jnp.abs(x).astype(acc) if jnp.iscomplexobj(x) else jnp.abs(x.astype(acc))


def _pow(a: jax.Array, p: float) -> jax.Array:
  """``a ** p`` for ``a >= 0`` with a finite gradient at 0 for p < 1."""
  k = _integer_power(p)
  if k is not None:
    return lax.integer_pow(a, k)  # exact-ish multiplies, no exp/log
  if not isinstance(p, jax.Array) and p > 1:
    return a ** p
  positive = a > 0
  return jnp.where(positive, jnp.where(positive, a, 1) ** p, 0)


def safe_root(s: jax.Array, p: float) -> jax.Array:
  """``s ** (1/p)`` for ``s >= 0`` (NaN stays NaN), finite gradient at 0."""
  if _is_order(p, 1):
    return s
  positive = s > 0
  safe = jnp.where(positive, s, 1)
  root = jnp.sqrt(safe) if _is_order(p, 2) else safe ** (1 / p)
  return jnp.where(positive, root, s)  # s itself for 0 and NaN


# Leaves up to this many elements are stacked with the others of their shape
# and dtype and reduced together: one fusion per group instead of one per
# leaf keeps compile time flat in the number of leaves. Larger leaves reduce
# on their own, so run time never pays for copying them.
GROUP_LIMIT = 1 << 15
# At most this many leaves per group. XLA's cost of compiling one
# concatenation grows faster than its operand count beyond a few hundred,
# and separate groups compile in parallel: with 2000 leaves, groups of 256
# compile in half the time one group of all of them takes (benchmarks/,
# compile target).
GROUP_SIZE = 256


def _layout(x: jax.Array) -> Any:
  """What two leaves must share to be stacked without moving data.

  Unsharded leaves share everything; on an Explicit mesh, leaves with the
  same PartitionSpec do. On an Auto mesh the sharding is unknown while
  tracing (the compiler picks it): such leaves reduce alone (None), since
  stacking differently sharded leaves would make XLA move them.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if sharding is None or mesh is None or mesh.empty:
    return ()
  if any(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return None
  return mesh, sharding.spec


def _groups(leaves: list[jax.Array], *,
            merge: bool = False) -> list[tuple[Any, jax.Array]]:
  """The leaves as ``(index, leaf)`` or ``(indices, stack of leaves)``.

  Small leaves of the same shape, dtype and sharding are stacked, once: the
  plain pass and the rare rescue pass both read these groups, so the rescue
  adds no copy of the stacking to the program. With ``merge`` (a global norm
  that needs no per-leaf partials), small unsharded leaves of one dtype are
  concatenated whatever their shapes, as ``(None, flat vector)``: one
  reduction per ``GROUP_SIZE`` leaves.
  """
  by_key: dict[Any, list[int]] = {}
  for i, x in enumerate(leaves):
    layout = _layout(x)
    if x.size > GROUP_LIMIT or layout is None:
      key = i
    elif merge and layout == ():
      key = ("flat", x.dtype)
    else:
      key = (x.shape, x.dtype, layout)
    by_key.setdefault(key, []).append(i)
  groups = []
  for key, all_rows in by_key.items():
    for start in range(0, len(all_rows), GROUP_SIZE):
      rows = all_rows[start:start + GROUP_SIZE]
      groups.append(_group([leaves[i] for i in rows], rows,
                           flat=isinstance(key, tuple) and key[0] == "flat"))
  return groups


def _group(members: list[jax.Array], rows: list[int], *,
           flat: bool) -> tuple[Any, jax.Array]:
  if len(members) == 1:
    return rows[0], members[0]
  if flat:
    # lax, not jnp, and no reshape of vectors: this runs once per leaf, and
    # tracing time is part of the compile time of trees with many leaves.
    return None, lax.concatenate(
        [x if x.ndim == 1 else lax.reshape(x, (x.size,)) for x in members], 0)
  return np.asarray(rows), jnp.stack(members)


def _take(vector: jax.Array, indices) -> jax.Array:
  """``vector[indices]`` for static in-bounds indices: a bare gather."""
  return vector.at[np.asarray(indices)].get(mode="promise_in_bounds",
                                            unique_indices=True)


def _per_leaf(groups, elementwise, reduce) -> jax.Array:
  """``reduce(elementwise(x, rows))`` of every leaf, as a vector in leaf order.

  ``elementwise`` gets a leaf (or a stack of leaves) and its index (or the
  array of their indices), to pick per-leaf factors. A merged group (rows
  None) gives one value for all its leaves: the vector is then per group,
  fit for a total only.
  """
  pieces, order = [], []
  for rows, values in groups:
    values = elementwise(values, rows)
    if rows is None or np.ndim(rows) == 0:
      pieces.append(reduce(values)[None])
      order.append(-1 if rows is None else rows)
    else:
      # Reduced over the leaf axes as they are: a reshape of a sharded
      # stack would be a resharding.
      pieces.append(reduce(values, axis=tuple(range(1, values.ndim))))
      order.extend(rows)
  vector = jnp.concatenate(pieces)
  if -1 not in order and order != sorted(order):
    vector = _take(vector, np.argsort(order))
  return vector


def _factor_for(factors: jax.Array, rows, ndim: int) -> jax.Array:
  """The factor of a leaf or stack: shared (a scalar) or ``factors[rows]``."""
  if factors.ndim == 0:
    return factors
  if np.ndim(rows) == 0:
    return factors[rows]
  return _take(factors, rows).reshape((-1,) + (1,) * (ndim - 1))


def _elementwise_power(x: jax.Array, p: Any, acc: jnp.dtype) -> jax.Array:
  """``|x| ** p`` in ``acc`` (``|x|`` for ``inf``), without a sqrt for p=2."""
  if _is_order(p, math.inf):
    return magnitude(x, acc)
  if _is_order(p, 2) and not jnp.iscomplexobj(x):
    y = x.astype(acc)
    return y * y
  if _is_order(p, 2):
    re, im = jnp.real(x).astype(acc), jnp.imag(x).astype(acc)
    return re * re + im * im
  return _pow(magnitude(x, acc), p)


def _reduce_leaves(groups, elementwise, reduction: Reduction, *,
                   maximum: bool, total: bool) -> jax.Array:
  """Sums (or maxima) of ``elementwise(x, rows)`` per leaf over all devices
  of ``reduction``, as a vector in leaf order; with ``total``, of all leaves
  together, as a scalar.
  """
  reduce = functools.partial(jnp.max, initial=0) if maximum else jnp.sum
  across = reduction.max if maximum else reduction.sum
  if total and reduction.replicated_axes is None:
    # Each group reduces to a scalar and these combine by scalar ops: no
    # small vector is reduced (XLA:CPU compiles each small reduction as a
    # costly kernel of its own), and the devices share one all-reduce.
    combine = jnp.maximum if maximum else jnp.add
    return across(functools.reduce(
        combine, [reduce(elementwise(values, rows)) for rows, values in groups]))
  partials = across(_per_leaf(groups, elementwise, reduce))
  if not total:
    return partials
  return jnp.max(partials) if maximum else jnp.sum(partials)


def _power_sums(groups, p, acc, reduction: Reduction, *,
                total: bool = False) -> jax.Array:
  return _reduce_leaves(groups, lambda x, rows: _elementwise_power(x, p, acc),
                        reduction, maximum=_is_order(p, math.inf), total=total)


def _power_of_two_halves(exponent: jax.Array,
                         dtype) -> tuple[jax.Array, jax.Array]:
  """Two normal floats whose product is ``2 ** exponent``, built from bits.

  XLA multiplies by the reciprocal when dividing by a scalar, and the
  reciprocal of a huge maximum (above 2**126) is subnormal, flushed to zero.
  Two power-of-two factors stay normal over the whole float range and
  multiply exactly; setting their exponent bits costs two ops where
  ``jnp.ldexp`` costs twenty.
  """
  info = jnp.finfo(dtype)
  integer = jnp.int64 if info.bits == 64 else jnp.int32
  exponent = exponent.astype(integer)
  half = exponent // 2
  low, high = (
      lax.bitcast_convert_type((part + info.maxexp - 1) << info.nmant, dtype)
      for part in (half, exponent - half))
  return low, high


def times_power_of_two(x: jax.Array, exponent: jax.Array) -> jax.Array:
  """``x * 2**exponent``, exactly, over the whole range of the float."""
  low, high = _power_of_two_halves(exponent, x.dtype)
  return x * low * high


def _rescaled_sums(groups, p, acc, reduction, *, total: bool):
  """Power sums of ``|x| / 2**k``, with ``2**k`` just above the largest |x|.

  ``k`` is per leaf, or one scalar for all leaves (``total``: then the sum is
  one scalar too). Returns ``(k, usable, sums)``: where the largest |x| is 0
  or not finite (zeros, Inf, NaN) ``usable`` is False and ``k`` is 0.
  """
  maxima = _power_sums(groups, math.inf, acc, reduction, total=total)
  usable = jnp.isfinite(maxima) & (maxima > 0)
  _, exponents = jnp.frexp(jnp.where(usable, maxima, 1))
  exponents = jnp.where(usable, exponents, 0)
  low, high = _power_of_two_halves(-exponents, acc)

  def scaled_power(x, rows):
    factors = _factor_for(low, rows, x.ndim), _factor_for(high, rows, x.ndim)
    return _pow(magnitude(x, acc) * factors[0] * factors[1], p)

  return exponents, usable, _reduce_leaves(groups, scaled_power, reduction,
                                           maximum=False, total=total)


def _precision_floor(leaves, acc, reduction: Reduction) -> jax.Array:
  """Power sums below this may have lost terms to underflow.

  Each flushed term loses at most ``tiny``; with ``n`` terms a sum above
  ``n * tiny / eps`` is still accurate to float precision.
  """
  info = jnp.finfo(acc)
  count = sum(x.size for x in leaves) * reduction.device_count()
  return jnp.asarray(float(info.tiny) / float(info.eps), acc) * count


def _square_rescue_scale(sums, floor) -> jax.Array:
  """For ``p = 2``: the power of two each sum of squares is redone with.

  Overflowed (or NaN) sums are redone with ``2**-(maxexp/2 + 1)`` (2**-65 in
  float32), which keeps the square of the largest float finite; sums below
  ``floor`` with ``2**((1 - minexp)/2)`` (2**63), which lifts the square of
  the smallest normal float into the normal range. Others keep 1. These
  powers of two and their inverses are normal floats, so scaling by them and
  dividing by them again are exact.
  """
  info = jnp.finfo(sums.dtype)
  down, up = 2.0 ** -(info.maxexp // 2 + 1), 2.0 ** ((1 - info.minexp) // 2)
  return jnp.where(~(sums < jnp.inf), down,
                   jnp.where(sums < floor, up, 1)).astype(sums.dtype)


def _rescued_squares(groups, acc, reduction, scales, *,
                     total: bool) -> jax.Array:
  """Sums of ``(x * scale)**2``, ``scales`` one scalar or one per leaf."""
  def scaled_square(x, rows):
    return _elementwise_power(x * _factor_for(scales, rows, x.ndim), 2, acc)

  return _reduce_leaves(groups, scaled_square, reduction, maximum=False,
                        total=total)


def _rescued_square_root(sums, floor, resum) -> jax.Array:
  """``sqrt(sums)``, with unsafe sums redone by ``resum(scales)`` first.

  The branch only gives the sums; the root and the division by the scale
  are shared after it. That keeps the compiled program small, which matters
  for compile time: XLA:CPU compiles every distinct scalar kernel on its
  own, at ~6 ms each, and every reduction in the branch once more.
  """
  scales = _square_rescue_scale(sums, floor)
  squares = lax.cond(_unsafe(sums, floor), lambda: resum(scales), lambda: sums)
  return safe_root(squares, 2) / scales


def _unsafe(sums, floor) -> jax.Array:
  # Inf and NaN fail both comparisons; the rescue then propagates them.
  return ~jnp.all((sums >= floor) & (sums < jnp.inf))


def _needs_no_rescue(p) -> bool:
  return _is_order(p, math.inf) or _is_order(p, 1)


def _switch_on_order(norm_fn, p: jax.Array) -> jax.Array:
  """Runs ``norm_fn`` with a traced order (``optax.inject_hyperparams``).

  The usual orders keep their fast, exact formulations; any other runs the
  generic ``|x| ** p`` path. Only the selected branch runs.
  """
  branches = [lambda: norm_fn(2.0), lambda: norm_fn(1.0),
              lambda: norm_fn(math.inf), lambda: norm_fn(p)]
  index = jnp.select([p == 2, p == 1, p == jnp.inf], [0, 1, 2], 3)
  return lax.switch(index, branches)


def _by_order(norm_fn):
  """``norm_fn(leaves, p, reduction)``, compiled once per tree structure,
  order and reduction.

  Called eagerly, a norm would otherwise re-trace its ``lax.cond`` at every
  call; inside a user's ``jit`` the inner jit is simply inlined. A traced
  order (``optax.inject_hyperparams``) dispatches with ``lax.switch``.
  """
  compiled = jax.jit(norm_fn, static_argnums=(1, 2))

  @functools.wraps(norm_fn)
  def call(leaves: list[jax.Array], p: Any,
           reduction: Reduction = LOCAL) -> jax.Array:
    if not isinstance(p, jax.Array):
      return compiled(leaves, p, reduction)
    return _switch_on_order(
        lambda q: (norm_fn if isinstance(q, jax.Array) else compiled)(
            leaves, q, reduction), p)

  return call


def _p_norms(leaves, p, reduction: Reduction, *, total: bool) -> jax.Array:
  """The ``p``-norm of each leaf (a vector in the accumulation dtype) or,
  with ``total``, of all leaves together (a scalar)."""
  acc = _tree.accumulation_dtype(leaves)
  if not leaves:
    return jnp.zeros([] if total else [0], acc)
  groups = _groups(leaves, merge=total and reduction.replicated_axes is None)
  sums = _power_sums(groups, p, acc, reduction, total=total)
  if _is_order(p, math.inf):
    return sums
  if _needs_no_rescue(p):
    return safe_root(sums, p)
  floor = _precision_floor(leaves, acc, reduction)
  if _is_order(p, 2):
    return _rescued_square_root(sums, floor, lambda scales: _rescued_squares(
        groups, acc, reduction, scales, total=total))

  def rescued():
    exponents, usable, scaled = _rescaled_sums(groups, p, acc, reduction,
                                               total=total)
    return jnp.where(usable, times_power_of_two(safe_root(scaled, p), exponents),
                     safe_root(sums, p))

  return lax.cond(_unsafe(sums, floor), rescued, lambda: safe_root(sums, p))


@_by_order
def leaf_norms(leaves, p, reduction):
  """The ``p``-norm of each leaf, as a vector in the accumulation dtype."""
  return _p_norms(leaves, p, reduction, total=False)


@_by_order
def norm_of_leaves(leaves, p, reduction):
  """The ``p``-norm of all ``leaves`` taken together, as a scalar."""
  return _p_norms(leaves, p, reduction, total=True)


def global_norm(tree: PyTree, ord: float | str = 2, *, axis_name: Any = None,
                specs: PyTree = None) -> jax.Array:
  """The ``ord``-norm of all floating leaves of ``tree`` taken together.

  Integer, boolean, ``None`` and ``optax.MaskedNode`` leaves are left out.
  The result is float32 (float64 when x64 is on and a leaf is float64),
  computed from float32 partial sums whatever the leaf dtype, and correct for
  finite leaves of any magnitude (no overflow to ``inf``, no underflow to 0).

  Args:
    tree: a pytree of arrays (for instance gradients).
    ord: the norm order: any number ``p > 0`` or ``inf`` (``"inf"`` too);
      traced (inside ``jit``), one that is not > 0 acts as 2.
    axis_name: under ``shard_map``/``pmap``, the mesh axis name (or tuple of
      names) the leaves are split over; the norm is then that of the whole,
      unsplit tree, computed with one all-reduce.
    specs: with ``axis_name``, the ``PartitionSpec`` of each leaf (a tree
      prefix, as given to ``shard_map``'s ``in_specs``). Leaves replicated on
      an axis are counted once. ``None`` treats every leaf as split.

  Returns:
    A scalar array: the norm.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> grads = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([1.0, 2.0])}
    >>> oc.functional.global_norm(grads)
    Array(5.477226, dtype=float32)
    >>> oc.functional.global_norm(grads, ord="inf")
    Array(4., dtype=float32)
    >>> oc.functional.global_norm([jnp.full(10, 1e20)])  # no overflow
    Array(3.1622778e+20, dtype=float32)
  """
  p = _validation.check_ord("global_norm", ord)
  _validation.check_tree("global_norm", "tree", tree)
  reduction = make_reduction("global_norm", tree, axis_name, specs)
  return norm_of_leaves(_tree.clippable_leaves(tree), p, reduction)


def all_finite(tree: PyTree, *, axis_name: Any = None) -> jax.Array:
  """Whether every floating leaf of ``tree`` is free of NaN and Inf.

  Args:
    tree: a pytree of arrays.
    axis_name: under ``shard_map``/``pmap``, the axis name(s) to agree over:
      the answer is then the same on every device.

  Returns:
    A boolean scalar array (True for an empty tree).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> oc.functional.all_finite({"a": jnp.ones(3), "b": jnp.array([jnp.nan])})
    Array(False, dtype=bool)
  """
  axis_names = _validation.check_axis_name("all_finite", axis_name)
  _validation.check_tree("all_finite", "tree", tree)
  leaves = _tree.clippable_leaves(tree)
  if not leaves:
    return jnp.bool_(True)
  local = jnp.all(_per_leaf(_groups(leaves), lambda x, rows: jnp.isfinite(x),
                            jnp.all))
  if not axis_names:
    return local
  return lax.pmin(local.astype(jnp.int32), axis_names).astype(jnp.bool_)
