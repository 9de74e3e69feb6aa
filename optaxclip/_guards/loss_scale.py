"""Dynamic loss scaling for float16 training, and ``loss_scale(opt_state)``.

Small float16 gradients flush to zero in the backward pass. The loss is
multiplied by a large scale ``S`` before ``jax.grad`` (every gradient is then
``S`` times larger and representable) and the gradients are divided by ``S``
again here. A too large ``S`` overflows to Inf: that step is an overflow, its
update must not reach the optimizer, and ``S`` is divided by ``factor`` (not
below ``min_scale``). After ``period`` finite steps in a row ``S`` is
multiplied by ``factor``, to find the largest scale that does not overflow.

Skipping the optimizer on an overflow. ``dynamic_loss_scale(optax.adamw(...))``
wraps the optimizer, as PyTorch's ``GradScaler.step`` does: on an overflow
the optimizer's updates are zeros and its state stays bit for bit as it was,
while the scale's back-off sticks. The compositions that keep this:

- ``dynamic_loss_scale(inner)``, clippers inside, where the gradients are
  already unscaled: ``dynamic_loss_scale(optax.chain(clip_by_global_norm(1.0),
  optax.adamw(...)))``. ``dynamic_loss_scale(skip_step(inner, zscore=6.0))``
  also skips norm spikes (``skip_step`` sees unscaled gradients and never an
  overflow).
- ``skip_step(optax.chain(dynamic_loss_scale(), optax.adamw(...)))``:
  ``skip_step`` rolls back every inner state except the loss scale's, and
  judges its input (still scaled) divided by the scale.
- With gradient accumulation, ``dynamic_loss_scale(inner, every_k_steps=k)``
  is GradScaler's: the scale is fixed for a window of ``k`` micro-batches,
  their unscaled sum is one optimizer step, and a window with an overflow is
  skipped whole, with one back-off (a sum that is Inf as the optimizer gets
  it, in the accumulator's dtype or cast to the gradients', is one too).
  ``dynamic_loss_scale(optax.MultiSteps(...))`` drops only the overflowed
  micro-batch and backs off at once (its ``period`` counts micro-batches);
  a finite micro-batch that overflows MultiSteps' own accumulator (a sum,
  or the mean's ``grad - acc``) or its optimizer's step is one too (one
  read of the proposed updates, accumulator and optimizer state per
  micro-batch, only around MultiSteps).
  Inside ``MultiSteps`` the accumulator would sum scaled gradients, and one
  overflow would poison it for good.

The chain form, ``optax.chain(dynamic_loss_scale(), optax.adamw(...))``,
passes zeros on after an overflow: the params stay finite, but what follows
takes a step with zero gradients (Adam's moments decay, its step count and
weight decay advance; ``skip_step`` and the adaptive clippers there record a
norm of 0 and skip nothing: ``optax.chain(dynamic_loss_scale(),
skip_step(adamw))`` does not skip an overflow, write
``dynamic_loss_scale(skip_step(adamw))``). Only the wrapper, or ``skip_step``
around the chain, leaves the optimizer's state untouched.

Clippers must see unscaled gradients: after the loss scaling in a chain, or
inside its ``inner``. ``loss_scale(opt_state)``, and the ``init`` of
``dynamic_loss_scale(inner)`` and ``skip_step``, raise a ``ValueError`` when
an optaxclip clipper comes first (``clip_by_value`` too: its empty state
marks its place; Optax's own clippers keep no state and cannot be seen, so
put them after too) or when the loss scaling sits inside
``optax.MultiSteps`` or ``optax.apply_if_finite`` (which would roll the
back-off back: the next steps would overflow again).

The schedule (``_guards.loss_scale_schedule``) is GradScaler's, with DeepSpeed's
and Megatron-LM's hysteresis as options. Its settings live in the
transform, not in the state: a state that went through ``jit``, flattening or a
checkpoint keeps every field, and a restored run goes on with the same
schedule (``jmp`` loses ``min_loss_scale`` on a ``jit`` round-trip).
"""

import math
from typing import Any, NamedTuple, TypeGuard

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optaxclip import _core, _tree, _validation
from optaxclip._clip import scaling
from optaxclip._guards import placement
from optaxclip._guards.loss_scale_schedule import (
  MAX_SCALE,
  MIN_SCALE,
  LossScaleState,
  Schedule,
  adjust,
  raise_at_floor,
  reciprocal,
  unscale_leaf,
)
from optaxclip._stats import counters, registry
from optaxclip._types import AxisName, Scalar

PyTree = Any


class LossScaleWrapperState(NamedTuple):
  """State of ``dynamic_loss_scale(inner)``: the scale's and the optimizer's.

  Attributes:
    loss_scale: the ``LossScaleState``, read by ``optaxclip.stats`` as
      ``loss_scale/<field>``.
    inner_state: the wrapped optimizer's state.
    accumulated: with ``every_k_steps``, the unscaled sum of the window's
      micro-batches so far (float32 or wider, shaped as the params); else None.
  """
  loss_scale: LossScaleState
  inner_state: optax.OptState
  accumulated: PyTree = None


registry.register(LossScaleState, "loss_scale", clips=False,
                  hide=("micro_step", "window_overflows", "window_norm"))
placement.register_loss_scale(LossScaleState, LossScaleWrapperState)


def loss_scale(opt_state: optax.OptState) -> jax.Array:
  """The current loss scale held in an optimizer state.

  Finds the state of the one ``dynamic_loss_scale`` anywhere in
  ``opt_state`` (inside ``optax.chain``, ``skip_step``,
  ``inject_hyperparams``, ...), and checks that it is placed right.

  Args:
    opt_state: an optax optimizer state built with ``dynamic_loss_scale``.

  Returns:
    The scale, a float32 scalar: multiply the loss by it before ``jax.grad``,
    in float32 (``loss.astype(jnp.float32) * scale``, as PyTorch's
    ``scaler.scale(loss)``: a float16 scale would be Inf from 2**16 on).

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state, or several;
      when an optaxclip clipper comes before the loss scaling (it would clip
      scaled gradients), or the loss scaling sits inside ``optax.MultiSteps``
      or ``optax.apply_if_finite``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from optaxclip import clip_by_global_norm, dynamic_loss_scale, loss_scale
    >>> tx = dynamic_loss_scale(2.0**10, inner=optax.sgd(0.1))
    >>> loss_scale(tx.init({"w": jnp.ones(2)}))
    Array(1024., dtype=float32)
    >>> tx = optax.chain(clip_by_global_norm(1.0), dynamic_loss_scale(), optax.sgd(0.1))
    >>> loss_scale(tx.init({"w": jnp.ones(2)}))
    Traceback (most recent call last):
    ...
    ValueError: `loss_scale(opt_state)`: the clipper state ClipState at
    opt_state[0] comes before dynamic_loss_scale's state (opt_state[1]), so
    the clipper sees the scaled gradients (loss scale times too large) and
    clips them wrongly. Put the loss scaling first:
    optax.chain(optaxclip.dynamic_loss_scale(...), clipper, optimizer), or
    optaxclip.dynamic_loss_scale(optax.chain(clipper, optimizer))
  """
  found = placement.find_loss_scale_states(opt_state)
  if len(found) != 1:
    what = "no" if not found else f"{len(found)}"
    raise ValueError(
        f"`loss_scale(opt_state)` needs exactly one dynamic_loss_scale state "
        f"in the optimizer state, found {what}: build the optimizer with "
        f"optaxclip.dynamic_loss_scale() (once), e.g. "
        f"optaxclip.dynamic_loss_scale(optax.adamw(...))")
  placement.check_placement(opt_state, "loss_scale(opt_state)")
  return found[0].scale


def unscale(updates: PyTree, state: LossScaleState, where: _core.Where,
            may_shrink: bool = False
            ) -> tuple[PyTree, jax.Array, _core.KnownNorm, Any]:
  """The updates divided by the scale (zeros on an overflow), whether they
  were finite, their norm, for a clipper inside to take, and the function
  that unscales (to redo it inside a ``lax.cond`` from the updates).

  Judged from the norm of the scaled updates divided by the scale
  (overflow-safe: Inf or NaN when an unscaled entry is, or when the norm
  itself is beyond the float range): one read, which a ``skip_step``
  outside may have made already (``_core.sharing``), and no copy of the
  unscaled updates (measured: the norm of the unscaled ones costs 2 passes).
  A scale below 1 (``may_shrink``: ``min_scale < 1``) can push an unscaled
  entry past its own dtype's range while the float32 norm stays finite
  (a float16 entry of 6e4 divided by 2**-20): those leaves are judged by
  their largest entry as well (one more read of those leaves).
  """
  measured = _core.measure("dynamic_loss_scale", updates, 2, where)
  norm = measured.total / state.scale.astype(measured.total.dtype)
  finite = jnp.isfinite(norm)
  inverse = reciprocal(state.scale)
  if may_shrink:
    finite = finite & _unscaled_in_range(updates, inverse, norm.dtype, where)
  # Zeros rather than Inf/NaN: nothing after the loss scaling sees them.
  def unscaling(tree):
    return scaling.zero_unless(finite, _tree.map_clippable(
        lambda x: unscale_leaf(x, inverse), tree))

  unscaled = unscaling(updates)
  known = _core.KnownNorm(jnp.where(finite, norm, 0), 2, where,
                          tuple(_tree.clippable_leaves(unscaled)))
  return unscaled, finite, known, unscaling


def _unscaled_in_range(updates: PyTree, inverse: tuple[jax.Array, jax.Array],
                       norm_dtype: Any, where: _core.Where) -> jax.Array:
  """Whether every leaf narrower than the norm stays finite once unscaled:
  its largest magnitude (its inf-norm, over every device) times
  ``1/scale``, rounded to its dtype (exact: the multiply and the rounding
  are monotone)."""
  wide = jnp.finfo(norm_dtype).max
  narrow = [x for x in _tree.clippable_leaves(updates)
            if jnp.finfo(x.dtype).max < wide]
  if not narrow:
    return jnp.asarray(True)
  largest = _core.measure("dynamic_loss_scale", narrow, math.inf, where,
                          _core.PER_LEAF).units
  return jnp.all(jnp.stack([
      # complex: its parts'
      jnp.isfinite((m * inverse[0] * inverse[1]).astype(jnp.finfo(x.dtype).dtype))
      for m, x in zip(largest, narrow)]))


def _accumulator(fn: str, params: PyTree, inner_state: PyTree) -> PyTree:
  """Zeros for the window's sum: float32 or wider per floating leaf (an
  int32 placeholder for the others, which pass through)."""
  if isinstance(inner_state, optax.MultiStepsState):
    raise ValueError(f"`{fn}(every_k_steps=...)` accumulates the window itself: "
                     f"its `inner` must not be an optax.MultiSteps too (it would "
                     f"accumulate the sums again); pass the MultiSteps' optimizer")
  if params is None:
    raise ValueError(f"`{fn}(every_k_steps=...)` sums the gradients of a "
                     f"window: `init` needs the params (or their "
                     f"jax.ShapeDtypeStruct), got None")
  def zeros(p):
    if not _tree.is_clippable(p):
      return counters.zero()
    p = _tree.as_array(p)
    return jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32))

  return jax.tree.map(zeros, params)


def _count(new: LossScaleState, old: LossScaleState, finite: jax.Array
           ) -> LossScaleState:
  return new._replace(count=counters.increment(old.count),
                      overflow_count=counters.count_if(~finite,
                                                      old.overflow_count))


def _window_sum(unscaled: PyTree, accumulated: PyTree) -> tuple[PyTree, PyTree]:
  """The window's sum in the accumulator's dtype, and cast to the
  gradients' (what the optimizer gets)."""
  summed = jax.tree.map(
      lambda u, a: a + u.astype(a.dtype) if _tree.is_clippable(u) else a,
      unscaled, accumulated)
  grads = jax.tree.map(
      lambda u, s: s.astype(u.dtype) if _tree.is_clippable(u) else u,
      unscaled, summed)
  return summed, grads


def _window_finite(updates: PyTree, unscaling: Any, accumulated: PyTree,
                   grads: PyTree, bound: jax.Array, last: jax.Array,
                   where: _core.Where) -> jax.Array:
  """Whether the window's sum is finite as the optimizer gets it (``grads``:
  summed in the accumulator's dtype, then cast to the gradients'; float16:
  a sum past 65504 is Inf there), judged at the window's last micro-batch.
  No entry of the sum exceeds ``bound``, the sum of the micro-batches'
  norms: below half the narrowest dtype's largest number (rounding cannot
  double it) the sum is finite. On the CPU, only a larger bound redoes the
  sum from the update and the accumulator inside a ``lax.cond`` (one read
  of each; the sum outside stays fused into its consumers). On GPU and TPU
  a conditional runs both branches anyway (docs/design.md, "Platforms"):
  ``grads`` is judged every step, a pass XLA fuses with the sum's."""
  leaves = _tree.clippable_leaves(updates) + _tree.clippable_leaves(accumulated)
  if not leaves:
    return jnp.asarray(True)
  largest = min(float(jnp.finfo(x.dtype).max) for x in leaves)
  half = jnp.float32(min(largest, float(jnp.finfo(jnp.float32).max)) / 2)
  judged = last & ~(bound <= half)

  def check(updates, accumulated):
    _, grads = _window_sum(unscaling(updates), accumulated)
    return _core.all_finite(grads, axis_name=where.axis_names)

  return lax.platform_dependent(
      updates, accumulated,
      cpu=lambda *args: lax.cond(judged, check, lambda *_: jnp.asarray(True), *args),
      default=lambda *_: ~judged | _core.all_finite(grads, axis_name=where.axis_names))


def _advance(state: LossScaleState, finite: jax.Array, unscaled: PyTree,
             updates: PyTree, unscaling: Any, norm: jax.Array,
             accumulated: PyTree, schedule: Schedule, every_k_steps: Any,
             where: _core.Where):
  """One update: the new state, the gradients for the optimizer, the
  accumulator, whether the optimizer steps, whether a back-off was due at
  the floor. Without an accumulator each update is an optimizer step;
  with one, the ``every_k_steps``-th micro-batch of a window is, and a
  window whose sum overflows is an overflow (counted on its last
  micro-batch). ``unscaled``: the very tree the norm ``known`` was taken of
  (a clipper inside then takes the norm instead of reading it again)."""
  if accumulated is None:
    new, at_floor = adjust(state, finite, schedule)
    return _count(new, state, finite), unscaled, None, finite, at_floor
  micro = counters.increment(state.micro_step)
  last = micro >= every_k_steps
  summed, grads = _window_sum(unscaled, accumulated)
  bound = state.window_norm + norm.astype(jnp.float32)  # 0 for an overflow
  finite = finite & _window_finite(updates, unscaling, accumulated, grads,
                                   bound, last, where)
  window_finite = finite & (state.window_overflows == 0)
  # The optimizer never sees an Inf: its update is dropped anyway.
  grads = scaling.zero_unless(finite, grads)
  adjusted, at_floor = adjust(state, window_finite, schedule)
  # The scale and its schedule change at the end of a window only.
  new = jax.tree.map(lambda a, b: jnp.where(last, a, b), adjusted, state)
  restart = jnp.zeros([], jnp.int32)
  new = new._replace(
      micro_step=jnp.where(last, restart, micro),
      window_overflows=jnp.where(last, restart, counters.count_if(
          ~finite, state.window_overflows)),
      window_norm=jnp.where(last, jnp.zeros([], jnp.float32), bound))
  accumulated = jax.tree.map(lambda s: jnp.where(last, jnp.zeros_like(s), s),
                             summed)
  return (_count(new, state, finite), grads, accumulated,
          last & window_finite, last & at_floor)


def _run_inner(inner: Any, known: _core.KnownNorm, state: LossScaleWrapperState,
               params: PyTree, extra_args: dict, grads: PyTree
               ) -> tuple[PyTree, PyTree]:
  """``inner``'s update of ``grads``; a clipper inside takes the norm (with
  a window: the sum's, measured)."""
  with _core.sharing(known):
    return inner.update(grads, state.inner_state, params, **extra_args)


def _is_transform(x: Any) -> TypeGuard[optax.GradientTransformation]:
  return hasattr(x, "init") and hasattr(x, "update")


def _check_scale(fn: str, arg: str, value: Any) -> Any:
  """A number in [MIN_SCALE, MAX_SCALE]; traced, any other acts as 1 (and
  a traced ``initial_scale`` is clamped to ``MAX_SCALE`` at ``init``)."""
  value = _validation.check_positive(fn, arg, value, traced=1.0)
  if _validation.is_traced(value):
    return value
  if float(value) > MAX_SCALE:
    raise ValueError(
        f"`{fn}({arg}=...)` must be at most the largest float32, "
        f"{MAX_SCALE!r} (the scale is a float32, as GradScaler's), got "
        f"{value!r}")
  if float(value) < MIN_SCALE:
    raise ValueError(
        f"`{fn}({arg}=...)` must be at least 2**-126 (below it the scale is "
        f"subnormal and flushes to zero, and 1/scale overflows), got "
        f"{value!r}")
  return value


def _schedule(fn: str, first: Any, period: Any, factor: Any, min_scale: Any,
              hysteresis: Any, consecutive_hysteresis: Any,
              growth_delay: Any) -> Schedule:
  """The checked settings of the schedule."""
  lowest = _check_scale(fn, "min_scale", min_scale)
  if not any(map(_validation.is_traced, (first, lowest))) \
      and float(lowest) > float(first):
    raise ValueError(
        f"`{fn}(min_scale=...)` must be <= initial_scale, got min_scale="
        f"{lowest!r} > initial_scale={first!r}")
  return Schedule(
      period=_validation.check_integer(fn, "period", period, 1),
      factor=_validation.check_at_least(fn, "factor", factor, 1),
      min_scale=lowest,
      hysteresis=_validation.check_integer(fn, "hysteresis", hysteresis, 1),
      consecutive_hysteresis=_validation.check_bool(
          fn, "consecutive_hysteresis", consecutive_hysteresis),
      growth_delay=_validation.check_integer(fn, "growth_delay",
                                             growth_delay, 0))


def _windows(fn: str, every_k_steps: Any, inner: Any) -> Any:
  """``every_k_steps`` checked, or None when each update is one step."""
  if every_k_steps is None:
    return None
  k = _validation.check_integer(fn, "every_k_steps", every_k_steps, 1)
  if inner is None:
    raise ValueError(
        f"`{fn}(every_k_steps={every_k_steps!r})` needs the optimizer, which "
        f"steps once per window: dynamic_loss_scale(optimizer, "
        f"every_k_steps={every_k_steps!r})")
  # An injected (array) value may change: keep the accumulator for it.
  return None if isinstance(k, int) and k == 1 else k


def dynamic_loss_scale(
    # a number, or the optimizer (as `inner`)
    initial_scale: Scalar | optax.GradientTransformation = 2.0**15,
    *, period: Scalar = 2000, factor: Scalar = 2.0, min_scale: Scalar = 1.0,
    hysteresis: Scalar = 1, consecutive_hysteresis: bool = False,
    growth_delay: Scalar = 0, every_k_steps: Scalar | None = None,
    raise_error_at_min_scale: bool = False, axis_name: AxisName = None,
    inner: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Unscales loss-scaled gradients and adapts the loss scale (float16).

  Multiply the loss by the scale, in float32, before ``jax.grad``; this
  divides the gradients by it::

    scale = loss_scale(opt_state)
    grads = jax.grad(lambda p: loss_fn(p).astype(jnp.float32) * scale)(params)

  An overflow (NaN or Inf; the ``hysteresis``-th) divides the scale by
  ``factor``, not below ``min_scale``; ``period`` finite steps in a row
  multiply it. Wrapping ``inner`` (clippers go inside), an overflow skips
  its step. PyTorch's, DeepSpeed's and Megatron-LM's settings:
  [docs/migration/pytorch.md](../migration/pytorch.md); traced values:
  [docs/hyperparameters.md](../hyperparameters.md).

  Args:
    initial_scale: the first scale, a float32 >= 2**-126; or ``inner``.
    period: finite optimizer steps in a row before the scale grows.
    factor: what the scale is multiplied or divided by (a number >= 1).
    min_scale: the smallest scale (GradScaler has none: 2.0**-126); below 1,
      an entry unscaled past its dtype's range is an overflow too.
    hysteresis: overflows it takes to back off (an int >= 1).
    consecutive_hysteresis: refill it at every finite step, not at growth.
    growth_delay: finite steps added before the first growth after an
      overflow or at the start (an int >= 0; DeepSpeed: 1).
    every_k_steps: micro-batches per step, summed unscaled (needs ``inner``); None: one.
    raise_error_at_min_scale: raise ``NonFiniteGradientError`` on an overflow at ``min_scale``.
    axis_name: ``shard_map``/``pmap`` axes: every device agrees on overflows.
    inner: the optimizer whose steps an overflow drops, or None.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its state is a
    ``LossScaleState`` (a ``LossScaleWrapperState`` with ``inner``).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from optaxclip import dynamic_loss_scale
    >>> tx = dynamic_loss_scale(optax.sgd(1.0), every_k_steps=2)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for g in (1.0, 2.0, jnp.inf, 1.0):  # two windows; the second overflows
    ...   updates, state = tx.update({"w": jnp.full(2, g * 2.0**15)}, state, params)
    ...   print(updates["w"], state.loss_scale.scale)
    [0. 0.] 32768.0
    [-3. -3.] 32768.0
    [0. 0.] 32768.0
    [0. 0.] 16384.0

  References:
    Micikevicius et al., [Mixed Precision Training](https://arxiv.org/abs/1710.03740), 2018.
  """
  fn = "dynamic_loss_scale"
  if _is_transform(initial_scale):
    if inner is not None:
      raise TypeError(f"`{fn}(initial_scale=...)` is an optax transformation "
                      f"and `inner` is given too: pass the optimizer once")
    initial_scale, inner = 2.0**15, initial_scale
  if inner is not None and not _is_transform(inner):
    raise TypeError(f"`{fn}(inner=...)` must be an optax GradientTransformation "
                    f"or None, got {inner!r}")
  first = _check_scale(fn, "initial_scale", initial_scale)
  schedule = _schedule(fn, first, period, factor, min_scale, hysteresis,
                       consecutive_hysteresis, growth_delay)
  raise_at_min = _validation.check_bool(fn, "raise_error_at_min_scale",
                                        raise_error_at_min_scale)
  k = _windows(fn, every_k_steps, inner)
  where = _core.Where.of(fn, axis_name)
  may_shrink = _validation.is_traced(schedule.min_scale) \
      or float(schedule.min_scale) < 1
  wrapped = None if inner is None else optax.with_extra_args_support(inner)

  def init_fn(params):
    state = LossScaleState.fresh(first, hysteresis=schedule.hysteresis,
                                 growth_delay=schedule.growth_delay)
    if wrapped is None:
      return state
    inner_state = wrapped.init(params)
    placement.check_placement(inner_state, f"{fn}(inner=...).init",
                              "inner_state")
    accumulated = None if k is None else _accumulator(fn, params, inner_state)
    return LossScaleWrapperState(state, inner_state, accumulated)

  def update_fn(updates, state, params=None, **extra_args):
    _validation.check_update(fn, updates, state, LossScaleState if wrapped is None
                             else LossScaleWrapperState)
    old = state if wrapped is None else state.loss_scale
    unscaled, finite, known, unscaling = unscale(updates, old, where, may_shrink)
    run = (wrapped, known, state, params, extra_args)
    proposed = None
    if wrapped is not None and isinstance(state.inner_state, optax.MultiStepsState):
      # Its own accumulator may overflow from finite micro-batches: an overflow too.
      proposed = _run_inner(*run, unscaled)
      finite = finite & placement.multisteps_finite(*proposed, where.axis_names)
    new, grads, accumulated, step, at_floor = _advance(
        old, finite, unscaled, updates, unscaling, known.total,
        None if wrapped is None else state.accumulated, schedule, k, where)
    if raise_at_min:
      raise_at_floor(fn, at_floor, old.scale)
    if wrapped is None:
      return grads, new
    new_updates, new_inner = proposed or _run_inner(*run, grads)
    # Selected on the device (no host sync): an overflow drops the step.
    new_updates = scaling.zero_unless(step, new_updates)
    new_inner = jax.tree.map(lambda new, old: jnp.where(step, new, old),
                             new_inner, state.inner_state)
    return new_updates, LossScaleWrapperState(new, new_inner, accumulated)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
