"""ZClip: clip gradient-norm spikes found by a z-score against an EMA.

A warm-up collects the global L2 norms; their mean and variance start
exponential moving averages, against which later norms are scored and
spikes cut to a threshold. ``step`` is the statistics as a pure function
``(state, norm) -> (factor, new_state)``. The numbers follow the reference
implementation (github.com/bluorion-com/ZClip), including its clip
coefficient ``threshold / (g + 1e-6)``, except where its statistics break
(docs/guards.md).
"""

from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from optaxclip import _core, _validation
from optaxclip._clip import masking, scaling
from optaxclip._stats import counters, leaf_stats, registry, running
from optaxclip._stats.counters import Counter
from optaxclip._types import AxisName, Scalar

PyTree = Any

Mode = Literal["zscore", "percentile"]
ClipOption = Literal["adaptive_scaling", "mean"]
MODES = get_args(Mode)
CLIP_OPTIONS = get_args(ClipOption)
# The reference divides by norm + 1e-6 whatever its `eps` (which only guards
# the z-score), in warm-up (clip_grad_norm_) and after it alike.
COEFFICIENT_EPS = 1e-6
# The reference cuts a lasting rise of the norm for ever (its EMA is fed the
# threshold, or nothing); after this many spikes in a row the next are let
# through and fed in full, as skip_step's max_consecutive_skips.
MAX_CONSECUTIVE_SPIKES = 4


class ZClipState(NamedTuple):
  """State of ``zclip``: the warm-up buffer, the EMA and statistics.

  ``float`` below is float32, or float64 when x64 is on and ``init`` was
  given float64 parameters.

  Attributes:
    mean: float ``[]``: the EMA of the norm (0 until the warm-up ends).
    std: float ``[]``: the square root of the EMA of the squared deviation
      from the mean (kept rather than the variance, which underflows for
      norms below ~1e-19 in float32: ``_stats.running``).
    warmup_norms: float ``[warmup_steps]``: the norms seen in the warm-up.
    collected: int32 ``[]``: finite norms collected; the warm-up ends when
      it reaches ``warmup_steps``.
    stale_count: int32 ``[]``: finite norms in a row, after the warm-up,
      100 times below the mean (3 start a new warm-up).
    spike_streak: int32 ``[]``: finite norms in a row, after the warm-up,
      detected as spikes (past ``max_consecutive_spikes``, let through).
    norm: float ``[]``: the pre-clip global norm of the last update.
    z: float ``[]``: the z-score of the last norm (0 during the warm-up).
    threshold: float ``[]``: the norm the last update was clipped to (the
      norm itself when nothing applied).
    scale: float ``[]``: the factor applied last step (1 = not clipped).
    count: int32 ``[]``: steps seen.
    clipped_count: int32 ``[]``: steps with a finite norm and ``scale < 1``.
    spike_count: int32 ``[]``: steps cut as spikes (after the warm-up).
    nonfinite_count: int32 ``[]``: steps whose norm was NaN or Inf.
    leaf_norms: with ``leaf_norms=True``, the last update's norm of every
      leaf (per layer where ``layer_axis`` says), as in ``ClipState``;
      otherwise None.
    stack_norms: with ``leaf_norms=True``, the whole norm of every leaf
      that stacks layers, as in ``ClipState``; otherwise None.
  """
  mean: jax.Array
  std: jax.Array
  warmup_norms: jax.Array
  collected: Counter
  # Bookkeeping of restarts and let-through spikes, hidden from stats:
  stale_count: Counter
  spike_streak: Counter
  norm: jax.Array
  z: jax.Array
  threshold: jax.Array
  scale: jax.Array
  count: Counter
  clipped_count: Counter
  spike_count: Counter
  nonfinite_count: Counter
  leaf_norms: PyTree = None
  stack_norms: PyTree = None

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike, warmup_steps: int,
            leaf_norms: PyTree = None, stack_norms: PyTree = None
            ) -> "ZClipState":
    """The state before the first step: an empty warm-up buffer."""
    return cls(mean=jnp.zeros([], dtype), std=jnp.zeros([], dtype),
               warmup_norms=jnp.zeros([warmup_steps], dtype),
               collected=counters.zero(), norm=jnp.zeros([], dtype),
               z=jnp.zeros([], dtype), threshold=jnp.zeros([], dtype),
               scale=jnp.ones([], dtype), count=counters.zero(),
               clipped_count=counters.zero(), spike_count=counters.zero(),
               nonfinite_count=counters.zero(), stale_count=counters.zero(),
               spike_streak=counters.zero(), leaf_norms=leaf_norms,
               stack_norms=stack_norms)


def _extras(state: ZClipState) -> dict[str, jax.Array]:
  return {"clip_rate": counters.clip_rate(state),
          **leaf_stats.entries(state.leaf_norms, state.stack_norms)}


registry.register(ZClipState, "zclip", extras=_extras,
                  hide=("warmup_norms", "collected", "stale_count",
                        "spike_streak", "leaf_norms", "stack_norms"))


def _safe_divide(numerator: jax.Array, denominator: jax.Array,
                 at_zero: jax.typing.ArrayLike) -> jax.Array:
  """``numerator / denominator``, or ``at_zero`` where the denominator is 0."""
  nonzero = denominator != 0
  return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1),
                   at_zero)


def _spike_threshold(norm: jax.Array, mean: jax.Array, std: jax.Array,
                     z: jax.Array, *, z_thresh: Scalar, mode: Mode,
                     clip_option: ClipOption, clip_factor: Scalar
                     ) -> tuple[jax.Array, jax.Array]:
  """Whether ``norm`` is a spike, and the threshold it is cut to."""
  z_limit = jnp.asarray(z_thresh, norm.dtype)
  if mode == "percentile":
    limit = mean + z_limit * std
    return _core.below(limit, norm), limit
  if clip_option == "mean":
    return z > z_limit, mean
  # The reference's mean + z_thresh * std / (z / z_thresh), times
  # clip_factor; z > z_thresh >= 0 wherever it is used.
  eta = _safe_divide(z, z_limit, jnp.inf)
  limit = mean + _safe_divide(z_limit * std, eta, 0.0)
  return z > z_limit, limit * jnp.asarray(clip_factor, norm.dtype)


class _WarmUp(NamedTuple):
  """The warm-up's part of a step: the buffer after it and whether the
  warm-up was on (``warming``) or ends at this step (``starts``, with the
  moments that start the EMA)."""
  warming: jax.Array
  starts: jax.Array
  buffer: jax.Array
  collected: jax.Array
  mean: jax.Array
  std: jax.Array


def _warm_up(state: ZClipState, norm: jax.Array) -> _WarmUp:
  """Collects a finite ``norm`` while warming up; the buffer's length is
  ``warmup_steps`` (read from the state: injected, the argument is traced)."""
  length = state.warmup_norms.shape[0]
  warming = state.collected < length
  collect = warming & jnp.isfinite(norm)
  slot = jnp.minimum(state.collected, length - 1)
  buffer = jnp.where(collect, state.warmup_norms.at[slot].set(norm),
                     state.warmup_norms)
  collected = state.collected + collect.astype(jnp.int32)
  starts = warming & (collected >= length)
  # Only the last warm-up step needs them: on the CPU only it pays for the
  # median; on GPU and TPU a conditional would wait for its predicate on
  # the host every step, so each step takes the (small) median and selects.
  def selected(starts, buffer):
    mean, std = running.robust_moments(buffer)
    return (jnp.where(starts, mean, state.mean), jnp.where(starts, std, state.std))

  mean, std = jax.lax.platform_dependent(
      starts, buffer,
      cpu=lambda starts, buffer: jax.lax.cond(
          starts, running.robust_moments, lambda b: (state.mean, state.std),
          buffer),
      default=selected)
  return _WarmUp(warming, starts, buffer, collected, mean, std)


def _released(state: ZClipState, spike: jax.Array,
              max_consecutive_spikes: Scalar | None) -> jax.Array:
  """Whether a spike is let through: ``max_consecutive_spikes`` came in a
  row before it (a lasting level, not a spike: docs/guards.md)."""
  if max_consecutive_spikes is None:
    return jnp.zeros([], bool)
  return spike & (state.spike_streak >=
                  jnp.asarray(max_consecutive_spikes, jnp.int32))


def step(state: ZClipState, norm: jax.Array, *, alpha: Scalar,
         z_thresh: Scalar, max_grad_norm: Scalar | None, eps: Scalar,
         mode: Mode, clip_option: ClipOption, clip_factor: Scalar,
         skip_update_on_spike: bool,
         max_consecutive_spikes: Scalar | None = MAX_CONSECUTIVE_SPIKES
         ) -> tuple[jax.Array, ZClipState]:
  """One step of ``zclip``'s statistics: the factor for ``norm`` and the
  state after it (``norm`` in the state's float dtype; see ``zclip``)."""
  dtype = state.mean.dtype
  finite = jnp.isfinite(norm)
  warm = _warm_up(state, norm)
  # After warm-up: z-score against the EMA.
  std = state.std
  # In the statistics' frame: the same z for norms times any power of two.
  scale = running.frame(norm, state.mean, std)
  deviation = norm / scale - state.mean / scale
  z = _safe_divide(deviation, (std + jnp.asarray(eps, dtype)) / scale,
                   jnp.where(deviation > 0, jnp.inf, 0.0))
  detected, limit = _spike_threshold(
      norm, state.mean, std, z, z_thresh=z_thresh, mode=mode,
      clip_option=clip_option, clip_factor=clip_factor)
  detected = detected & ~warm.warming  # (an Inf norm too, as the reference)
  release = finite & _released(state, detected, max_consecutive_spikes)
  spike = detected & ~release
  threshold = jnp.where(spike, limit, norm)
  if max_grad_norm is not None:
    threshold = jnp.minimum(threshold, jnp.asarray(max_grad_norm, dtype))
  coefficient = _safe_divide(threshold, norm + COEFFICIENT_EPS, 1.0)
  factor = jnp.where(_core.below(threshold, norm), coefficient, 1.0)
  if max_grad_norm is not None:  # warm-up: torch's clip_grad_norm_
    warm_factor = scaling.clip_factor(norm, max_grad_norm, COEFFICIENT_EPS)
  else:
    warm_factor = jnp.ones([], dtype)
  factor = jnp.where(warm.warming, warm_factor, factor)

  # EMA: mean first, then the variance around the new mean (ZClip's); a
  # released spike is fed in full.
  mean, std = running.ema(state.mean, state.std,
                          jnp.where(spike, limit, norm),
                          jnp.asarray(alpha, dtype), zclip=True)
  tracks = ~warm.warming & finite
  if skip_update_on_spike:
    tracks = tracks & ~spike
  mean = jnp.where(warm.starts, warm.mean, jnp.where(tracks, mean, state.mean))
  std = jnp.where(warm.starts, warm.std, jnp.where(tracks, std, state.std))
  # Statistics that ordinary norms find far above them: warm up again.
  stale, restart = running.stale_streak(
      state.stale_count, norm, state.mean, ~warm.warming & finite)
  mean, std = jnp.where(restart, 0, mean), jnp.where(restart, 0, std)
  # A warm-up of zero norms gives no scale: with mean and std 0 every later
  # norm would be a spike cut to 0, zeroing every update for good.
  restart = restart | (warm.starts & (warm.mean == 0))

  new_state = ZClipState(
      mean=mean.astype(dtype), std=std.astype(dtype),
      warmup_norms=warm.buffer.astype(dtype),
      collected=jnp.where(restart, 0, warm.collected).astype(jnp.int32),
      norm=norm, z=jnp.where(warm.warming, 0.0, z).astype(dtype),
      threshold=threshold.astype(dtype), scale=factor.astype(dtype),
      spike_count=counters.count_if(spike, state.spike_count),
      stale_count=stale,
      spike_streak=jnp.where(finite, jnp.where(
          detected, counters.increment(state.spike_streak), 0),
          state.spike_streak).astype(jnp.int32),
      **counters.step_counts(state, finite=finite, clipped=factor < 1))
  return factor, new_state


def zclip(*, alpha: Scalar = 0.97, z_thresh: Scalar = 2.5,
          max_grad_norm: Scalar = 1.0, eps: Scalar = 1e-6, warmup_steps: int = 25,
          mode: Mode = "zscore", clip_option: ClipOption = "adaptive_scaling",
          clip_factor: Scalar = 1.0, skip_update_on_spike: bool = False,
          axis_name: AxisName = None, specs: PyTree = None,
          leaf_norms: bool = False, layer_axis: PyTree = None,
          max_consecutive_spikes: Scalar | None = MAX_CONSECUTIVE_SPIKES,
          expert_axis: PyTree = None, mask: masking.Mask = None
          ) -> optax.GradientTransformation:
  """Clips gradient-norm spikes detected by a z-score against an EMA (ZClip).

  The first ``warmup_steps`` global L2 norms ``g`` start the EMA (clipped at
  ``max_grad_norm`` only). Then, with ``z = (g - mean) / (std + eps)``, a
  spike ``z > z_thresh`` is cut to ``(mean + z_thresh**2 * std / z) *
  clip_factor`` (``"adaptive_scaling"``) or to ``mean``; in ``"percentile"``
  mode a norm above ``mean + z_thresh * std`` is cut to that. Updates are
  multiplied by ``threshold / (g + 1e-6)``; the EMA is fed the threshold.
  The reference's numbers, except where its statistics break (NaN/Inf, one
  huge outlier, a lasting rise: at most ``max_consecutive_spikes`` cuts in
  a row). Rules, bounds, injected hyperparameters:
  [docs/guards.md](../guards.md).

  Args:
    alpha: EMA smoothing factor in [0, 1] (weight of the past).
    z_thresh: the z-score above which a norm is a spike (>= 0).
    max_grad_norm: an absolute cap on the norm (>= 0), or None.
    eps: added to the standard deviation in the z-score (>= 0; an
      absolute amount: with 0 the spikes found do not depend on the norms' scale).
    warmup_steps: norms collected before the EMA starts (an int >= 1); it
      fixes the state's shape (``static_args`` under ``inject_hyperparams``).
    mode: ``"zscore"`` or ``"percentile"``.
    clip_option: with ``mode="zscore"``, ``"adaptive_scaling"`` or ``"mean"``.
    clip_factor: multiplies the ``"adaptive_scaling"`` threshold.
    skip_update_on_spike: leave the EMA unchanged on spikes.
    axis_name: under ``shard_map``/``pmap``, the axis name(s) the updates
      are split over (one all-reduce).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix).
    leaf_norms: keep every leaf's norm in the state.
    layer_axis: with ``leaf_norms``, the axis that stacks layers.
    max_consecutive_spikes: spikes cut in a row at most (an int >= 1), or
      None (the reference: a lasting rise is cut for ever).
    expert_axis: with ``leaf_norms``, the axis that stacks experts.
    mask: leaves in the norm and the clip (as ``optax.masked``'s mask); the
      others pass through untouched.

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``ZClipState``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip import zclip
    >>> tx = zclip(warmup_steps=3, max_grad_norm=None)
    >>> state = tx.init([jnp.zeros(1)])
    >>> for norm in (1.0, 1.2, 0.8, 10.0):  # a spike after the warm-up
    ...   updates, state = tx.update([jnp.array([norm])], state)
    >>> state.z > 2.5, state.spike_count, updates[0]  # cut to mean + 2.5**2 * std / z
    (Array(True, dtype=bool), Array(1, dtype=int32), Array([1.0185], dtype=float32))

  References:
    Kumar et al., [ZClip: Adaptive Spike Mitigation for LLM
    Pre-Training](https://arxiv.org/abs/2504.02507), 2025.
  """
  fn = "zclip"
  alpha = _validation.check_unit_interval(fn, "alpha", alpha)
  z_thresh = _validation.check_nonnegative(fn, "z_thresh", z_thresh)
  if max_grad_norm is not None:
    max_grad_norm = _validation.check_nonnegative(fn, "max_grad_norm",
                                                  max_grad_norm, allow_inf=True)
  eps = _validation.check_nonnegative(fn, "eps", eps)
  size = _validation.check_buffer_size(fn, "warmup_steps", warmup_steps)
  _validation.check_choice(fn, "mode", mode, MODES)
  _validation.check_choice(fn, "clip_option", clip_option, CLIP_OPTIONS)
  clip_factor = _validation.check_nonnegative(fn, "clip_factor", clip_factor)
  _validation.check_bool(fn, "skip_update_on_spike", skip_update_on_spike)
  if max_consecutive_spikes is not None:
    max_consecutive_spikes = _validation.check_integer(
        fn, "max_consecutive_spikes", max_consecutive_spikes, 1)
  where = _core.Where.of(fn, axis_name, specs)
  _validation.check_bool(fn, "leaf_norms", leaf_norms)
  units = _core.experts(*_validation.check_stack_axes(fn, expert_axis, layer_axis))
  kept = units if leaf_norms else _core.TOTAL
  mask = _validation.check_mask(fn, mask)

  def init_fn(params):
    length = _validation.require_buffer_size(fn, "warmup_steps", size)
    dtype = running.statistics_dtype(params)
    kept = (None, None)
    if leaf_norms:
      kept = leaf_stats.zeros(fn, params, units, dtype)
    return ZClipState.fresh(dtype, length, *kept)

  settings = {"alpha": alpha, "z_thresh": z_thresh,
              "max_grad_norm": max_grad_norm, "eps": eps, "mode": mode,
              "clip_option": clip_option, "clip_factor": clip_factor,
              "skip_update_on_spike": skip_update_on_spike,
              "max_consecutive_spikes": max_consecutive_spikes}

  def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
    del params, extra_args
    _validation.check_update(fn, updates, state, ZClipState)
    measured = _core.measure(fn, updates, 2, where, kept,
                             given=None if leaf_norms else grad_norm)
    dtype = state.mean.dtype  # the statistics' (see init), every step
    factor, new_state = step(state, measured.total.astype(dtype), **settings)
    if leaf_norms:
      norms, stacks = leaf_stats.measured(measured, dtype)
      new_state = new_state._replace(leaf_norms=norms, stack_norms=stacks)
    return scaling.scale_leaves(updates, factor), new_state

  tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  return tx if mask is None else masking.masked(fn, tx, mask)
