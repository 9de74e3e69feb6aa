"""Dynamic loss scaling for float16 training, and ``loss_scale(opt_state)``.

Small float16 gradients flush to zero in the backward pass. The loss is
multiplied by a large scale ``S`` before ``jax.grad`` (every gradient is then
``S`` times larger and representable) and the gradients are divided by ``S``
again here. A too large ``S`` overflows to Inf: that step is an overflow, its
update must not reach the optimizer, and ``S`` is divided by ``factor`` (not
below ``min_scale``). After ``period`` finite steps in a row ``S`` is
multiplied by ``factor``, to find the largest scale that does not overflow.
The schedule is that of MindSpore's ``DynamicLossScaleUpdateCell`` and of
``jmp.DynamicLossScale``.

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
- With gradient accumulation, the loss scaling goes outside:
  ``dynamic_loss_scale(optax.MultiSteps(...))``. Inside, the accumulator would
  sum scaled gradients and one overflow would poison it for good.

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

The settings (``period``, ``factor``, ``min_scale``) live in the transform,
not in the state: a state that went through ``jit``, flattening or a
checkpoint keeps every field, and a restored run goes on with the same
schedule (``jmp`` loses ``min_loss_scale`` on a ``jit`` round-trip).
"""

from typing import Any, NamedTuple, TypeGuard

import jax
import jax.numpy as jnp
import optax

from optaxclip import _core, _counters, _placement, _scaling, _stats, _validation
from optaxclip._types import AxisName, Scalar

PyTree = Any

# The largest loss scale: the gradients are unscaled by 1/scale, and above
# 2**126 that reciprocal is subnormal, which XLA:CPU and GPUs flush to zero
# (every unscaled gradient would be 0, and no overflow would ever be seen).
MAX_SCALE = 2.0**126


class LossScaleState(NamedTuple):
  """State of ``dynamic_loss_scale``; every field is a scalar.

  Attributes:
    scale: float32 ``[]``: the loss scale for the next step (multiply the
      loss by it before ``jax.grad``).
    good_steps: int32 ``[]``: finite steps since the scale last changed.
    count: int32 ``[]``: steps seen.
    overflow_count: int32 ``[]``: steps whose gradients overflowed.
  """
  scale: jax.Array
  good_steps: jax.Array
  count: jax.Array
  overflow_count: jax.Array

  @classmethod
  def fresh(cls, scale: jax.typing.ArrayLike) -> "LossScaleState":
    """The state before the first step, with the loss scale ``scale``."""
    # A copy: the state must not alias the user's (or an injected) array,
    # or donating the state would delete it, or donate one buffer twice.
    # At most MAX_SCALE (a traced initial_scale is clamped to it).
    return cls(scale=jnp.minimum(jnp.array(scale, jnp.float32, copy=True),
                                 MAX_SCALE),
               good_steps=_counters.zero(), count=_counters.zero(),
               overflow_count=_counters.zero())


class LossScaleWrapperState(NamedTuple):
  """State of ``dynamic_loss_scale(inner)``: the scale's and the optimizer's.

  Attributes:
    loss_scale: the ``LossScaleState``, read by ``optaxclip.stats`` as
      ``loss_scale/<field>``.
    inner_state: the wrapped optimizer's state.
  """
  loss_scale: LossScaleState
  inner_state: optax.OptState


_stats.register(LossScaleState, "loss_scale", clips=False)
_placement.register_loss_scale(LossScaleState, LossScaleWrapperState)


def loss_scale(opt_state: optax.OptState) -> jax.Array:
  """The current loss scale held in an optimizer state.

  Finds the state of the one ``dynamic_loss_scale`` anywhere in
  ``opt_state`` (inside ``optax.chain``, ``skip_step``,
  ``inject_hyperparams``, ...), and checks that it is placed right.

  Args:
    opt_state: an optax optimizer state built with ``dynamic_loss_scale``.

  Returns:
    The scale, a float32 scalar: multiply the loss by it before ``jax.grad``
    (cast to the loss's dtype, as ``jmp`` does).

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
  found = _placement.find_loss_scale_states(opt_state)
  if len(found) != 1:
    what = "no" if not found else f"{len(found)}"
    raise ValueError(
        f"`loss_scale(opt_state)` needs exactly one dynamic_loss_scale state "
        f"in the optimizer state, found {what}: build the optimizer with "
        f"optaxclip.dynamic_loss_scale() (once), e.g. "
        f"optaxclip.dynamic_loss_scale(optax.adamw(...))")
  _placement.check_placement(opt_state, "loss_scale(opt_state)")
  return found[0].scale


def unscale(updates: PyTree, state: LossScaleState, *,
            axis_name: AxisName = None) -> tuple[PyTree, jax.Array]:
  """The updates divided by the scale (zeros on an overflow), and whether
  they were finite."""
  # A multiply by 1/scale: exact for powers of two, and each leaf keeps its
  # dtype (half precision is unscaled in float32 and rounded once).
  unscaled = _scaling.scale_leaves(updates, 1 / state.scale)
  # Judged after unscaling: that is what the optimizer would see.
  finite = _core.all_finite(unscaled, axis_name=axis_name)
  # Zeros rather than Inf/NaN: nothing after the loss scaling sees them.
  return _scaling.zero_unless(finite, unscaled), finite


def adjust(state: LossScaleState, finite: jax.Array, *, period: Scalar,
           factor: Scalar, min_scale: Scalar) -> LossScaleState:
  """The state after one step: back off on an overflow, grow after
  ``period`` finite steps in a row (never above ``MAX_SCALE``)."""
  scale = state.scale
  factor = jnp.asarray(factor, jnp.float32)
  grown = scale * factor
  grow = state.good_steps + 1 >= period
  increment = _counters.increment
  new_scale = jnp.where(
      finite,
      jnp.where(grow & (grown <= MAX_SCALE), grown, scale),
      jnp.maximum(jnp.asarray(min_scale, jnp.float32), scale / factor))
  return LossScaleState(
      scale=new_scale.astype(jnp.float32),
      good_steps=jnp.where(finite & ~grow, increment(state.good_steps),
                           jnp.zeros([], jnp.int32)),
      count=increment(state.count),
      overflow_count=jnp.where(finite, state.overflow_count,
                               increment(state.overflow_count)))


def _is_transform(x: Any) -> TypeGuard[optax.GradientTransformation]:
  return hasattr(x, "init") and hasattr(x, "update")


def dynamic_loss_scale(
    # a number, or the optimizer (as `inner`)
    initial_scale: Scalar | optax.GradientTransformation = 2.0**15,
    *, period: Scalar = 2000, factor: Scalar = 2.0, min_scale: Scalar = 1.0,
    axis_name: AxisName = None, inner: optax.GradientTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Unscales loss-scaled gradients and adapts the loss scale (float16).

  Multiply the loss by ``loss_scale(opt_state)`` before ``jax.grad``; this
  transform divides the gradients by that scale. When the unscaled gradients
  hold NaN or Inf (an overflow), the scale is divided by ``factor`` (not
  below ``min_scale``); after ``period`` finite steps in a row it is
  multiplied by ``factor`` (unless that would overflow float32).

  With ``inner`` (or an optimizer as the first argument), it wraps ``inner``:
  the unscaled gradients go to ``inner`` (extra arguments too), and on an
  overflow the updates are zeros and ``inner``'s state stays bit for bit as
  it was, while the scale's back-off sticks. Clippers go inside::

    tx = dynamic_loss_scale(optax.chain(clip_by_global_norm(1.0), optax.adamw(1e-3)))
    scale = loss_scale(opt_state)
    grads = jax.grad(lambda p: loss_fn(p) * scale.astype(jnp.float16))(params)
    updates, opt_state = tx.update(grads, opt_state, params)

  Without ``inner`` it is a chain element, first in the chain: an overflow
  passes zeros on, so what follows stays finite but takes a zero-gradient
  step (see the module docstring).

  Injected with ``optax.inject_hyperparams``, the hyperparameters are
  checked when ``init`` runs eagerly. Traced (a jitted ``init``, or an update
  after a change of the state's hyperparameters), an ``initial_scale`` or
  ``min_scale`` that is not a finite number > 0 acts as 1, and ``factor`` and
  ``period`` are clamped to at least 1 (NaN as 1).

  Args:
    initial_scale: the first loss scale (a number > 0, at most 2**126, the
      largest scale the growth reaches too). Powers of two keep the
      unscaling exact. An optax transformation here is taken as
      ``inner`` (the scale is then 2**15).
    period: finite steps in a row after which the scale grows (an int >= 1).
    factor: what the scale is multiplied (grow) or divided (overflow) by (a
      number >= 1; 1 keeps the scale fixed, overflow steps still count).
    min_scale: the smallest scale a back-off may reach (a number > 0, at
      most ``initial_scale``).
    axis_name: under ``shard_map``/``pmap``, the axis name(s) the gradients
      are split over: every device then agrees on the overflow.
    inner: the optimizer whose steps an overflow drops, or None.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    ``LossScaleState`` (a ``LossScaleWrapperState`` with ``inner``).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from optaxclip import dynamic_loss_scale
    >>> tx = dynamic_loss_scale(2.0**15, period=2)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> grads, state = tx.update({"w": jnp.array([2.0**15, 2.0**16])}, state)
    >>> grads["w"], state.scale
    (Array([1., 2.], dtype=float32), Array(32768., dtype=float32))
    >>> grads, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state)
    >>> grads["w"], state.scale, state.overflow_count  # overflow: backed off
    (Array([0., 0.], dtype=float32), Array(16384., dtype=float32), Array(1, dtype=int32))
    >>> tx = dynamic_loss_scale(optax.adam(0.1))  # wraps the optimizer
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    >>> updates["w"], state.loss_scale.scale, state.inner_state[0].count
    (Array([0., 0.], dtype=float32), Array(16384., dtype=float32), Array(0, dtype=int32))

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
  first: Any = _validation.check_positive(fn, "initial_scale", initial_scale,
                                          traced=1.0)
  period = _validation.check_integer(fn, "period", period, 1)
  factor = _validation.check_at_least(fn, "factor", factor, 1)
  lowest: Any = _validation.check_positive(fn, "min_scale", min_scale,
                                           traced=1.0)
  for arg, value in (("initial_scale", first), ("min_scale", lowest)):
    if not _validation.is_traced(value) and float(value) > MAX_SCALE:
      raise ValueError(
          f"`{fn}({arg}=...)` must be at most 2**126 (above it 1/scale is "
          f"subnormal and flushes to zero, zeroing every gradient), got "
          f"{value!r}")
  if not any(map(_validation.is_traced, (first, lowest))) \
      and float(lowest) > float(first):
    raise ValueError(
        f"`{fn}(min_scale=...)` must be <= initial_scale, got min_scale="
        f"{lowest!r} > initial_scale={first!r}")
  _validation.check_axis_name(fn, axis_name)
  schedule = {"period": period, "factor": factor, "min_scale": lowest}
  wrapped = None if inner is None else optax.with_extra_args_support(inner)

  def init_fn(params):
    state = LossScaleState.fresh(first)
    if wrapped is None:
      return state
    inner_state = wrapped.init(params)
    _placement.check_placement(inner_state, f"{fn}(inner=...).init",
                               "inner_state")
    return LossScaleWrapperState(state, inner_state)

  def update_fn(updates, state, params=None, **extra_args):
    _validation.check_update(fn, updates, state, LossScaleState if wrapped is None
                             else LossScaleWrapperState)
    scale_state = state if wrapped is None else state.loss_scale
    unscaled, finite = unscale(updates, scale_state, axis_name=axis_name)
    scale_state = adjust(scale_state, finite, **schedule)
    if wrapped is None:
      return unscaled, scale_state
    new_updates, new_inner = wrapped.update(unscaled, state.inner_state,
                                            params, **extra_args)
    # Selected on the device (no host sync): an overflow drops the step.
    new_updates = _scaling.zero_unless(finite, new_updates)
    new_inner = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                             new_inner, state.inner_state)
    return new_updates, LossScaleWrapperState(scale_state, new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
