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

Skipping the optimizer on an overflow. ``dynamic_loss_scale`` is a chain
element: on an overflow it records the back-off and passes the non-finite
gradients on, so that the guard that follows sees them. It cannot stop the
transforms after it by itself (no chain element can). The guard is
``skip_step``, used either way round:

- ``skip_step(optax.chain(dynamic_loss_scale(), optax.adamw(...)))``: the
  whole chain skips. ``skip_step`` knows loss-scale states: it rolls back
  every inner state except them (the back-off must stick, or every later
  step would overflow again), and it judges the norm of the unscaled
  gradients (its input is still scaled).
- ``optax.chain(dynamic_loss_scale(), skip_step(optax.adamw(...)))``.

``optax.apply_if_finite`` works after ``dynamic_loss_scale`` but not around
it: it would roll the back-off back, and every step would overflow.

The settings (``period``, ``factor``, ``min_scale``) live in the transform,
not in the state: a state that went through ``jit``, flattening or a
checkpoint keeps every field, and a restored run goes on with the same
schedule (``jmp`` loses ``min_loss_scale`` on a ``jit`` round-trip).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxclip import _norm_clipping, _norms, _stats, _validation

PyTree = Any


class LossScaleState(NamedTuple):
  """State of ``dynamic_loss_scale``; every field is a scalar."""
  scale: jax.Array  # float32: the loss scale for the next step (multiply
  #                   the loss by it before jax.grad)
  good_steps: jax.Array  # int32: finite steps since the scale last changed
  count: jax.Array  # int32: steps seen
  overflow_count: jax.Array  # int32: steps whose gradients overflowed


_stats.register(LossScaleState, "loss_scale")


def is_loss_scale_state(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def find_loss_scale_states(opt_state: Any) -> list[LossScaleState]:
  """Every ``LossScaleState`` in ``opt_state``, in tree order.

  The search depends only on the state's structure, so it costs nothing
  under ``jit``.
  """
  nodes = jax.tree.leaves(opt_state, is_leaf=is_loss_scale_state)
  return [node for node in nodes if is_loss_scale_state(node)]


def loss_scale(opt_state: Any) -> jax.Array:
  """The current loss scale held in an optimizer state.

  Finds the state of the one ``dynamic_loss_scale`` anywhere in
  ``opt_state`` (inside ``optax.chain``, ``skip_step``, ``MultiSteps``,
  ``inject_hyperparams``, ...).

  Args:
    opt_state: an optax optimizer state built with ``dynamic_loss_scale``.

  Returns:
    The scale, a float32 scalar: multiply the loss by it before ``jax.grad``
    (cast to the loss's dtype, as ``jmp`` does).

  Raises:
    ValueError: when ``opt_state`` holds no loss-scale state, or several.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from optaxclip import dynamic_loss_scale, loss_scale
    >>> tx = optax.chain(dynamic_loss_scale(2.0**10), optax.sgd(0.1))
    >>> loss_scale(tx.init({"w": jnp.ones(2)}))
    Array(1024., dtype=float32)
  """
  found = find_loss_scale_states(opt_state)
  if len(found) != 1:
    what = "no" if not found else f"{len(found)}"
    raise ValueError(
        f"`loss_scale(opt_state)` needs exactly one dynamic_loss_scale state "
        f"in the optimizer state, found {what}: build the optimizer with "
        f"optaxclip.dynamic_loss_scale() (once), e.g. optax.chain("
        f"optaxclip.dynamic_loss_scale(), optax.adamw(...))")
  return found[0].scale


def dynamic_loss_scale(initial_scale: Any = 2.0**15, *, period: Any = 2000,
                       factor: Any = 2.0, min_scale: Any = 1.0,
                       axis_name: Any = None) -> optax.GradientTransformation:
  """Unscales loss-scaled gradients and adapts the loss scale (float16).

  Multiply the loss by ``loss_scale(opt_state)`` before ``jax.grad``; this
  transform, at the head of the chain, divides the gradients by that scale.
  When the unscaled gradients hold NaN or Inf (an overflow), the scale is
  divided by ``factor`` (not below ``min_scale``) and the non-finite
  gradients are passed on, so that a ``skip_step`` guard skips the
  optimizer's step. After ``period`` finite steps in a row the scale is
  multiplied by ``factor`` (unless that would overflow float32). Typical
  use, where an overflow skips the whole chain (see the module docstring)::

    tx = skip_step(optax.chain(dynamic_loss_scale(), optax.adamw(1e-3)))
    scale = loss_scale(opt_state)
    grads = jax.grad(lambda p: loss_fn(p) * scale.astype(jnp.float16))(params)
    updates, opt_state = tx.update(grads, opt_state, params)

  Injected with ``optax.inject_hyperparams``, the hyperparameters are
  checked when ``init`` runs eagerly. Traced (a jitted ``init``, or an update
  after a change of the state's hyperparameters), an ``initial_scale`` or
  ``min_scale`` that is not a finite number > 0 acts as 1, and ``factor`` and
  ``period`` are clamped to at least 1 (NaN as 1).

  Args:
    initial_scale: the first loss scale (a number > 0). Powers of two keep
      the unscaling exact.
    period: finite steps in a row after which the scale grows (an int >= 1).
    factor: what the scale is multiplied (grow) or divided (overflow) by (a
      number >= 1; 1 keeps the scale fixed, overflow steps still count).
    min_scale: the smallest scale a back-off may reach (a number > 0, at
      most ``initial_scale``).
    axis_name: under ``shard_map``/``pmap``, the axis name(s) the gradients
      are split over: every device then agrees on the overflow.

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``LossScaleState``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip import dynamic_loss_scale
    >>> tx = dynamic_loss_scale(2.0**15, period=2)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> grads, state = tx.update({"w": jnp.array([2.0**15, 2.0**16])}, state)
    >>> grads["w"], state.scale
    (Array([1., 2.], dtype=float32), Array(32768., dtype=float32))
    >>> _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state)
    >>> state.scale, state.overflow_count  # overflow: backed off
    (Array(16384., dtype=float32), Array(1, dtype=int32))

  References:
    Micikevicius et al., [Mixed Precision Training](https://arxiv.org/abs/1710.03740), 2018.
  """
  fn = "dynamic_loss_scale"
  initial_scale = _validation.check_positive(fn, "initial_scale",
                                             initial_scale, traced=1.0)
  period = _validation.check_integer(fn, "period", period, 1)
  factor = _validation.check_at_least(fn, "factor", factor, 1)
  min_scale = _validation.check_positive(fn, "min_scale", min_scale,
                                         traced=1.0)
  if not any(map(_validation.is_traced, (initial_scale, min_scale))) \
      and float(min_scale) > float(initial_scale):
    raise ValueError(
        f"`{fn}(min_scale=...)` must be <= initial_scale, got min_scale="
        f"{min_scale!r} > initial_scale={initial_scale!r}")
  _validation.check_axis_name(fn, axis_name)

  def init_fn(params):
    del params
    return LossScaleState(scale=jnp.asarray(initial_scale, jnp.float32),
                          **_stats.zeros(jnp.int32, "good_steps", "count",
                                         "overflow_count"))

  def update_fn(updates, state, params=None):
    del params
    _validation.check_update(fn, updates, state, LossScaleState)
    scale = state.scale
    # A multiply by 1/scale: exact for powers of two, and each leaf keeps its
    # dtype (half precision is unscaled in float32 and rounded once).
    unscaled = _norm_clipping.scale_leaves(updates, 1 / scale)
    # Judged after unscaling: that is what the optimizer would see.
    finite = _norms.all_finite(unscaled, axis_name=axis_name)
    factor_ = jnp.asarray(factor, jnp.float32)
    grown = scale * factor_
    grow = state.good_steps + 1 >= period
    increment = _stats.increment
    new_scale = jnp.where(
        finite,
        jnp.where(grow & jnp.isfinite(grown), grown, scale),
        jnp.maximum(jnp.asarray(min_scale, jnp.float32), scale / factor_))
    new_state = LossScaleState(
        scale=new_scale.astype(jnp.float32),
        good_steps=jnp.where(finite & ~grow, increment(state.good_steps),
                             jnp.zeros([], jnp.int32)),
        count=increment(state.count),
        overflow_count=jnp.where(finite, state.overflow_count,
                                 increment(state.overflow_count)))
    return unscaled, new_state

  return optax.GradientTransformation(init_fn, update_fn)
