"""Skipping whole optimizer steps: non-finite gradients, norm and loss spikes.

``skip_step(inner)`` wraps an optimizer. A step whose gradients hold NaN or
Inf, whose global norm exceeds ``max_norm``, or whose norm is an outlier
against a running mean and standard deviation (z-score above ``zscore``)
gives zero updates and leaves the inner state exactly as it was: moments,
step counts and schedules do not move, as if the batch had never been seen.
With ``loss_zscore`` and ``update(..., loss=loss)``, so does a step whose
loss is NaN/Inf or an outlier against the loss's own running statistics.
This is what large language-model trainings do against loss spikes (AXLearn's
``skip_and_clip_by_global_norm``, OLMo's skip-step optimizer, MaxText's
``skip_step_on_spikes``).

The running statistics are exponential moving averages of the norm (and of
the loss) and of its squared deviation, fed only by steps that were not
skipped (a spike must not raise the bar for the next one), with bias
correction so that they are exact weighted means from the first step: after
``n`` accepted norms ``g_0..g_{n-1}`` they are the mean and variance under
weights ``ema_decay ** (n - 1 - i)``. Spikes are only looked for once
``warmup_steps`` values have been accepted. One outlier cannot take the
statistics over (see ``skip_step``).

Everything is decided on the device: the inner update always runs and the
results are selected with ``jnp.where``, so there is no host sync, no
callback and no Python branch on values; a skipped inner state is
bit-identical to the one before.
"""

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxclip import (
  _core,
  _counters,
  _leaf_stats,
  _placement,
  _running_stats,
  _scaling,
  _stats,
  _validation,
)
from optaxclip._types import AxisName, Ord, Scalar

PyTree = Any


class SkipStats(NamedTuple):
  """The counters and statistics of ``skip_step``; every field is a scalar.

  ``float`` below is float32, or float64 when x64 is on and ``init`` was
  given float64 parameters.

  Attributes:
    norm: float ``[]``: the global norm of the last gradients (unscaled).
    count: int32 ``[]``: steps seen.
    skipped_count: int32 ``[]``: steps skipped, for any reason.
    nonfinite_count: int32 ``[]``: steps whose norm was NaN or Inf.
    max_norm_count: int32 ``[]``: finite steps with a norm above
      ``max_norm``.
    zscore_count: int32 ``[]``: finite steps with a z-score above
      ``zscore`` (after the warm-up); a step may count in both.
    ema_count: int32 ``[]``: accepted steps that fed the statistics (since
      they last started again).
    norm_mean: float ``[]``: the EMA of the accepted norms.
    norm_var: float ``[]``: the EMA of their squared deviation.
    stale_count: int32 ``[]``: accepted norms in a row 100 times below the
      mean (3 start the statistics again).
    skipped_by_norm: bool ``[]``: the last step was skipped by the
      gradients (NaN/Inf, ``max_norm`` or ``zscore``).
    skipped_by_loss: bool ``[]``: the last step was skipped by its loss
      (NaN/Inf or ``loss_zscore``); both may be true.
    loss: float ``[]``: the last ``loss=`` given (0 before the first).
    loss_zscore: float ``[]``: its z-score ``(loss - mean) / std`` against
      the loss statistics before that step (0 during the warm-up; +-inf
      above or below a zero ``std``; NaN for a NaN loss).
    loss_zscore_count: int32 ``[]``: finite losses with a z-score above
      ``loss_zscore`` (after the warm-up).
    loss_nonfinite_count: int32 ``[]``: steps whose loss was NaN or Inf.
    loss_ema_count: int32 ``[]``: accepted steps whose finite loss fed the
      loss statistics (since they last started again).
    loss_mean: float ``[]``: the EMA of the accepted losses.
    loss_var: float ``[]``: the EMA of their squared deviation.
    loss_stale_count: int32 ``[]``: accepted losses in a row tiny against
      their distance to the mean (3 start the loss statistics again).
    leaf_norms: with ``leaf_norms=True``, the last step's norm of every
      leaf (per layer where ``layer_axis`` says), as in ``ClipState``;
      otherwise None.
  """
  norm: jax.Array
  count: jax.Array
  skipped_count: jax.Array
  nonfinite_count: jax.Array
  max_norm_count: jax.Array
  zscore_count: jax.Array
  ema_count: jax.Array
  norm_mean: jax.Array
  norm_var: jax.Array
  stale_count: jax.Array
  skipped_by_norm: jax.Array
  skipped_by_loss: jax.Array
  loss: jax.Array
  loss_zscore: jax.Array
  loss_zscore_count: jax.Array
  loss_nonfinite_count: jax.Array
  loss_ema_count: jax.Array
  loss_mean: jax.Array
  loss_var: jax.Array
  loss_stale_count: jax.Array
  leaf_norms: PyTree = None

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike,
            leaf_norms: PyTree = None) -> "SkipStats":
    """The statistics before the first step, their floats in ``dtype``."""
    return cls(norm=jnp.zeros([], dtype), count=_counters.zero(),
               skipped_count=_counters.zero(), nonfinite_count=_counters.zero(),
               max_norm_count=_counters.zero(), zscore_count=_counters.zero(),
               ema_count=_counters.zero(), norm_mean=jnp.zeros([], dtype),
               norm_var=jnp.zeros([], dtype), stale_count=_counters.zero(),
               skipped_by_norm=jnp.zeros([], bool),
               skipped_by_loss=jnp.zeros([], bool), loss=jnp.zeros([], dtype),
               loss_zscore=jnp.zeros([], dtype),
               loss_zscore_count=_counters.zero(),
               loss_nonfinite_count=_counters.zero(),
               loss_ema_count=_counters.zero(), loss_mean=jnp.zeros([], dtype),
               loss_var=jnp.zeros([], dtype),
               loss_stale_count=_counters.zero(), leaf_norms=leaf_norms)


class SkipState(NamedTuple):
  """State of ``skip_step``: its statistics and the wrapped optimizer's.

  Attributes:
    stats: the ``SkipStats``, read by ``optaxclip.stats`` as
      ``skip/<field>``.
    inner_state: the inner optimizer's state.
  """
  stats: SkipStats
  inner_state: optax.OptState


def _extras(stats: SkipStats) -> dict[str, jax.Array]:
  rate = stats.skipped_count / jnp.maximum(stats.count, 1)
  return {"norm_std": _running_stats.safe_sqrt(stats.norm_var),
          "loss_std": _running_stats.safe_sqrt(stats.loss_var),
          "skip_rate": rate.astype(jnp.float32),
          **_leaf_stats.entries(stats.leaf_norms)}


# The stale counts are bookkeeping, not statistics.
_stats.register(SkipStats, "skip",
                hide=("stale_count", "loss_stale_count", "leaf_norms"),
                extras=_extras, clips=False)


def _moments(stats: SkipStats, norm: jax.Array, accepted: jax.Array,
             decay: Any) -> dict[str, jax.Array]:
  """The statistics' fields after a step with ``norm``, fed if ``accepted``.

  The bias-corrected EMA (``_running_stats.bias_corrected_decay``) of the
  norm, at most ``OUTLIER_RATIO`` times the mean (winsorized), and of its
  squared deviation. ``RESTART_AFTER`` accepted norms in a row more than
  ``OUTLIER_RATIO`` times below the mean (stale statistics: an outlier was
  the first norm) start the statistics again from the last norm.
  """
  d = _running_stats.bias_corrected_decay(
      jnp.asarray(decay, stats.norm_mean.dtype), stats.ema_count)
  fed = _running_stats.capped(norm, stats.norm_mean)
  mean, var = _running_stats.ema(stats.norm_mean, stats.norm_var, fed, d)
  stale, restart = _running_stats.stale_streak(
      stats.stale_count, norm, stats.norm_mean, accepted)
  return {"norm_mean": jnp.where(restart, norm,
                                 jnp.where(accepted, mean, stats.norm_mean)),
          "norm_var": jnp.where(restart, 0,
                                jnp.where(accepted, var, stats.norm_var)),
          "ema_count": jnp.where(restart, 1,
                                 _counters.count_if(accepted, stats.ema_count)),
          "stale_count": stale}


def _loss_moments(stats: SkipStats, loss: jax.Array, accepted: jax.Array,
                  decay: Any) -> dict[str, jax.Array]:
  """The loss statistics' fields after a step with ``loss``, fed if
  ``accepted``.

  ``_moments`` for values of any sign: a loss counts as at most
  ``OUTLIER_RATIO * (|mean| + std)`` away from the mean (winsorized), and
  ``RESTART_AFTER`` accepted losses in a row closer to 0 than to the mean
  by that ratio (``|loss - mean| > OUTLIER_RATIO * |loss|``: an outlier was
  the first loss) start the statistics again from the last loss.
  """
  d = _running_stats.bias_corrected_decay(
      jnp.asarray(decay, stats.loss_mean.dtype), stats.loss_ema_count)
  fed = _running_stats.capped_signed(
      loss, stats.loss_mean, _running_stats.safe_sqrt(stats.loss_var))
  mean, var = _running_stats.ema(stats.loss_mean, stats.loss_var, fed, d)
  stale, restart = _running_stats.streak_of(
      stats.loss_stale_count, _running_stats.far_from(loss, stats.loss_mean),
      accepted)
  return {"loss_mean": jnp.where(restart, loss,
                                 jnp.where(accepted, mean, stats.loss_mean)),
          "loss_var": jnp.where(restart, 0,
                                jnp.where(accepted, var, stats.loss_var)),
          "loss_ema_count": jnp.where(
              restart, 1, _counters.count_if(accepted, stats.loss_ema_count)),
          "loss_stale_count": stale}


def _keep_unless_loss_scale(skip: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """``old`` where ``skip``, leaf by leaf; loss-scale states always advance."""
  def select(n, o):
    if _placement.is_loss_scale_state(n):
      return n  # an overflow's back-off must stick
    return jnp.where(skip, o, n)
  return jax.tree.map(select, new, old,
                      is_leaf=_placement.is_loss_scale_state)


def _decide(stats: SkipStats, norm: jax.Array, *, nonfinite: bool,
            max_norm: Scalar | None, zscore: Scalar | None,
            warmup_steps: Scalar) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(skip, too_large, spike)`` for a step with ``norm`` (in the
  statistics' dtype): whether to skip it, and the two reasons by norm."""
  dtype = stats.norm.dtype
  finite = jnp.isfinite(norm)
  skip = jnp.logical_not(finite) if nonfinite else jnp.bool_(False)
  too_large = jnp.bool_(False)
  if max_norm is not None:
    too_large = finite & (norm > jnp.asarray(max_norm, dtype))
    skip = skip | too_large
  spike = jnp.bool_(False)
  if zscore is not None:
    active = stats.ema_count >= jnp.maximum(warmup_steps, 1)
    limit = (jnp.asarray(zscore, dtype) *
             _running_stats.safe_sqrt(stats.norm_var))
    spike = finite & active & (norm - stats.norm_mean > limit)
    skip = skip | spike
  return skip, too_large, spike


def _decide_loss(stats: SkipStats, loss: jax.Array, *,
                 loss_zscore: Scalar | None, warmup_steps: Scalar
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(skip, spike, z)`` for a step with ``loss`` (in the statistics'
  dtype): whether its loss skips it (never without ``loss_zscore``),
  whether as a spike, and its z-score (0 in the warm-up for a finite loss).
  """
  finite = jnp.isfinite(loss)
  active = stats.loss_ema_count >= jnp.maximum(warmup_steps, 1)
  std = _running_stats.safe_sqrt(stats.loss_var)
  deviation = loss - stats.loss_mean
  positive = std > 0
  # +-inf above or below a zero std (a constant history), NaN stays NaN.
  z = jnp.where(positive, deviation / jnp.where(positive, std, 1),
                jnp.where(deviation == 0, 0, jnp.sign(deviation) * jnp.inf))
  z = jnp.where(active | ~finite, z, 0).astype(loss.dtype)
  if loss_zscore is None:
    return jnp.zeros([], bool), jnp.zeros([], bool), z
  # A product, not z: at loss_zscore=inf nothing is a spike (inf * 0 is NaN).
  spike = finite & active & (
      deviation > jnp.asarray(loss_zscore, loss.dtype) * std)
  return ~finite | spike, spike, z


def step(stats: SkipStats, norm: jax.Array, *, nonfinite: bool,
         max_norm: Scalar | None, zscore: Scalar | None, ema_decay: Scalar,
         warmup_steps: Scalar, loss: jax.Array | None = None,
         loss_zscore: Scalar | None = None) -> tuple[jax.Array, SkipStats]:
  """Whether to skip a step with ``norm`` (and ``loss``, if given; both in
  the statistics' dtype), and the statistics after it (see ``skip_step``).

  Without ``loss`` the loss fields are left as they are.
  """
  by_norm, too_large, spike = _decide(stats, norm, nonfinite=nonfinite,
                                      max_norm=max_norm, zscore=zscore,
                                      warmup_steps=warmup_steps)
  count_if = _counters.count_if
  by_loss, loss_fields = jnp.zeros([], bool), {}
  if loss is not None:
    by_loss, loss_spike, z = _decide_loss(stats, loss, loss_zscore=loss_zscore,
                                          warmup_steps=warmup_steps)
    loss_fields = {
        "loss": loss, "loss_zscore": z,
        "loss_zscore_count": count_if(loss_spike, stats.loss_zscore_count),
        "loss_nonfinite_count": count_if(~jnp.isfinite(loss),
                                         stats.loss_nonfinite_count)}
  skip = by_norm | by_loss
  finite = jnp.isfinite(norm)
  accepted = finite & ~skip
  if loss is not None:
    loss_fields.update(_loss_moments(stats, loss, accepted & jnp.isfinite(loss),
                                     ema_decay))
  return skip, stats._replace(
      norm=norm,
      count=_counters.increment(stats.count),
      skipped_count=count_if(skip, stats.skipped_count),
      nonfinite_count=count_if(~finite, stats.nonfinite_count),
      max_norm_count=count_if(too_large, stats.max_norm_count),
      zscore_count=count_if(spike, stats.zscore_count),
      skipped_by_norm=jnp.asarray(by_norm, bool),
      skipped_by_loss=by_loss,
      **_moments(stats, norm, accepted, ema_decay), **loss_fields)


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


def skip_step(inner: optax.GradientTransformation, *, nonfinite: bool = True,
              max_norm: Scalar | None = None, zscore: Scalar | None = None,
              ema_decay: Scalar = 0.99, warmup_steps: Scalar = 100, ord: Ord = 2,
              axis_name: AxisName = None, specs: PyTree = None,
              loss_zscore: Scalar | None = None, leaf_norms: bool = False,
              layer_axis: PyTree = None
              ) -> optax.GradientTransformationExtraArgs:
  """Skips whole optimizer steps on non-finite gradients, norm and loss spikes.

  Wraps ``inner`` (any optimizer or chain). A step is skipped when

  - ``nonfinite`` and the gradients hold NaN or Inf;
  - ``max_norm`` is set and the global norm ``g > max_norm``;
  - ``zscore`` is set, at least ``warmup_steps`` (and at least one) norms
    have been accepted, and ``g > mean + zscore * std`` (a z-score
    ``(g - mean) / std`` above ``zscore``), with ``mean`` and ``std`` the
    EMA statistics of the accepted norms (see the module docstring);
  - ``loss_zscore`` is set, ``update`` is given ``loss=`` (a scalar: the
    loss the gradients are of, unscaled, the same on every device), and the
    loss is NaN or Inf, or at least ``warmup_steps`` (and at least one)
    losses have been accepted and ``loss > loss_mean + loss_zscore *
    loss_std``, with the statistics of the accepted losses kept as those
    of the norm (same ``ema_decay``; before this step's loss). Only rises
    count: a loss well below its mean is not a spike.

  A skipped step returns zero updates and the inner state unchanged,
  bit for bit. Accepted finite steps feed the statistics. Extra arguments
  (``params``, ``value``, ``loss``, ...) are passed to ``inner``. Without
  ``loss=``, nothing changes: the loss fields keep their initial values.
  With ``loss=`` but no ``loss_zscore``, the loss only is logged: its
  statistics and z-score are kept (to choose a ``loss_zscore`` by), and a
  NaN loss is counted, not skipped. ``skip/skipped_by_norm`` and
  ``skip/skipped_by_loss`` in ``optaxclip.stats`` say which guard skipped
  the last step.

  OLMo-core's skip-step optimizer skips when ``|z| > 6`` for the loss or
  the norm against the plain mean and standard deviation of a window of the
  last 128 steps (skipped ones included), after 64 steps; MaxText's
  ``skip_step_on_spikes`` compares against ``mean + factor * std`` of such a
  window. An EMA with the same mean age as a 128-step window has
  ``ema_decay = 1 - 2 / 129`` (about 0.984): ``skip_step(inner, zscore=6,
  loss_zscore=6, ema_decay=0.984, warmup_steps=64)``. Unlike OLMo-core, a
  sudden drop is never skipped, and skipped steps stay out of the
  statistics.

  When ``inner`` holds a ``dynamic_loss_scale`` (at its head, as in
  ``skip_step(optax.chain(dynamic_loss_scale(), optax.adamw(1e-3)))``), an
  overflow skips the whole chain, the loss-scale state still advances (its
  back-off sticks), and the norm is taken of the unscaled gradients.
  ``init`` raises when an optaxclip clipper in ``inner`` comes before the
  ``dynamic_loss_scale``.

  Around ``optax.MultiSteps`` (``skip_step(optax.MultiSteps(...))``) it
  judges each micro-batch and a skipped one never reaches the accumulator.
  Not inside: a NaN micro-batch would stay in MultiSteps' accumulator for
  good (there, use ``should_skip_update_fn=optaxclip.microbatch_guard()``).

  A permanent rise of the norm (or loss) level would be skipped for ever,
  since skipped steps do not move the statistics: watch ``skip/skip_rate``
  in ``optaxclip.stats``.

  Injected with ``optax.inject_hyperparams``, the hyperparameters are
  checked when ``init`` runs eagerly; traced (a jitted update after a change
  of the state's hyperparameters), a negative ``max_norm`` or ``zscore``
  acts as 0 (every finite step with a positive norm, or above the mean, is
  skipped), ``ema_decay`` is clamped to [0, 1), ``warmup_steps`` to at least
  0 (NaN as 0 for all of them), an ``ord`` that is not > 0 acts as 2, and
  a ``loss_zscore`` that is not > 0 (NaN too) as inf (no z-score test of
  the loss: 0 would skip every loss above its mean).

  One outlier cannot take the statistics over, unlike in a plain EMA (and
  the references), where one accepted norm of 2e19 makes the variance
  overflow and one of 1e10 keeps every spike below the bar for thousands of
  steps: a norm counts in the EMA as at most 100 times the mean
  (winsorized; ordinary norms count in full), the variance saturates at
  the largest float, and 3 accepted norms in a row more than 100 times
  below the mean (as after an outlier that was the first norm) start the
  statistics again, ``ema_count`` included. So after one finite norm of any
  size, at any step, a norm 1e6 times the usual ones is skipped again at
  most ``3 + max(warmup_steps, 1)`` steps later (at once when it came after
  the warm-up: the z-score test then skips it without feeding it).
  The loss, which may have either sign, is kept the same way against the
  level ``|loss_mean| + loss_std``: a loss counts as at most 100 levels
  away from the mean, and 3 accepted losses in a row whose distance to the
  mean is more than 100 times their own size start the loss statistics
  again. After one finite loss of any size, at any step, a loss 1e6 levels
  above the mean is skipped again within the same bound.

  The statistics are float32, or float64 when x64 is on and ``init`` is
  given float64 parameters (a float64 norm beyond float32's range is then
  measured, not taken for Inf); the loss is converted to that dtype (a
  loss beyond its range is Inf).

  Args:
    inner: the optimizer whose steps may be skipped.
    nonfinite: skip steps whose gradients hold NaN or Inf (a bool).
    max_norm: skip steps whose global norm exceeds it (a number >= 0), or
      None (or ``inf``).
    zscore: skip steps whose norm's z-score exceeds it (a number >= 0), or
      None (or ``inf``). Large runs use values around 6.
    ema_decay: the EMA's weight of the past, in [0, 1); 0.99 averages over
      about the last 100 accepted steps.
    warmup_steps: accepted steps before the z-score test starts (an int
      >= 0; the test needs at least one).
    ord: the norm order: any number ``p > 0`` or ``inf``.
    axis_name: under ``shard_map``/``pmap``, the axis name(s) the gradients
      are split over: every device takes the same decision.
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix, as
      ``shard_map``'s ``in_specs``): a leaf replicated on an axis counts once.
    loss_zscore: skip steps whose loss (``update(..., loss=loss)``) is NaN,
      Inf, or has a z-score above it (a number > 0 or inf), or None (the
      loss only logged). Large runs use values around 6.
    leaf_norms: keep every leaf's norm in the statistics (``skip/leaf_norm/
      <path>``), from the same pass as the global norm.
    layer_axis: with ``leaf_norms``, the axis that stacks layers (a tree
      prefix of ints or None): one norm per layer.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    ``SkipState``; its statistics show in ``optaxclip.stats`` as ``skip/...``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from optaxclip import skip_step
    >>> tx = skip_step(optax.adam(0.1), max_norm=10.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([30.0, 40.0])}, state, params)
    >>> updates["w"], state.stats.skipped_count, state.inner_state[0].count
    (Array([0., 0.], dtype=float32), Array(1, dtype=int32), Array(0, dtype=int32))
    >>> updates, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    >>> state.stats.nonfinite_count, state.stats.skipped_count
    (Array(1, dtype=int32), Array(2, dtype=int32))

    A loss spike: ``loss=`` goes to ``update`` (and on to ``inner``).

    >>> tx = skip_step(optax.adam(0.1), loss_zscore=6.0, warmup_steps=4)
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.array([0.3, 0.4])}
    >>> for loss in (2.5, 2.4, 2.6, 2.5, 9.0):
    ...   updates, state = tx.update(grads, state, params, loss=loss)
    >>> updates["w"], state.stats.skipped_by_loss, state.inner_state[0].count
    (Array([0., 0.], dtype=float32), Array(True, dtype=bool), Array(4, dtype=int32))
    >>> round(float(state.stats.loss_zscore), 1), round(float(state.stats.loss_mean), 4)
    (91.9, 2.5003)

  References:
    Chowdhery et al., [PaLM: Scaling Language Modeling with
    Pathways](https://arxiv.org/abs/2204.02311), 2022 (skipping batches
    around loss spikes); OLMo Team, [2 OLMo 2
    Furious](https://arxiv.org/abs/2501.00656), 2025.
  """
  fn = "skip_step"
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    hint = " (a factory: call it, e.g. optax.adam(1e-3))" if callable(inner) else ""
    raise TypeError(f"`{fn}(inner=...)` must be an optax GradientTransformation, "
                    f"got {inner!r:.80}{hint}")
  _validation.check_bool(fn, "nonfinite", nonfinite)
  if max_norm is not None:
    max_norm = _validation.check_nonnegative(fn, "max_norm", max_norm,
                                             allow_inf=True)
  if zscore is not None:
    zscore = _validation.check_nonnegative(fn, "zscore", zscore,
                                           allow_inf=True)
  ema_decay = _validation.check_unit_interval(fn, "ema_decay", ema_decay,
                                              include_one=False)
  warmup_steps = _validation.check_integer(fn, "warmup_steps", warmup_steps, 0)
  p = _validation.check_ord(fn, ord)
  where = _core.Where.of(fn, axis_name, specs)
  _validation.check_bool(fn, "leaf_norms", leaf_norms)
  _validation.check_layer_axis(fn, layer_axis)
  kept = _core.layers(layer_axis) if leaf_norms else _core.TOTAL
  if loss_zscore is not None:
    loss_zscore = _check_loss_zscore(fn, loss_zscore)
  inner = optax.with_extra_args_support(inner)
  settings = {"nonfinite": nonfinite, "max_norm": max_norm, "zscore": zscore,
              "ema_decay": ema_decay, "warmup_steps": warmup_steps,
              "loss_zscore": loss_zscore}

  def init_fn(params):
    inner_state = inner.init(params)
    _placement.check_placement(inner_state, f"{fn}(inner=...).init",
                                "inner_state")
    dtype = _running_stats.statistics_dtype(params)
    norms = None
    if leaf_norms:
      norms = _leaf_stats.zeros(fn, params, _core.layers(layer_axis), dtype)[0]
    return SkipState(stats=SkipStats.fresh(dtype, norms),
                     inner_state=inner_state)

  def update_fn(updates, state, params=None, *, loss=None, **extra_args):
    _validation.check_update(fn, updates, state, SkipState)
    stats = state.stats
    # NaN or Inf in any leaf and only then: the norm is overflow-safe, so
    # its finiteness is the gradients' (one pass for both questions).
    measured = _core.measure(fn, updates, p, where, kept)
    norm = measured.total
    norms = measured.tree() if leaf_norms else None
    dtype = stats.norm.dtype  # the statistics' (see init), every step
    loss_scales = _placement.find_loss_scale_states(state.inner_state)
    unscale = ((lambda n: (n / loss_scales[0].scale).astype(dtype))
               if loss_scales  # the input is scaled: judge the unscaled
               else (lambda n: n.astype(dtype)))
    norm = unscale(norm)
    judged = None
    if loss is not None:
      judged = _checked_loss(fn, loss, dtype)
      extra_args = {**extra_args, "loss": loss}  # inner's too, as given
    skip, new_stats = step(stats, norm, loss=judged, **settings)
    new_stats = new_stats._replace(leaf_norms=jax.tree.map(unscale, norms))

    new_updates, new_inner = inner.update(updates, state.inner_state, params,
                                          **extra_args)
    new_updates = _scaling.zero_unless(~skip, new_updates)
    new_inner = _keep_unless_loss_scale(skip, new_inner, state.inner_state)
    return new_updates, SkipState(stats=new_stats, inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
