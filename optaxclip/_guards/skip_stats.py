"""``skip_step``'s statistics and its decision, as one pure function.

``step(stats, norm, loss=...) -> (skip, new_stats)`` takes the whole
decision of a step: each guarded value (the gradients' norm, the loss) is
judged by its own statistics (``_stats.spikes``), the step is skipped when
any guard says so, and the statistics are fed afterwards. At most
``max_consecutive_skips`` finite steps are skipped in a row: after that,
the guards' spikes are let through (released) and fed in full until a
step is no longer one, so that a lasting level is trained on and learned
(docs/guards.md).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optaxclip import _core
from optaxclip._stats import counters, leaf_stats, registry, running, spikes
from optaxclip._stats.counters import Counter
from optaxclip._stats.spikes import Running
from optaxclip._types import Scalar

PyTree = Any

# OLMo-core's and MaxText's skip rule (|z| > 6 over a 128-step window that
# keeps the skipped values) takes a lasting level shift of any size as the
# new level after at most 4 skips (docs/guards.md): the same bound here.
MAX_CONSECUTIVE_SKIPS = 4


def _variance(stats: Running) -> jax.Array:
  """The variance of the statistics, which keep its root: saturating at
  the largest float (the root of a norm beyond ~1.8e19), 0 where it
  underflows (below ~1e-19)."""
  return running.saturate(jnp.square(stats.std))


class SkipStats(NamedTuple):
  """The counters and statistics of ``skip_step``.

  ``float`` below is float32, or float64 when x64 is on and ``init`` was
  given float64 parameters. ``norm_mean``, ``norm_var``, ``ema_count``,
  ``loss_mean``, ``loss_var`` and ``loss_ema_count`` read the statistics
  (the variances from the standard deviations they keep).

  Attributes:
    norm: float ``[]``: the global norm of the last gradients (unscaled).
    count: int32 ``[]``: steps seen.
    skipped_count: int32 ``[]``: steps skipped, for any reason.
    forced_count: int32 ``[]``: finite steps that would have been skipped
      but were let through, ``max_consecutive_skips`` having been skipped
      in a row before them.
    nonfinite_count: int32 ``[]``: steps whose norm was NaN or Inf (around
      ``optax.MultiSteps``: or whose proposed step was, its accumulator's).
    max_norm_count: int32 ``[]``: finite steps with a norm above
      ``max_norm``.
    zscore_count: int32 ``[]``: finite steps with a z-score above
      ``zscore`` (after the warm-up); a step may count in both.
    skipped_by_norm: bool ``[]``: the last step was skipped by the
      gradients (NaN/Inf, ``max_norm`` or ``zscore``).
    skipped_by_loss: bool ``[]``: the last step was skipped by its loss
      (NaN/Inf or ``loss_zscore``); several may be true.
    loss: float ``[]``: the last ``loss=`` given (0 before the first).
    loss_zscore: float ``[]``: its z-score ``(loss - mean) / std`` against
      the loss statistics before that step (0 during the warm-up; +-inf
      above or below a zero ``std``; NaN for a NaN loss).
    loss_zscore_count: int32 ``[]``: finite losses with a z-score above
      ``loss_zscore`` (after the warm-up).
    loss_nonfinite_count: int32 ``[]``: steps whose loss was NaN or Inf.
    update_norm: float ``[]``: the global L2 norm of the update ``inner``
      proposed at the last step (applied or not); None (not measured)
      unless ``update_norm=True`` or ``update_zscore`` is set.
    update_zscore_count: int32 ``[]``: finite update norms with a z-score
      above ``update_zscore`` (after the warm-up); None when not measured.
    skipped_by_update: bool ``[]``: the last step was rolled back by its
      update norm (NaN/Inf or ``update_zscore``); None when not measured.
    skip_streak: int32 ``[]``: finite steps in a row the guards would skip.
    norm_stats: the ``spikes.Running`` statistics of the norms (EMA:
      the accepted ones; window: the last ``window``).
    loss_stats: the same for the finite losses.
    update_stats: the same for the finite update norms (None when not
      measured).
    leaf_norms: with ``leaf_norms=True``, each leaf's norm at the last
      step (per layer where ``layer_axis`` says; see ``ClipState``);
      otherwise None.
    stack_norms: with ``leaf_norms=True``, each stack of layers' whole
      norm at the last step; otherwise None.
  """
  norm: jax.Array
  count: Counter
  skipped_count: Counter
  forced_count: Counter
  nonfinite_count: Counter
  max_norm_count: Counter
  zscore_count: Counter
  skipped_by_norm: jax.Array
  skipped_by_loss: jax.Array
  loss: jax.Array
  loss_zscore: jax.Array
  loss_zscore_count: Counter
  loss_nonfinite_count: Counter
  update_norm: PyTree  # jax.Array, or None when not measured
  update_zscore_count: PyTree
  skipped_by_update: PyTree
  skip_streak: Counter
  norm_stats: Running
  loss_stats: Running
  update_stats: PyTree  # Running, or None when not measured
  leaf_norms: PyTree = None
  stack_norms: PyTree = None

  # The EMA-era names, read from the statistics they now live in.
  norm_mean = property(lambda self: self.norm_stats.mean)
  norm_var = property(lambda self: _variance(self.norm_stats))
  ema_count = property(lambda self: self.norm_stats.count)
  loss_mean = property(lambda self: self.loss_stats.mean)
  loss_var = property(lambda self: _variance(self.loss_stats))
  loss_ema_count = property(lambda self: self.loss_stats.count)

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike, leaf_norms: PyTree = None,
            stack_norms: PyTree = None, *, window: int | None = None,
            update: bool = False) -> "SkipStats":
    """The statistics before the first step, their floats in ``dtype``;
    windows of ``window`` values, or EMAs (None); the update norm's fields
    with ``update``, else None."""
    zero = counters.zero
    empty = lambda: Running.fresh(dtype, window)  # noqa: E731
    return cls(norm=jnp.zeros([], dtype), count=zero(), skipped_count=zero(),
               forced_count=zero(), nonfinite_count=zero(),
               max_norm_count=zero(), zscore_count=zero(),
               skipped_by_norm=jnp.zeros([], bool),
               skipped_by_loss=jnp.zeros([], bool), loss=jnp.zeros([], dtype),
               loss_zscore=jnp.zeros([], dtype), loss_zscore_count=zero(),
               loss_nonfinite_count=zero(),
               update_norm=jnp.zeros([], dtype) if update else None,
               update_zscore_count=zero() if update else None,
               skipped_by_update=jnp.zeros([], bool) if update else None,
               skip_streak=zero(), norm_stats=empty(), loss_stats=empty(),
               update_stats=empty() if update else None,
               leaf_norms=leaf_norms, stack_norms=stack_norms)


def _extras(stats: SkipStats) -> dict[str, jax.Array]:
  rate = stats.skipped_count / jnp.maximum(stats.count, 1)
  return {"ema_count": stats.ema_count, "norm_mean": stats.norm_mean,
          "norm_var": stats.norm_var,
          "norm_std": stats.norm_stats.std,
          "loss_ema_count": stats.loss_ema_count,
          "loss_mean": stats.loss_mean, "loss_var": stats.loss_var,
          "loss_std": stats.loss_stats.std,
          **({} if stats.update_stats is None else {
              "update_mean": stats.update_stats.mean,
              "update_std": stats.update_stats.std}),
          "skip_rate": rate.astype(jnp.float32),
          **leaf_stats.entries(stats.leaf_norms, stats.stack_norms)}


# The streak is bookkeeping; the statistics are reported flat (extras).
registry.register(SkipStats, "skip",
                  hide=("skip_streak", "norm_stats", "loss_stats",
                        "update_stats", "leaf_norms", "stack_norms"),
                  extras=_extras, clips=False)


def _released(streak: jax.Array, would_skip: jax.Array,
              max_consecutive_skips: Scalar | None) -> jax.Array:
  """Whether a step the guards would skip is let through: when
  ``max_consecutive_skips`` finite steps in a row were skipped before."""
  if max_consecutive_skips is None:
    return jnp.zeros([], bool)
  return would_skip & (streak >= jnp.asarray(max_consecutive_skips, jnp.int32))


class _Guard(NamedTuple):
  """One guarded value's part of a step (see ``step``)."""
  value: jax.Array
  judged: spikes.Verdict
  skips: jax.Array  # the value's own reasons to skip the step
  finite: jax.Array  # whether it counts as finite for the streak


def _guard(history: Running, value: jax.Array, threshold: Scalar | None, *,
           warmup_steps: Scalar, two_sided: bool, signed: bool = False
           ) -> _Guard:
  """The verdict on ``value``; a NaN/Inf skips when ``threshold`` is set."""
  judged = spikes.verdict(history, value, zscore=threshold,
                          warmup_steps=warmup_steps,
                          two_sided=two_sided, signed=signed)
  finite = jnp.isfinite(value)
  skips = judged.spike | (~finite if threshold is not None else False)
  return _Guard(value, judged, skips,
                finite if threshold is not None else jnp.ones([], bool))


def _judge(stats: SkipStats, norm: jax.Array, loss: jax.Array | None,
           update_norm: jax.Array | None, *, zscore: Scalar | None,
           loss_zscore: Scalar | None, update_zscore: Scalar | None,
           warmup_steps: Scalar | None, two_sided: bool) -> dict[str, _Guard]:
  """Each given value's verdict, by name ("norm", "loss", "update")."""
  if warmup_steps is None:
    warmup_steps = spikes.default_warmup(stats.norm_stats)
  common = {"warmup_steps": warmup_steps, "two_sided": two_sided}
  guards = {"norm": _guard(stats.norm_stats, norm, zscore, **common)}
  if loss is not None:
    guards["loss"] = _guard(stats.loss_stats, loss, loss_zscore, signed=True,
                            **common)
  if update_norm is not None:
    assert stats.update_stats is not None, "init with update=True"
    guards["update"] = _guard(stats.update_stats, update_norm, update_zscore,
                              **common)
  return guards


def step(stats: SkipStats, norm: jax.Array, *, nonfinite: bool,
         max_norm: Scalar | None, zscore: Scalar | None, ema_decay: Scalar,
         warmup_steps: Scalar | None, loss: jax.Array | None = None,
         loss_zscore: Scalar | None = None,
         update_norm: jax.Array | None = None,
         update_zscore: Scalar | None = None,
         max_consecutive_skips: Scalar | None = MAX_CONSECUTIVE_SKIPS,
         two_sided: bool = False) -> tuple[jax.Array, SkipStats]:
  """Whether to skip a step with ``norm`` (and ``loss``, ``update_norm``,
  if given; all in the statistics' dtype), and the statistics after it
  (see ``skip_step``). Without ``loss`` (``update_norm``) its fields are
  left as they are; ``warmup_steps`` None: ``default_warmup``.
  """
  guards = _judge(stats, norm, loss, update_norm, zscore=zscore,
                  loss_zscore=loss_zscore, update_zscore=update_zscore,
                  warmup_steps=warmup_steps, two_sided=two_sided)
  finite = jnp.isfinite(norm)
  too_large = jnp.zeros([], bool)
  if max_norm is not None:
    too_large = finite & _core.below(jnp.asarray(max_norm, norm.dtype), norm)
  by = {k: g.skips for k, g in guards.items()}
  by["norm"] = too_large | guards["norm"].judged.spike | (
      ~finite if nonfinite else False)
  would_skip = functools.reduce(jnp.logical_or, by.values())
  # Steps with a NaN or Inf neither extend nor break the streak.
  all_finite = finite & functools.reduce(
      jnp.logical_and, [g.finite for g in guards.values()])
  release = all_finite & _released(stats.skip_streak, would_skip,
                                   max_consecutive_skips)
  skip = would_skip & ~release
  count_if = counters.count_if
  fed = {k: spikes.feed(
      getattr(stats, f"{k}_stats"), g.value, g.judged,
      accepted=finite & ~skip & jnp.isfinite(g.value), release=release,
      decay=ema_decay, signed=k == "loss") for k, g in guards.items()}
  new = stats._replace(
      norm=norm, count=counters.increment(stats.count),
      skipped_count=count_if(skip, stats.skipped_count),
      forced_count=count_if(release, stats.forced_count),
      nonfinite_count=count_if(~finite, stats.nonfinite_count),
      max_norm_count=count_if(too_large, stats.max_norm_count),
      zscore_count=count_if(guards["norm"].judged.spike, stats.zscore_count),
      skipped_by_norm=by["norm"] & ~release,
      skipped_by_loss=by.get("loss", False) & ~release,
      skip_streak=jnp.where(all_finite, jnp.where(
          would_skip, count_if(True, stats.skip_streak), 0),
          stats.skip_streak),
      norm_stats=fed["norm"])
  if "loss" in guards:
    judged = guards["loss"].judged
    new = new._replace(
        loss=loss, loss_zscore=judged.z, loss_stats=fed["loss"],
        loss_zscore_count=count_if(judged.spike, stats.loss_zscore_count),
        loss_nonfinite_count=count_if(~jnp.isfinite(guards["loss"].value),
                                      stats.loss_nonfinite_count))
  if "update" in guards:
    assert stats.update_zscore_count is not None
    new = new._replace(
        skipped_by_update=by["update"] & ~release, update_norm=update_norm,
        update_stats=fed["update"], update_zscore_count=count_if(
            guards["update"].judged.spike, stats.update_zscore_count))
  return skip, new
