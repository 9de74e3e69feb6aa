"""``ClipState``: what a norm-based clipper keeps after each step.

The pre-clip norm, the factor applied and the step counters
(``_stats.counters``), and with ``leaf_norms=True`` every leaf's norm; read by
``optaxclip.stats`` as ``clip/...``.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from optaxclip import _core
from optaxclip._stats import counters, leaf_stats, registry, running
from optaxclip._stats.counters import Counter
from optaxclip._types import PyTree


class ClipState(NamedTuple):
  """State of the norm-based clippers.

  ``float`` below is float32, or float64 when x64 is on and ``init`` was
  given float64 parameters (so that a float64 norm beyond float32's range
  is logged, not taken for Inf).

  Attributes:
    norm: float ``[]``: the pre-clip norm of the last update (per-leaf
      clippers: the largest leaf norm).
    scale: float ``[]``: the factor applied last step (per leaf: the
      smallest).
    count: int32 ``[]``: steps seen.
    clipped_count: int32 ``[]``: steps with a finite norm and ``scale < 1``.
    nonfinite_count: int32 ``[]``: steps whose norm was NaN or Inf.
    leaf_norms: with ``leaf_norms=True``, the last update's norm of every
      leaf: a tree of the gradients' structure, float ``[]`` per clippable
      leaf (``[layers]`` where ``layer_axis`` gives one), None elsewhere;
      otherwise None (nothing kept).
    stack_norms: with ``leaf_norms=True``, the last update's norm of every
      leaf that stacks layers, as a whole (float ``[]``; None elsewhere);
      otherwise None.
  """
  norm: jax.Array
  scale: jax.Array
  count: Counter
  clipped_count: Counter
  nonfinite_count: Counter
  leaf_norms: PyTree = None
  stack_norms: PyTree = None

  def after(self, norm: jax.Array, factor: jax.Array, *, finite: jax.Array,
            measured: _core.Measured | None = None) -> "ClipState":
    """The state after a step with this norm and factor (and, kept, the
    leaf norms of ``measured``), in this state's dtypes."""
    dtype = self.norm.dtype
    norms = stacks = None
    if measured is not None:
      norms, stacks = leaf_stats.measured(measured, dtype)
    return ClipState(norm=norm.astype(dtype), scale=factor.astype(dtype),
                     **counters.step_counts(self, finite=finite,
                                            clipped=factor < 1),
                     leaf_norms=norms, stack_norms=stacks)

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike, *kept: PyTree) -> "ClipState":
    """The state before the first step, its floats in ``dtype``; ``kept``:
    the leaf norms and stack norms it starts with (``leaf_stats.zeros``)."""
    leaf_norms, stack_norms = kept or (None, None)
    return cls(norm=jnp.zeros([], dtype), scale=jnp.ones([], dtype),
               count=counters.zero(), clipped_count=counters.zero(),
               nonfinite_count=counters.zero(), leaf_norms=leaf_norms,
               stack_norms=stack_norms)


registry.register(ClipState, "clip", hide=("leaf_norms", "stack_norms"),
                  extras=lambda state: {
                      "clip_rate": counters.clip_rate(state),
                      **leaf_stats.entries(state.leaf_norms, state.stack_norms)})


def init_clip_state(fn: str, params: PyTree = None, *,
                    kept: _core.Kept | None = None) -> ClipState:
  """A fresh ``ClipState``, its floats in the statistics dtype of ``params``
  (with ``kept``, zero leaf norms of its shapes)."""
  dtype = running.statistics_dtype(params)
  if kept is None:
    return ClipState.fresh(dtype)
  return ClipState.fresh(dtype, *leaf_stats.zeros(fn, params, kept, dtype))
