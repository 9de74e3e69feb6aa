"""``ClipState``: what a norm-based clipper keeps after each step.

The pre-clip norm, the factor applied and the step counters
(``_stats.counters``), the stall guard (the smallest factor and the steps
whose factor fell under ``floor``), and with ``leaf_norms=True`` every
leaf's norm; read by ``optaxclip.stats`` as ``clip/...``.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from optaxclip import _core
from optaxclip._stats import counters, leaf_stats, registry, running
from optaxclip._stats.counters import Counter
from optaxclip._types import PyTree, Scalar

# A factor under 1e-4 takes a matrix gradient of norm 1e-3 down to 1e-7, the
# eps of Newton-Schulz's normalisation (Jordan's Muon; optax's muon: 1e-8).
DEFAULT_FLOOR = 1e-4


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
    min_scale: float ``[]``: the smallest factor of a finite step so far (1
      before any), the stall guard's record.
    floor_count: int32 ``[]``: finite steps whose factor fell under the
      builder's ``floor`` ([docs/muon.md](../muon.md)); None when
      ``floor=None``.
    leaf_norms: with ``leaf_norms=True``, the last update's norm of every
      leaf: a tree of the gradients' structure, float ``[]`` per clippable
      leaf (``[layers]`` where ``layer_axis`` gives one), None elsewhere;
      otherwise None (nothing kept).
    stack_norms: with ``leaf_norms=True``, the last update's norm of every
      leaf that stacks layers, as a whole (float ``[]``; None elsewhere);
      otherwise None.
    expert_norms: with ``clip_by_norm(joint_experts=True)``, the last
      update's joint norm of every expert (over all its tensors), float
      ``[layers, experts]`` (``[experts]`` without ``layer_axis``), the same
      on every device; otherwise None.
  """
  norm: jax.Array
  scale: jax.Array
  count: Counter
  clipped_count: Counter
  nonfinite_count: Counter
  min_scale: jax.Array
  floor_count: PyTree = None  # a Counter; None without a floor
  leaf_norms: PyTree = None
  stack_norms: PyTree = None
  expert_norms: PyTree = None  # a float array; None without joint_experts

  def after(self, norm: jax.Array, factor: jax.Array, *, finite: jax.Array,
            floor: Scalar | None = None,
            measured: _core.Measured | None = None,
            expert_norms: jax.Array | None = None) -> "ClipState":
    """The state after a step with this norm and factor (``floor``: the
    builder's, counted when this state has ``floor_count``; and, kept, the
    leaf norms of ``measured`` and the experts' joint norms), in this
    state's dtypes."""
    dtype = self.norm.dtype
    norms = stacks = None
    if measured is not None:
      norms, stacks = leaf_stats.measured(measured, dtype)
    factor = factor.astype(dtype)
    floor_count = self.floor_count
    if floor_count is not None and floor is not None:
      floor_count = counters.count_if(finite & (factor < floor), floor_count)
    # A non-finite step's factor (NaN, or 0 for an Inf norm) is counted in
    # nonfinite_count, not taken for a stall.
    smallest = jnp.where(finite, jnp.minimum(self.min_scale, factor),
                         self.min_scale)
    return ClipState(norm=norm.astype(dtype), scale=factor,
                     **counters.step_counts(self, finite=finite,
                                            clipped=factor < 1),
                     min_scale=smallest, floor_count=floor_count,
                     leaf_norms=norms, stack_norms=stacks,
                     expert_norms=None if expert_norms is None
                     else expert_norms.astype(dtype))

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike, *kept: PyTree,
            floor: Scalar | None = None) -> "ClipState":
    """The state before the first step, its floats in ``dtype``; ``kept``:
    the leaf norms and stack norms it starts with (``leaf_stats.zeros``);
    ``floor``: the builder's (None: no ``floor_count``)."""
    leaf_norms, stack_norms = kept or (None, None)
    return cls(norm=jnp.zeros([], dtype), scale=jnp.ones([], dtype),
               count=counters.zero(), clipped_count=counters.zero(),
               nonfinite_count=counters.zero(), min_scale=jnp.ones([], dtype),
               floor_count=None if floor is None else counters.zero(),
               leaf_norms=leaf_norms, stack_norms=stack_norms)


registry.register(ClipState, "clip",
                  hide=("leaf_norms", "stack_norms", "expert_norms"),
                  extras=lambda state: {
                      "clip_rate": counters.clip_rate(state),
                      **leaf_stats.entries(state.leaf_norms, state.stack_norms),
                      **leaf_stats.grid_entries("expert_norm",
                                                state.expert_norms)})


def init_clip_state(fn: str, params: PyTree = None, *,
                    kept: _core.Kept | None = None,
                    floor: Scalar | None = None,
                    experts: tuple[int, ...] | None = None) -> ClipState:
  """A fresh ``ClipState``, its floats in the statistics dtype of ``params``
  (with ``kept``, zero leaf norms of its shapes; with ``floor``, a
  ``floor_count``; with ``experts``, zero joint norms of that shape)."""
  dtype = running.statistics_dtype(params)
  state = (ClipState.fresh(dtype, floor=floor) if kept is None else
           ClipState.fresh(dtype, *leaf_stats.zeros(fn, params, kept, dtype),
                           floor=floor))
  if experts is None:
    return state
  return state._replace(expert_norms=jnp.zeros(experts, dtype))
