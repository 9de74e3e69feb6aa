"""ZClip: clip gradient-norm spikes found by a z-score against an EMA.

During a warm-up the global L2 norms are collected (and clipped only at
``max_grad_norm``, as ``torch.nn.utils.clip_grad_norm_`` does); their mean and
population variance then start exponential moving averages. Afterwards a norm
``g`` whose z-score ``(g - mean) / (std + eps)`` exceeds ``z_thresh`` is a
spike, clipped to a threshold computed from the EMA, and the EMA is fed the
threshold instead of the spike. The numbers follow the reference
implementation (github.com/bluorion-com/ZClip), including its clip
coefficient ``threshold / (g + 1e-6)``, applied when ``g > threshold``,
except after one outlier in the warm-up (see ``zclip``).
"""

from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from optaxclip import (
  _core,
  _counters,
  _leaf_stats,
  _running_stats,
  _scaling,
  _stats,
  _validation,
)
from optaxclip._types import AxisName, Scalar

PyTree = Any

Mode = Literal["zscore", "percentile"]
ClipOption = Literal["adaptive_scaling", "mean"]
MODES = get_args(Mode)
CLIP_OPTIONS = get_args(ClipOption)
# The reference divides by norm + 1e-6 whatever its `eps` (which only guards
# the z-score), in warm-up (clip_grad_norm_) and after it alike.
COEFFICIENT_EPS = 1e-6


class ZClipState(NamedTuple):
  """State of ``zclip``: the warm-up buffer, the EMA and statistics.

  ``float`` below is float32, or float64 when x64 is on and ``init`` was
  given float64 parameters.

  Attributes:
    mean: float ``[]``: the EMA of the norm (0 until the warm-up ends).
    var: float ``[]``: the EMA of the squared deviation from the mean.
    warmup_norms: float ``[warmup_steps]``: the norms seen in the warm-up.
    collected: int32 ``[]``: finite norms collected; the warm-up ends when
      it reaches ``warmup_steps``.
    norm: float ``[]``: the pre-clip global norm of the last update.
    z: float ``[]``: the z-score of the last norm (0 during the warm-up).
    threshold: float ``[]``: the norm the last update was clipped to (the
      norm itself when nothing applied).
    scale: float ``[]``: the factor applied last step (1 = not clipped).
    count: int32 ``[]``: steps seen.
    clipped_count: int32 ``[]``: steps with a finite norm and ``scale < 1``.
    spike_count: int32 ``[]``: steps detected as spikes (after the warm-up).
    nonfinite_count: int32 ``[]``: steps whose norm was NaN or Inf.
    stale_count: int32 ``[]``: finite norms in a row, after the warm-up,
      100 times below the mean (3 start a new warm-up).
    leaf_norms: with ``leaf_norms=True``, the last update's norm of every
      leaf (per layer where ``layer_axis`` says), as in ``ClipState``;
      otherwise None.
  """
  mean: jax.Array
  var: jax.Array
  warmup_norms: jax.Array
  collected: jax.Array
  norm: jax.Array
  z: jax.Array
  threshold: jax.Array
  scale: jax.Array
  count: jax.Array
  clipped_count: jax.Array
  spike_count: jax.Array
  nonfinite_count: jax.Array
  stale_count: jax.Array
  leaf_norms: PyTree = None

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike, warmup_steps: int,
            leaf_norms: PyTree = None) -> "ZClipState":
    """The state before the first step: an empty warm-up buffer."""
    return cls(mean=jnp.zeros([], dtype), var=jnp.zeros([], dtype),
               warmup_norms=jnp.zeros([warmup_steps], dtype),
               collected=_counters.zero(), norm=jnp.zeros([], dtype),
               z=jnp.zeros([], dtype), threshold=jnp.zeros([], dtype),
               scale=jnp.ones([], dtype), count=_counters.zero(),
               clipped_count=_counters.zero(), spike_count=_counters.zero(),
               nonfinite_count=_counters.zero(), stale_count=_counters.zero(),
               leaf_norms=leaf_norms)


def _extras(state: ZClipState) -> dict[str, jax.Array]:
  return {"std": _running_stats.safe_sqrt(state.var),
          "clip_rate": _counters.clip_rate(state),
          **_leaf_stats.entries(state.leaf_norms)}


_stats.register(ZClipState, "zclip", extras=_extras,
                hide=("var", "warmup_norms", "collected", "stale_count",
                      "leaf_norms"))


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
    return norm > limit, limit
  if clip_option == "mean":
    return z > z_limit, mean
  # The reference's mean + z_thresh * std / (z / z_thresh), times
  # clip_factor; z > z_thresh >= 0 wherever it is used.
  eta = _safe_divide(z, z_limit, jnp.inf)
  limit = mean + _safe_divide(z_limit * std, eta, 0.0)
  return z > z_limit, limit * jnp.asarray(clip_factor, norm.dtype)


def step(state: ZClipState, norm: jax.Array, *, alpha: Scalar,
         z_thresh: Scalar, max_grad_norm: Scalar | None, eps: Scalar,
         mode: Mode, clip_option: ClipOption, clip_factor: Scalar,
         skip_update_on_spike: bool) -> tuple[jax.Array, ZClipState]:
  """One step of ``zclip``'s statistics: the factor for ``norm`` and the
  state after it (``norm`` in the state's float dtype; see ``zclip``)."""
  dtype = state.mean.dtype
  finite = jnp.isfinite(norm)
  a = jnp.asarray(alpha, dtype)

  # Warm-up: collect the norm; the buffer's length is warmup_steps (read
  # from the state: under inject_hyperparams the argument is traced here).
  length = state.warmup_norms.shape[0]
  warming = state.collected < length
  collect = warming & finite
  slot = jnp.minimum(state.collected, length - 1)
  buffer = jnp.where(collect, state.warmup_norms.at[slot].set(norm),
                     state.warmup_norms)
  collected = state.collected + collect.astype(jnp.int32)
  starts = warming & (collected >= length)
  # Only the last warm-up step needs them (and pays for the median).
  first_mean, first_var = jax.lax.cond(
      starts, _running_stats.robust_moments, lambda b: (state.mean, state.var),
      buffer)

  # After warm-up: z-score against the EMA.
  std = _running_stats.safe_sqrt(state.var)
  deviation = norm - state.mean
  z = _safe_divide(deviation, std + jnp.asarray(eps, dtype),
                   jnp.where(deviation > 0, jnp.inf, 0.0))
  spike, limit = _spike_threshold(norm, state.mean, std, z, z_thresh=z_thresh,
                                  mode=mode, clip_option=clip_option,
                                  clip_factor=clip_factor)
  spike = spike & ~warming
  threshold = jnp.where(spike, limit, norm)
  if max_grad_norm is not None:
    threshold = jnp.minimum(threshold, jnp.asarray(max_grad_norm, dtype))
  coefficient = _safe_divide(threshold, norm + COEFFICIENT_EPS, 1.0)
  factor = jnp.where(norm > threshold, coefficient, 1.0)
  if max_grad_norm is not None:  # warm-up: torch's clip_grad_norm_
    warm_factor = _scaling.clip_factor(norm, max_grad_norm, COEFFICIENT_EPS)
  else:
    warm_factor = jnp.ones([], dtype)
  factor = jnp.where(warming, warm_factor, factor)

  # EMA: mean first, then the variance around the new mean (ZClip's).
  observed = jnp.where(spike, limit, norm)
  mean, var = _running_stats.ema(state.mean, state.var, observed, a,
                                 zclip=True)
  tracks = ~warming & finite
  if skip_update_on_spike:
    tracks = tracks & ~spike
  mean = jnp.where(starts, first_mean, jnp.where(tracks, mean, state.mean))
  var = jnp.where(starts, first_var, jnp.where(tracks, var, state.var))
  # Statistics that ordinary norms find far above them: warm up again.
  stale, restart = _running_stats.stale_streak(
      state.stale_count, norm, state.mean, ~warming & finite)
  mean, var = jnp.where(restart, 0, mean), jnp.where(restart, 0, var)
  # A warm-up of zero norms gives no scale: with mean and std 0 every later
  # norm would be a spike cut to 0, zeroing every update for good.
  restart = restart | (starts & (first_mean == 0))

  new_state = ZClipState(
      mean=mean.astype(dtype), var=var.astype(dtype),
      warmup_norms=buffer.astype(dtype),
      collected=jnp.where(restart, 0, collected).astype(jnp.int32),
      norm=norm, z=jnp.where(warming, 0.0, z).astype(dtype),
      threshold=threshold.astype(dtype), scale=factor.astype(dtype),
      spike_count=_counters.count_if(spike, state.spike_count),
      stale_count=stale,
      **_counters.step_counts(state, finite=finite, clipped=factor < 1))
  return factor, new_state


def zclip(*, alpha: Scalar = 0.97, z_thresh: Scalar = 2.5,
          max_grad_norm: Scalar = 1.0, eps: Scalar = 1e-6, warmup_steps: int = 25,
          mode: Mode = "zscore", clip_option: ClipOption = "adaptive_scaling",
          clip_factor: Scalar = 1.0, skip_update_on_spike: bool = False,
          axis_name: AxisName = None, specs: PyTree = None,
          leaf_norms: bool = False, layer_axis: PyTree = None
          ) -> optax.GradientTransformation:
  """Clips gradient-norm spikes detected by a z-score against an EMA (ZClip).

  The first ``warmup_steps`` global L2 norms ``g`` are collected while the
  updates are clipped at ``max_grad_norm`` only (factor
  ``min(1, max_grad_norm / (g + 1e-6))``). Their mean and population
  variance then start the EMA. From the next step on, with
  ``std = sqrt(var)`` and ``z = (g - mean) / (std + eps)``:

  - ``mode="zscore"``: ``g`` is a spike when ``z > z_thresh``; its threshold
    is ``(mean + z_thresh**2 * std / z) * clip_factor``
    (``clip_option="adaptive_scaling"``: larger spikes are cut closer to the
    mean) or ``mean`` (``clip_option="mean"``);
  - ``mode="percentile"``: ``g`` is a spike when it exceeds
    ``mean + z_thresh * std``, which is also its threshold.

  The threshold used is the spike's (or ``g`` itself when there is none),
  capped at ``max_grad_norm`` unless that is None, and the updates are
  multiplied by ``threshold / (g + 1e-6)`` when ``g > threshold``. The EMA
  is then updated, mean first and the variance with the new mean, with the
  spike's threshold (not capped) or with ``g``; with
  ``skip_update_on_spike`` spikes leave it unchanged.

  Same defaults and numbers as the reference implementation, but for
  inputs that break the reference:

  - a NaN or Inf norm, which propagates into the update as in the
    reference, is kept out of the warm-up buffer and the EMA (in the
    reference it poisons every later step) and counted in
    ``nonfinite_count``;
  - one huge finite norm: in the reference, one norm of 2e19 in the
    warm-up makes the variance overflow, and one of 1e10 hides every spike
    for hundreds of steps. Here the warm-up's mean and variance leave out
    norms more than 100 times the median of the warm-up norms (none when
    that median is 0); after the warm-up the EMA is fed at most the spike
    threshold, as in the reference; and 3 finite norms in a row more than
    100 times below the EMA's mean (an outlier the warm-up could not single
    out, with ``warmup_steps <= 2``) start a new warm-up. So one finite
    norm of any size, at any step, moves the statistics by a bounded
    amount: a norm 1e6 times the usual ones is a spike again at the next
    step when the outlier came after the warm-up, and otherwise from the
    warm-up's end when ``warmup_steps >= 3``, or from step
    ``2 * warmup_steps + 3`` (counting from 0). The variance saturates at
    the largest float rather than overflowing: the statistics stay finite
    (only ``z``, the last norm's score, may be ``+inf``);
  - the gradient of the updates through ``std`` is finite when the variance
    is 0 (all warm-up norms equal);
  - a warm-up of zero norms (frozen or masked parameters at the start): in
    the reference every later norm is then a spike cut to the mean 0, and
    every update is zero for good. Here such a warm-up has no scale to
    judge by and starts again. (After a warm-up of equal positive norms,
    the variance is 0 and larger norms are cut to the mean until the EMA
    moves, as in the reference.)

  The statistics are float32, or float64 when x64 is on and ``init`` is
  given float64 parameters (a float64 norm beyond float32's range is then
  clipped, not taken for Inf).

  Injected with ``optax.inject_hyperparams``, the hyperparameters are
  checked when ``init`` runs eagerly; traced (a jitted update after a change
  of the state's hyperparameters), ``alpha`` is clamped to [0, 1], and a
  negative ``z_thresh``, ``max_grad_norm``, ``eps`` or ``clip_factor`` acts
  as 0 (NaN as 0 for all of them).

  Args:
    alpha: EMA smoothing factor in [0, 1] (weight of the past).
    z_thresh: the z-score above which a norm is a spike (>= 0); in
      ``"percentile"`` mode, the number of standard deviations allowed.
    max_grad_norm: an absolute cap on the norm (>= 0), applied in warm-up
      and after it; None (or ``inf``) for no cap.
    eps: added to the standard deviation in the z-score (>= 0).
    warmup_steps: how many norms to collect before the EMA starts (an int
      >= 1); fixes the state's shape. With ``optax.inject_hyperparams`` and
      a jitted ``init``, list it in ``static_args``.
    mode: ``"zscore"`` or ``"percentile"``.
    clip_option: with ``mode="zscore"``, ``"adaptive_scaling"`` or
      ``"mean"``.
    clip_factor: multiplies the ``"adaptive_scaling"`` threshold (the
      reference multiplies the whole threshold, mean included).
    skip_update_on_spike: leave the EMA unchanged on spikes.
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the updates
      are split over: the norms are then those of the whole, unsplit updates,
      with one all-reduce (see ``functional.global_norm``).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix, as
      ``shard_map``'s ``in_specs``): a leaf replicated on an axis counts once.
    leaf_norms: keep every leaf's norm in the state (``zclip/leaf_norm/
      <path>``), from the same pass as the global norm.
    layer_axis: with ``leaf_norms``, the axis that stacks layers (a tree
      prefix of ints or None): one norm per layer.

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``ZClipState``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip import zclip
    >>> tx = zclip(warmup_steps=3, max_grad_norm=None)
    >>> state = tx.init([jnp.zeros(1)])
    >>> for norm in (1.0, 1.2, 0.8, 10.0):  # a spike after the warm-up
    ...   updates, state = tx.update([jnp.array([norm])], state)
    >>> state.z > 2.5, state.spike_count
    (Array(True, dtype=bool), Array(1, dtype=int32))
    >>> updates[0]  # cut to mean + 2.5**2 * std / z
    Array([1.0185], dtype=float32)

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
  where = _core.Where.of(fn, axis_name, specs)
  _validation.check_bool(fn, "leaf_norms", leaf_norms)
  _validation.check_layer_axis(fn, layer_axis)
  kept = _core.layers(layer_axis) if leaf_norms else _core.TOTAL

  def init_fn(params):
    length = _validation.require_buffer_size(fn, "warmup_steps", size)
    dtype = _running_stats.statistics_dtype(params)
    norms = None
    if leaf_norms:
      norms = _leaf_stats.zeros(fn, params, _core.layers(layer_axis), dtype)[0]
    return ZClipState.fresh(dtype, length, norms)

  settings = {"alpha": alpha, "z_thresh": z_thresh,
              "max_grad_norm": max_grad_norm, "eps": eps, "mode": mode,
              "clip_option": clip_option, "clip_factor": clip_factor,
              "skip_update_on_spike": skip_update_on_spike}

  def update_fn(updates, state, params=None):
    del params
    _validation.check_update(fn, updates, state, ZClipState)
    measured = _core.measure(fn, updates, 2, where, kept)
    norm = measured.total
    norms = measured.tree() if leaf_norms else None
    dtype = state.mean.dtype  # the statistics' (see init), every step
    factor, new_state = step(state, norm.astype(dtype), **settings)
    new_state = new_state._replace(
        leaf_norms=jax.tree.map(lambda n: n.astype(dtype), norms))
    return _scaling.scale_leaves(updates, factor), new_state

  return optax.GradientTransformation(init_fn, update_fn)
