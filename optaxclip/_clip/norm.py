"""Clipping by norm: per leaf, global, and PyTorch's ``clip_grad_norm_``.

Measure -> factor -> scale -> state. Every leaf (or unit) is multiplied by
``s = max_norm / (norm + eps)`` unless ``norm + eps <= max_norm`` (then 1):
with ``eps == 0`` Optax's and TensorFlow's threshold, with ``eps > 0``
PyTorch's and MindSpore's ``min(1, max_norm / (norm + eps))``; one formula,
so ``eps`` may be injected and traced too (``scaling.clip_factor``).
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxclip import _core, _tree, _validation
from optaxclip._clip import masking, on_nonfinite, per_group, scaling
from optaxclip._clip import scale_only as subset
from optaxclip._clip.state import DEFAULT_FLOOR, ClipState, init_clip_state
from optaxclip._types import AxisName, NonFinite, Ord, PyTree, Scalar

PYTORCH_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ divides by norm + 1e-6


class _Clipped(NamedTuple):
  tree: PyTree  # the clipped updates
  norm: jax.Array  # the global norm, or per leaf the largest
  factor: jax.Array  # the factor, or per leaf the smallest
  measured: _core.Measured  # the norms, for the leaf norms a state keeps
  experts: jax.Array | None = None  # the experts' joint norms


def _clip_each(fn: str, tree: PyTree, max_norm, p, eps, where: _core.Where,
               kept: _core.Kept, given=None) -> _Clipped:
  """Every leaf (or, with layers kept, every layer slice) clipped by its
  own norm; the factors are computed once, for every device's units
  (``given``, a global norm, plays no part)."""
  del given
  measured = _core.measure(fn, tree, p, where, kept)
  factors = scaling.clip_factor(measured.units, max_norm, eps)
  clipped = scaling.scale_leaves(tree, measured.to_leaves(factors))
  return _Clipped(clipped, jnp.max(measured.units, initial=0),
                  jnp.min(factors, initial=1), measured)


def _clip_joint(fn: str, tree: PyTree, max_norm, p, eps, where: _core.Where,
                kept: _core.Kept, given=None, *, expert_axis: PyTree,
                layer_axis: PyTree) -> _Clipped:
  """Every expert (of every layer) clipped by the joint norm of its slices
  of all leaves with an expert axis; the other leaves each by its own norm
  (per layer). ``kept`` is the same view (``given`` plays no part)."""
  del kept, given
  joint = _core.measure_joint(fn, tree, p, where, expert_axis, layer_axis)
  factors = scaling.clip_factor(joint.units, max_norm, eps)
  clipped = scaling.scale_leaves(tree, joint.to_leaves(factors))
  return _Clipped(clipped, jnp.max(joint.units, initial=0),
                  jnp.min(factors, initial=1), joint.measured, joint.norms)


def _clip_global(fn: str, tree: PyTree, max_norm, p, eps, where: _core.Where,
                 kept: _core.Kept, given=None, *,
                 only: list[bool] | None = None) -> _Clipped:
  """The tree clipped by its global norm (``kept``: the leaf norms to keep
  from the same pass, or ``TOTAL``; ``given``: a norm measured upstream;
  ``only``: the leaves to scale, all measured)."""
  measured = _core.measure(fn, tree, p, where, kept,
                           given=given if kept is _core.TOTAL else None)
  factor = scaling.clip_factor(measured.total, max_norm, eps)
  scaled = (scaling.scale_leaves(tree, factor) if only is None
            else scaling.scale_some(tree, factor, only))
  return _Clipped(scaled, measured.total, factor, measured)


def _check_joint(fn: str, joint_experts: bool, expert_axis: PyTree) -> bool:
  _validation.check_bool(fn, "joint_experts", joint_experts)
  if joint_experts and expert_axis is None:
    raise ValueError(
        f"`{fn}(joint_experts=True)` needs `expert_axis=`: the axis that "
        f"stacks the experts in each leaf (None for leaves outside them)")
  return bool(joint_experts)


def _checked(fn: str, max_norm, ord, eps, axis_name, specs, ord_name="ord"):
  """``(max_norm, p, eps, where)`` checked (clamped when traced)."""
  return (_validation.check_nonnegative(fn, "max_norm", max_norm, allow_inf=True),
          _validation.check_ord(fn, ord, ord_name),
          _validation.check_nonnegative(fn, "eps", eps),
          _core.Where.of(fn, axis_name, specs))


def clip_by_norm_fn(tree: PyTree, max_norm: Scalar, *, ord: Ord = 2,
                    eps: Scalar = 0.0, axis_name: AxisName = None,
                    specs: PyTree = None, layer_axis: PyTree = None,
                    expert_axis: PyTree = None, joint_experts: bool = False
                    ) -> PyTree:
  """Clips every leaf of ``tree`` by its own ``ord``-norm.

  Each floating leaf ``x`` becomes ``x * s``, ``s = max_norm / (norm(x) +
  eps)`` where that is below 1: TensorFlow's ``tf.clip_by_norm`` with
  ``eps=0``, MindSpore's ``ops.clip_by_norm`` with ``eps=1e-6``. Traced
  arguments are clamped ([docs/hyperparameters.md](../hyperparameters.md)).

  Args:
    tree: a pytree of arrays.
    max_norm: the largest norm a leaf may keep (a number >= 0; ``inf``
      never clips).
    ord: the norm order: any number ``p > 0`` or ``inf``.
    eps: added to the norm before dividing (0: exact threshold).
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the
      updates are split over ([docs/distributed.md](../distributed.md)).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix).
    layer_axis: the axis that stacks scanned layers (an int, or a tree
      prefix of int or None): each layer's slice is clipped on its own.
    expert_axis: the axis that stacks experts (as ``layer_axis``): each
      expert's slice (of each layer) is clipped on its own
      ([docs/experts.md](../experts.md)).
    joint_experts: with ``expert_axis``, each expert (of each layer) is
      clipped by the norm of all its slices together, across the leaves
      with an expert axis (its ``w_in[e]``, ``w_out[e]``, router row ``e``).

  Returns:
    The clipped tree, with each leaf's dtype.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> oc.functional.clip_by_norm([jnp.array([3.0, 4.0]), jnp.array([0.3, 0.4])], 1.0)
    [Array([0.6, 0.8], dtype=float32), Array([0.3, 0.4], dtype=float32)]
  """
  fn = "clip_by_norm"
  max_norm, p, eps, where = _checked(fn, max_norm, ord, eps, axis_name, specs)
  _validation.check_tree(fn, "the tree", tree)
  stacks = _validation.check_stack_axes(fn, expert_axis, layer_axis)
  view = _core.experts(*stacks)
  if _check_joint(fn, joint_experts, expert_axis):
    return _clip_joint(fn, tree, max_norm, p, eps, where, view,
                       expert_axis=stacks[0], layer_axis=stacks[1]).tree
  return _clip_each(fn, tree, max_norm, p, eps, where, view).tree


def _check_use_norm(fn: str, use_norm: Scalar) -> Scalar:
  """A given norm: a number >= 0, NaN or Inf (they propagate, as norms).

  Traced, a negative one acts as 0 (nothing is clipped); NaN stays NaN.
  """
  number = _validation.scalar(fn, "use_norm", use_norm)
  if _validation.is_traced(number):
    return jnp.where(number < 0, jnp.zeros_like(number), number)
  if number < 0:
    raise ValueError(
        f"`{fn}(use_norm=...)` must be a norm: a number >= 0 (NaN and inf "
        f"are passed on as the norm of non-finite gradients), got {use_norm!r}")
  return use_norm


def clip_by_global_norm_fn(tree: PyTree, max_norm: Scalar, *, ord: Ord = 2,
                           eps: Scalar = 0.0, axis_name: AxisName = None,
                           specs: PyTree = None, use_norm: Scalar | None = None
                           ) -> tuple[PyTree, jax.Array]:
  """Scales ``tree`` so that its global ``ord``-norm is at most ``max_norm``.

  All floating leaves are multiplied by one factor computed from the norm
  of the whole tree (``global_norm``): ``eps=0`` gives Optax's and
  TensorFlow's ``clip_by_global_norm``, ``eps=1e-6`` PyTorch's
  ``clip_grad_norm_``. With ``use_norm``, the tree is clipped by that norm
  instead, measured beforehand: nothing is reduced (TensorFlow's
  ``use_norm=``, PyTorch's ``clip_grads_with_norm_``; a NaN one makes every
  leaf NaN, an infinite one gives the factor 0, as in PyTorch). Traced
  arguments are clamped ([docs/hyperparameters.md](../hyperparameters.md)).

  Args:
    tree: a pytree of arrays.
    max_norm: the largest global norm (a number >= 0; ``inf`` never clips).
    ord: the norm order: any number ``p > 0`` or ``inf``.
    eps: added to the norm before dividing (0: exact threshold).
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the
      updates are split over ([docs/distributed.md](../distributed.md)).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix).
    use_norm: the norm to clip by (a scalar >= 0; NaN and inf are passed
      on), or None to measure the tree's own.

  Returns:
    ``(clipped_tree, norm)``: each leaf in its dtype, and the pre-clip norm
    (float32, or float64 for float64 trees under x64).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> grads = [jnp.array([3.0, 4.0]), jnp.array([1.0, 2.0])]
    >>> clipped, norm = oc.functional.clip_by_global_norm(grads, 5.0)
    >>> norm
    Array(5.477226, dtype=float32)
    >>> clipped
    [Array([2.7386127, 3.6514835], dtype=float32), Array([0.9128709, 1.8257419], dtype=float32)]
    >>> oc.functional.clip_by_global_norm(grads, 5.0, use_norm=10.0)[0]  # 5 / 10
    [Array([1.5, 2. ], dtype=float32), Array([0.5, 1. ], dtype=float32)]
  """
  fn = "clip_by_global_norm"
  max_norm, p, eps, where = _checked(fn, max_norm, ord, eps, axis_name, specs)
  _validation.check_tree(fn, "the tree", tree)
  if use_norm is None:
    clipped = _clip_global(fn, tree, max_norm, p, eps, where, _core.TOTAL)
    return clipped.tree, clipped.norm
  acc = _tree.accumulation_dtype(_tree.clippable_leaves(tree))
  norm = jnp.asarray(_check_use_norm(fn, use_norm), acc)
  factor = scaling.clip_factor(norm, max_norm, eps)
  return scaling.scale_leaves(tree, factor), norm


def _checked_floor(fn: str, floor: Scalar | None) -> Scalar | None:
  return None if floor is None else _validation.check_unit_interval(
      fn, "floor", floor)


def _norm_clipper(fn: str, max_norm, p, eps, where: _core.Where,
                  nonfinite: NonFinite, *, per_leaf: bool, leaf_norms: bool,
                  layer_axis: PyTree, floor: Scalar | None,
                  only: subset.ScaleOnly = None, expert_axis: PyTree = None,
                  mask: masking.Mask = None, joint_experts: bool = False
                  ) -> optax.GradientTransformationExtraArgs:
  """The transform: measure -> factor -> scale -> state (``ClipState``).
  ``update(..., grad_norm=...)``: the global norm of these updates,
  measured beforehand (a number, or passed on by ``skip_step`` and
  ``dynamic_loss_scale``): nothing is read to measure it again.
  ``only``: ``scale_only`` (global clippers). ``mask``: leaves kept out of
  the norm and the clip (``masking``). ``joint_experts``: each expert
  clipped by the norm of all its tensors (``_clip_joint``)."""
  _validation.check_choice(fn, "nonfinite", nonfinite, on_nonfinite.MODES)
  _validation.check_bool(fn, "leaf_norms", leaf_norms)
  stacks = _validation.check_stack_axes(fn, expert_axis, layer_axis)
  layers = _core.experts(*stacks)
  floor = _checked_floor(fn, floor)
  only = subset.check(fn, only)
  mask = _validation.check_mask(fn, mask)
  clip: Callable[..., _Clipped] = _clip_each if per_leaf else _clip_global
  if _check_joint(fn, joint_experts, expert_axis):
    clip = functools.partial(_clip_joint, expert_axis=stacks[0],
                             layer_axis=stacks[1])
  kept = layers if per_leaf or leaf_norms else _core.TOTAL

  def init_fn(params):
    _core.unit_shapes(fn, params, layers)  # a layer axis that fits, or an error
    subset.flags(fn, params, only)  # a scale_only that fits, or an error
    experts = (_core.joint_shapes(fn, params, where, *stacks).get("", (0,))
               if joint_experts else None)
    return init_clip_state(fn, params, kept=layers if leaf_norms else None,
                           floor=floor, experts=experts)

  def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
    del params, extra_args
    if state is None:  # stateless use, as optax's clippers allow
      state = init_fn(updates)
    _validation.check_state(fn, state, ClipState)
    _validation.check_tree(fn, "the tree", updates)
    flags = subset.flags(fn, updates, only)
    clipped = (clip(fn, updates, max_norm, p, eps, where, kept, grad_norm)
               if flags is None else
               _clip_global(fn, updates, max_norm, p, eps, where, kept,
                            grad_norm, only=flags))
    finite = jnp.isfinite(clipped.norm)
    out, factor = clipped.tree, clipped.factor
    if nonfinite != "propagate":
      # A raise reports the leaves as given: in the clipped ones a NaN
      # factor is everywhere.
      (factor,) = on_nonfinite.guard(nonfinite, fn, updates, clipped.norm,
                                     [factor], [finite])
      out = on_nonfinite.zeroed(nonfinite, out, finite)
    return out, state.after(clipped.norm, factor, finite=finite, floor=floor,
                            measured=clipped.measured if leaf_norms else None,
                            expert_norms=clipped.experts)

  tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  return tx if mask is None else masking.masked(fn, tx, mask)


def clip_by_norm(max_norm: Scalar, *, ord: Ord = 2, eps: Scalar = 0.0,
                 axis_name: AxisName = None, specs: PyTree = None,
                 nonfinite: NonFinite = "propagate", layer_axis: PyTree = None,
                 leaf_norms: bool = False, floor: Scalar | None = DEFAULT_FLOOR,
                 expert_axis: PyTree = None, mask: masking.Mask = None,
                 joint_experts: bool = False) -> optax.GradientTransformation:
  """Clips every leaf of the updates by its own norm.

  The transform form of ``optaxclip.functional.clip_by_norm``; its state
  (``ClipState``) logs the largest leaf norm and the smallest factor.
  Injected hyperparameters: [docs/hyperparameters.md](../hyperparameters.md).

  Args:
    max_norm: as in ``functional.clip_by_norm``.
    ord: as there.
    eps: as there.
    axis_name: as there ([docs/distributed.md](../distributed.md)).
    specs: as there.
    nonfinite: ``"propagate"``, ``"zero"`` or ``"raise"``: what a NaN or
      Inf norm does (as in ``clip_by_global_norm``).
    layer_axis: the axis that stacks scanned layers (an int, or a tree
      prefix of int or None): each layer's slice is clipped on its own.
    leaf_norms: keep every leaf's (and layer's) norm in the state
      (``clip/leaf_norm/<path>``, ``clip/layer_norm/<path>/<layer>`` in
      ``optaxclip.stats``).
    floor: as in ``clip_by_global_norm``.
    expert_axis: the axis that stacks experts (as ``layer_axis``; both:
      per layer x expert): each expert is clipped on its own.
    mask: leaves to clip (a tree prefix of bools, or a callable of the
      updates, as ``optax.masked``'s); the others pass through untouched.
    joint_experts: with ``expert_axis``, each expert (of each layer) is
      clipped by the norm of all its tensors together (its slices of every
      leaf with an expert axis); the state keeps these norms
      (``clip/expert_norm/<layer>/<expert>``; [docs/experts.md](../experts.md)).

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``ClipState``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> tx = oc.clip_by_norm(1.0)
    >>> updates, state = tx.update([jnp.array([3.0, 4.0])], tx.init(None))
    >>> updates, state.norm
    ([Array([0.6, 0.8], dtype=float32)], Array(5., dtype=float32))
  """
  fn = "clip_by_norm"
  max_norm, p, eps, where = _checked(fn, max_norm, ord, eps, axis_name, specs)
  return _norm_clipper(fn, max_norm, p, eps, where, nonfinite, per_leaf=True,
                       leaf_norms=leaf_norms, layer_axis=layer_axis,
                       floor=floor, expert_axis=expert_axis, mask=mask,
                       joint_experts=joint_experts)


def clip_by_global_norm(max_norm: Scalar | dict[str, Scalar], *, ord: Ord = 2,
                        eps: Scalar = 0.0, axis_name: AxisName = None,
                        specs: PyTree = None, nonfinite: NonFinite = "propagate",
                        leaf_norms: bool = False, layer_axis: PyTree = None,
                        groups: per_group.Labels = None,
                        floor: Scalar | None = DEFAULT_FLOOR,
                        scale_only: subset.ScaleOnly = None,
                        expert_axis: PyTree = None, mask: masking.Mask = None
                        ) -> optax.GradientTransformation:
  """Scales the updates so that their global norm is at most ``max_norm``.

  A drop-in for ``optax.clip_by_global_norm`` (the same numbers to a few
  float32 ulps) whose state keeps the pre-clip norm for logging
  (``optaxclip.stats``), finite for finite gradients of any magnitude and
  dtype. ``update`` accepts ``state=None``, as Optax's. Injected
  hyperparameters: [docs/hyperparameters.md](../hyperparameters.md).

  Args:
    max_norm: the largest global norm (a number >= 0; ``inf`` never clips);
      with ``groups``, a number or a dict from label to limit.
    ord: the norm order: any number ``p > 0`` or ``inf``.
    eps: added to the norm before dividing: 0 (Optax, TensorFlow) clips
      exactly at ``max_norm``; 1e-6 is PyTorch's ``clip_grad_norm_``.
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the
      updates are split over ([docs/distributed.md](../distributed.md)).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix).
    nonfinite: what a NaN or Inf norm does: ``"propagate"`` (as Optax,
      PyTorch, TensorFlow), ``"zero"`` (zero update) or ``"raise"`` (an error
      naming the leaves, also under ``jit``); counted in ``nonfinite_count``.
    leaf_norms: keep every leaf's norm in the state, from the same pass
      (``clip/leaf_norm/<path>`` in ``optaxclip.stats``).
    layer_axis: with ``leaf_norms``, the axis that stacks scanned layers (an
      int, or a tree prefix of int or None): one norm per layer
      (``clip/layer_norm/<path>/<layer>``), and the stack's whole norm.
    groups: labels (a tree prefix of strings, as ``optax.partition``'s, or a
      callable of the updates): each group is clipped by its own norm, from
      one pass; the state is then a ``GroupClipState`` (``clip/<label>/...``).
      An ``optaxclip.along(label, axis)`` label splits its group along that
      axis: one norm per expert (and layer) over all its tensors.
    floor: the stall guard: steps whose factor falls under it are counted
      (``clip/floor_count``; the smallest factor is ``clip/min_scale``), a
      number in [0, 1] or None (not counted); [docs/muon.md](../muon.md).
    scale_only: the leaves to scale (a tree prefix of bools, or a callable
      of the updates): all are measured, those marked False pass through
      (Muon's matrices; [docs/muon.md](../muon.md)). None: all are scaled.
    expert_axis: with ``leaf_norms``, the axis that stacks experts (as
      ``layer_axis``; both: one norm per layer x expert;
      [docs/experts.md](../experts.md)).
    mask: leaves in the norm and the clip (a tree prefix of bools, or a
      callable of the updates, as ``optax.masked``'s); the others (a frozen
      router) are left out of both and pass through untouched.

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``ClipState``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optaxclip as oc
    >>> tx = optax.chain(oc.clip_by_global_norm(1.0), optax.sgd(1.0))
    >>> params = {"w": jnp.array([3.0, 4.0])}
    >>> updates, state = tx.update(params, tx.init(params), params)
    >>> updates["w"], oc.stats(state)["clip/norm"]
    (Array([-0.6, -0.8], dtype=float32), Array(5., dtype=float32))
  """
  fn = "clip_by_global_norm"
  p = _validation.check_ord(fn, ord)
  eps = _validation.check_nonnegative(fn, "eps", eps)
  where = _core.Where.of(fn, axis_name, specs)
  max_norm = per_group.check_max_norms(fn, max_norm, groups is not None)
  if groups is not None:
    if scale_only is not None:
      raise ValueError(
          f"`{fn}`: pass `groups=` or `scale_only=`, not both: a group's "
          f"leaves are scaled by the group's own norm")
    tx = per_group.group_clipper(fn, max_norm, p, eps, where, nonfinite, groups,
                                 leaf_norms=leaf_norms, layer_axis=layer_axis,
                                 expert_axis=expert_axis,
                                 floor=_checked_floor(fn, floor))
    mask = _validation.check_mask(fn, mask)
    return tx if mask is None else masking.masked(fn, tx, mask)
  return _norm_clipper(fn, max_norm, p, eps, where, nonfinite, per_leaf=False,
                       leaf_norms=leaf_norms, layer_axis=layer_axis,
                       floor=floor, only=scale_only, expert_axis=expert_axis,
                       mask=mask)


def clip_grad_norm(max_norm: Scalar, norm_type: Ord = 2.0, *,
                   error_if_nonfinite: bool = False,
                   axis_name: AxisName = None, specs: PyTree = None,
                   leaf_norms: bool = False, layer_axis: PyTree = None,
                   floor: Scalar | None = DEFAULT_FLOOR,
                   scale_only: subset.ScaleOnly = None,
                   expert_axis: PyTree = None, mask: masking.Mask = None
                   ) -> optax.GradientTransformation:
  """PyTorch's ``torch.nn.utils.clip_grad_norm_`` as an Optax transform.

  Every gradient is multiplied by ``min(1, max_norm / (total_norm +
  1e-6))``, ``total_norm`` the ``norm_type``-norm of all gradients; the
  state keeps ``total_norm`` (what PyTorch returns). The numbers agree
  with PyTorch's to a few float32 ulps
  ([docs/migration/pytorch.md](../migration/pytorch.md)). Injected
  hyperparameters: [docs/hyperparameters.md](../hyperparameters.md).

  Args:
    max_norm: the largest total norm (a number >= 0; ``inf`` never clips).
    norm_type: the norm order: any number ``p > 0``, ``inf`` or ``"inf"``.
    error_if_nonfinite: raise when the total norm is NaN or Inf (PyTorch's
      flag), naming the leaves that hold them; otherwise they propagate.
    axis_name: as in ``clip_by_global_norm``.
    specs: as in ``clip_by_global_norm``.
    leaf_norms: as in ``clip_by_global_norm``.
    layer_axis: as in ``clip_by_global_norm`` (per-layer leaf norms).
    floor: as in ``clip_by_global_norm``.
    scale_only: as in ``clip_by_global_norm``.
    expert_axis: as in ``clip_by_global_norm`` (per-expert leaf norms).
    mask: as in ``clip_by_global_norm`` (leaves without gradients in
      PyTorch: left out of the norm and the clip).

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``ClipState``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optaxclip as oc
    >>> grads = [jnp.array([[-0.1, -0.25, -0.1], [0.1, 0.25, 0.1]]), jnp.array([-0.5, 0.5])]
    >>> tx = oc.clip_grad_norm(0.5)
    >>> clipped, state = tx.update(grads, tx.init(grads))
    >>> clipped[1]
    Array([-0.3065693,  0.3065693], dtype=float32)
  """
  fn = "clip_grad_norm"
  _validation.check_bool(fn, "error_if_nonfinite", error_if_nonfinite)
  max_norm, p, _, where = _checked(fn, max_norm, norm_type, PYTORCH_EPS,
                                   axis_name, specs, "norm_type")
  nonfinite = "raise" if error_if_nonfinite else "propagate"
  return _norm_clipper(fn, max_norm, p, PYTORCH_EPS, where, nonfinite,
                       per_leaf=False, leaf_norms=leaf_norms,
                       layer_axis=layer_axis, floor=floor, only=scale_only,
                       expert_axis=expert_axis, mask=mask)
