"""``skip_step``: skipping whole optimizer steps on NaN/Inf, norm and loss spikes.

The wrapper: it measures the gradients' norm, asks ``_guards.skip_stats.step``
whether to skip, always runs the inner update and selects with
``jnp.where`` (no host sync, no callback, no Python branch on values), so
that a skipped inner state is bit-identical to the one before. The
statistics, their modes and their bounds: ``_stats.spikes``,
``_guards.skip_stats`` and docs/guards.md.
"""

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxclip import _core, _validation
from optaxclip._clip import masking, scaling
from optaxclip._guards import placement
from optaxclip._guards.skip_stats import MAX_CONSECUTIVE_SKIPS, SkipStats, step
from optaxclip._stats import counters, leaf_stats, running
from optaxclip._types import AxisName, Ord, PyTree, Scalar

__all__ = ["SkipState", "SkipStats", "skip_step", "step"]


class SkipState(NamedTuple):
  """State of ``skip_step``: its statistics and the wrapped optimizer's.

  Attributes:
    stats: the ``SkipStats``, read by ``optaxclip.stats`` as
      ``skip/<field>``.
    inner_state: the inner optimizer's state.
  """
  stats: SkipStats
  inner_state: optax.OptState


def _keep_unless_loss_scale(skip: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """``old`` where ``skip``, leaf by leaf; loss-scale states always advance."""
  def select(n, o):
    if placement.is_loss_scale_state(n):
      return n  # an overflow's back-off must stick
    return jnp.where(skip, o, n)
  return jax.tree.map(select, new, old,
                      is_leaf=placement.is_loss_scale_state)


def _check_loss_zscore(fn: str, value: Any) -> Any:
  """A number > 0 or inf. Traced, one that is not (NaN too) acts as inf:
  no z-score test, where 0 would skip every loss above the mean."""
  number = _validation.scalar(fn, "loss_zscore", value)
  if _validation.is_traced(number):
    number = number.astype(jnp.promote_types(number.dtype, jnp.float32))
    return jnp.where(number > 0, number, jnp.inf)
  if math.isnan(number) or number <= 0:
    raise ValueError(f"`{fn}(loss_zscore=...)` must be a number > 0 or inf, "
                     f"got {value!r}; large runs use about 6")
  return value


def _checked_loss(fn: str, loss: Any, dtype: jnp.dtype) -> jax.Array:
  """``loss`` as a scalar of ``dtype``, or a TypeError saying what it was."""
  where = f"`{fn}`: `update(loss=...)`"
  if isinstance(loss, (bool, np.bool_)) or not (
      isinstance(loss, numbers.Real) or hasattr(loss, "dtype")):
    raise TypeError(f"{where} must be a real scalar (the step's loss), got "
                    f"{loss!r:.80} of type {type(loss).__name__}")
  shape = tuple(getattr(loss, "shape", ()))
  if shape != ():
    raise TypeError(f"{where} must be a scalar (the step's loss), got an "
                    f"array of shape {shape}; pass one number, "
                    f"e.g. loss=jnp.mean(per_example_losses)")
  kind = jnp.result_type(loss)
  if not (jnp.issubdtype(kind, jnp.floating) or jnp.issubdtype(kind, jnp.integer)):
    raise TypeError(f"{where} must be a real scalar (the step's loss), got "
                    f"an array of dtype {kind}")
  return jnp.asarray(loss).astype(dtype)


def _check_inner(fn: str, inner: Any) -> optax.GradientTransformationExtraArgs:
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    hint = " (a factory: call it, e.g. optax.adam(1e-3))" if callable(inner) else ""
    raise TypeError(f"`{fn}(inner=...)` must be an optax GradientTransformation, "
                    f"got {inner!r:.80}{hint}")
  return optax.with_extra_args_support(inner)


def _settings(fn: str, *, nonfinite: Any, max_norm: Any, zscore: Any,
              ema_decay: Any, warmup_steps: Any, loss_zscore: Any,
              update_zscore: Any, max_consecutive_skips: Any,
              two_sided: Any) -> dict[str, Any]:
  """The checked settings that ``step`` takes."""
  _validation.check_bool(fn, "nonfinite", nonfinite)
  _validation.check_bool(fn, "two_sided", two_sided)
  thresholds = {"max_norm": max_norm, "zscore": zscore,
                "update_zscore": update_zscore}
  for arg, value in thresholds.items():
    if value is not None:
      thresholds[arg] = _validation.check_nonnegative(fn, arg, value,
                                                      allow_inf=True)
  if loss_zscore is not None:
    loss_zscore = _check_loss_zscore(fn, loss_zscore)
  if max_consecutive_skips is not None:
    max_consecutive_skips = _validation.check_integer(
        fn, "max_consecutive_skips", max_consecutive_skips, 1)
  if warmup_steps is not None:
    warmup_steps = _validation.check_integer(fn, "warmup_steps", warmup_steps, 0)
  return {"nonfinite": nonfinite, **thresholds, "loss_zscore": loss_zscore,
          "ema_decay": _validation.check_unit_interval(
              fn, "ema_decay", ema_decay, include_one=False),
          "warmup_steps": warmup_steps,
          "max_consecutive_skips": max_consecutive_skips,
          "two_sided": two_sided}


def _window(fn: str, window: Any, warmup_steps: Any) -> int | None:
  """The window's length (None: traced, read at ``init``), checked
  against ``warmup_steps``: the window holds at most that many values."""
  size = _validation.check_buffer_size(fn, "window", window)
  if (size is not None and warmup_steps is not None
      and not _validation.is_traced(warmup_steps)
      and int(warmup_steps) > size):
    raise ValueError(
        f"`{fn}(warmup_steps={int(warmup_steps)})` must be at most "
        f"`window` ({size}): the window holds at most {size} values; leave "
        f"warmup_steps out for OLMo-core's max(2, window // 2) - 1")
  return size


def _check_update_norm(fn: str, update_norm: bool | None,
                       update_zscore: Scalar | None) -> bool:
  """Whether the update's norm is measured: always with ``update_zscore``."""
  if update_norm is None:
    return update_zscore is not None
  _validation.check_bool(fn, "update_norm", update_norm)
  if update_zscore is not None and not update_norm:
    raise ValueError(f"`{fn}(update_zscore={update_zscore!r})` judges the "
                     f"update's norm: leave update_norm=True (or None)")
  return update_norm


def _run_inner(inner, judge, measured: _core.Measured, updates: PyTree,
               inner_state: PyTree, params: PyTree, extra_args: dict,
               judged: Callable[[PyTree], PyTree], *,
               update_where: _core.Where | None, loss_scaled: bool, dtype):
  """``(skip, stats, inner's updates, inner's state)``: the decision
  (``judge``, ``_guards.skip_stats.step`` with the step's values) and inner's
  update, whose clipper takes the measured norm instead of reading again
  (``_core.sharing``); ``judged``: a tree's leaves that ``mask`` keeps."""
  def run(feed, known):
    with _core.sharing(known):
      return inner.update(feed, inner_state, params, **extra_args)

  if update_where is not None:  # the update's norm judged too: inner first
    new_updates, new_inner = run(updates, measured.known())
    proposed = _core.measure("skip_step", judged(new_updates), 2,
                             update_where).total
    skip, stats = judge(update_norm=running.to_statistics(
        proposed, dtype))
    return skip, stats, new_updates, new_inner
  skip, stats = judge()
  # Zeros where the step is skipped: its result is dropped anyway, and XLA
  # fuses the select into inner's pass (measured: the rollback then costs
  # one read instead of three). A loss scale inside must see the overflow.
  feed = updates if loss_scaled else scaling.zero_unless(~skip, updates)
  return (skip, stats, *run(feed, measured.known(judged(feed))))


def _judge_multisteps(skip: jax.Array, stats: SkipStats, updates: PyTree,
                      inner_state: PyTree, where: _core.Where
                      ) -> tuple[jax.Array, SkipStats]:
  """Around ``optax.MultiSteps``, a micro-batch that overflows its own
  accumulator (or its optimizer's step) is skipped too, counted as a
  non-finite step (``placement.multisteps_finite``); else as they were."""
  if not isinstance(inner_state, optax.MultiStepsState):
    return skip, stats
  overflow = ~skip & ~placement.multisteps_finite(updates, inner_state,
                                                  where.axis_names)
  return skip | overflow, stats._replace(
      skipped_count=counters.count_if(overflow, stats.skipped_count),
      nonfinite_count=counters.count_if(overflow, stats.nonfinite_count))


def _init(fn: str, inner: optax.GradientTransformation, params: PyTree, *,
          leaf_norms: bool, units: _core.Kept, window: int | None,
          update: bool, mask: masking.Mask) -> SkipState:
  """The state before the first step (``skip_step``'s ``init``)."""
  inner_state = inner.init(params)
  placement.check_placement(inner_state, f"{fn}(inner=...).init",
                             "inner_state")
  dtype = running.statistics_dtype(params)
  kept = (None, None)
  if leaf_norms:
    judged = masking.kept_part(fn, mask, params)(params)
    kept = leaf_stats.zeros(fn, judged, units, dtype)
  return SkipState(stats=SkipStats.fresh(dtype, *kept, window=window,
                                         update=update),
                   inner_state=inner_state)


def _measuring(fn: str, ord, axis_name, specs, leaf_norms, layer_axis,
               expert_axis, mask):
  """``(p, where, units, mask)``: what the judged norm measures, checked."""
  _validation.check_bool(fn, "leaf_norms", leaf_norms)
  return (_validation.check_ord(fn, ord), _core.Where.of(fn, axis_name, specs),
          _core.experts(*_validation.check_stack_axes(fn, expert_axis, layer_axis)),
          _validation.check_mask(fn, mask))


def skip_step(inner: optax.GradientTransformation, *, nonfinite: bool = True,
              max_norm: Scalar | None = None, zscore: Scalar | None = None,
              ema_decay: Scalar = 0.99, warmup_steps: Scalar | None = None,
              ord: Ord = 2, axis_name: AxisName = None, specs: PyTree = None,
              loss_zscore: Scalar | None = None, leaf_norms: bool = False,
              layer_axis: PyTree = None,
              max_consecutive_skips: Scalar | None = MAX_CONSECUTIVE_SKIPS,
              window: Scalar | None = None, two_sided: bool = False,
              update_zscore: Scalar | None = None, update_norm: bool | None = None,
              expert_axis: PyTree = None, mask: masking.Mask = None
              ) -> optax.GradientTransformationExtraArgs:
  """Skips whole optimizer steps on non-finite gradients, norm and loss spikes.

  Wraps ``inner``. A step is skipped (zero updates, the inner state left
  bit for bit) when the gradients hold NaN/Inf, their global norm exceeds
  ``max_norm``, or a guarded value (the norm, the ``loss`` given to
  ``update``, the update's norm) is NaN/Inf or above ``mean + threshold *
  std`` of its past: bias-corrected EMAs, or the last ``window`` values
  (OLMo-core's and MaxText's rule). Rules, bounds, the anchors' settings,
  costs: [docs/guards.md](../guards.md).

  Args:
    inner: the optimizer whose steps may be skipped.
    nonfinite: skip steps whose gradients hold NaN or Inf.
    max_norm: skip steps whose global norm exceeds it (>= 0), or None.
    zscore: the norm's z-score threshold (>= 0), or None.
    ema_decay: the EMAs' weight of the past, in [0, 1).
    warmup_steps: values before the z-tests; None: 100, or ``max(2, window // 2) - 1``.
    ord: the norm order: any number ``p > 0`` or ``inf``.
    axis_name: ``shard_map``/``pmap`` axes; every device takes the same decision.
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix).
    loss_zscore: the loss's threshold (> 0), or None (the loss only logged).
    leaf_norms: keep every leaf's norm in the statistics.
    layer_axis: with ``leaf_norms``, the axis that stacks layers.
    max_consecutive_skips: finite steps skipped in a row at most (>= 1); None: no bound.
    window: keep the last ``window`` values (an int >= 1), or None (EMAs).
    two_sided: test ``|value - mean|``: drops are spikes too.
    update_zscore: the update norm's threshold (>= 0), or None.
    update_norm: measure the update's norm every step; None: with ``update_zscore``.
    expert_axis: with ``leaf_norms``, the axis that stacks experts.
    mask: leaves in the judged norm (as ``optax.masked``'s mask); all reach ``inner``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    ``SkipState``; its statistics show in ``optaxclip.stats`` as ``skip/...``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from optaxclip import skip_step
    >>> tx = skip_step(optax.adam(0.1), max_norm=10.0, loss_zscore=6.0, warmup_steps=4)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for g, loss in [(0.5, 2.5), (0.4, 2.4), (50.0, 2.6), (0.5, 2.5), (0.4, 2.6), (0.5, 9.0)]:
    ...   updates, state = tx.update({"w": jnp.array([g, 0.0])}, state, params, loss=loss)
    >>> updates["w"], state.stats.skipped_by_loss, state.stats.skipped_count
    (Array([0., 0.], dtype=float32), Array(True, dtype=bool), Array(2, dtype=int32))

  References:
    Chowdhery et al., [PaLM](https://arxiv.org/abs/2204.02311), 2022;
    OLMo Team, [2 OLMo 2 Furious](https://arxiv.org/abs/2501.00656), 2025.
  """
  fn = "skip_step"
  inner = _check_inner(fn, inner)
  settings = _settings(fn, nonfinite=nonfinite, max_norm=max_norm,
                       zscore=zscore, ema_decay=ema_decay,
                       warmup_steps=warmup_steps, loss_zscore=loss_zscore,
                       update_zscore=update_zscore,
                       max_consecutive_skips=max_consecutive_skips,
                       two_sided=two_sided)
  size = None if window is None else _window(fn, window, warmup_steps)
  update_norm = _check_update_norm(fn, update_norm, update_zscore)
  p, where, layers, mask = _measuring(fn, ord, axis_name, specs, leaf_norms,
                                      layer_axis, expert_axis, mask)

  def init_fn(params):
    length = (None if window is None else
              _validation.require_buffer_size(fn, "window", size))
    return _init(fn, inner, params, leaf_norms=leaf_norms, units=layers,
                 window=length, update=update_norm, mask=mask)

  def update_fn(updates, state, params=None, *, loss=None, grad_norm=None,
                **extra_args):
    _validation.check_update(fn, updates, state, SkipState)
    # NaN or Inf in any leaf and only then: the norm is overflow-safe, so
    # its finiteness is the gradients' (one pass for both questions).
    judged = masking.kept_part(fn, mask, updates)  # of any tree like the updates
    measured = _core.measure(fn, judged(updates), p, where,
                             layers if leaf_norms else _core.TOTAL,
                             given=None if leaf_norms else grad_norm)
    dtype = state.stats.norm.dtype  # the statistics' (see init), every step
    loss_scales = placement.find_loss_scale_states(state.inner_state)
    scale = loss_scales[0].scale if loss_scales else None

    def unscale(n):  # the input is scaled: judge the unscaled
      return running.to_statistics(n if scale is None else n / scale, dtype)

    if loss is not None:
      extra_args = {**extra_args, "loss": loss}  # inner's too, as given
    judge = functools.partial(
        step, state.stats, unscale(measured.total), **settings,
        loss=None if loss is None else _checked_loss(fn, loss, dtype))
    skip, new_stats, new_updates, new_inner = _run_inner(
        inner, judge, measured, updates, state.inner_state, params,
        extra_args, judged, update_where=where if update_norm else None,
        loss_scaled=bool(loss_scales), dtype=dtype)
    if leaf_norms:
      norms, stacks = leaf_stats.measured(measured, measured.total.dtype)
      new_stats = new_stats._replace(leaf_norms=jax.tree.map(unscale, norms),
                                     stack_norms=jax.tree.map(unscale, stacks))
    skip, new_stats = _judge_multisteps(skip, new_stats, new_updates,
                                        new_inner, where)
    new_updates = scaling.zero_unless(~skip, new_updates)
    new_inner = _keep_unless_loss_scale(skip, new_inner, state.inner_state)
    return new_updates, SkipState(stats=new_stats, inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
