"""AdaGC: per-tensor clipping against an EMA of each tensor's clipped norm.

``gamma`` is one threshold per clippable leaf (per layer slice of leaves
that stack layers, with ``layer_axis``), so the state's shape is fixed by
the tree given to ``init``. ``step`` is the statistics as a pure function
``(state, norms, norm) -> (factors, new_state)``; the rules that keep one
outlier step from setting the thresholds are in docs/guards.md.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxclip import _core, _validation
from optaxclip._clip import scaling
from optaxclip._stats import counters, registry, running
from optaxclip._types import AxisName, Scalar

PyTree = Any


class AdaGCState(NamedTuple):
  """State of ``adagc``: one threshold per tensor and scalar statistics.

  ``float`` below is float32, or float64 when x64 is on and ``init`` was
  given float64 parameters.

  Attributes:
    gamma: float ``[tensors]``: each tensor's clipped-norm statistic
      (+inf before the first step); a tensor is a clippable leaf, or with
      ``layer_axis`` one layer's slice of it (leaf by leaf, layers in
      order).
    norm_min: float ``[]``: the smallest global norm of the warm-up steps
      that fed ``gamma`` (+inf before the first).
    norm: float ``[]``: the pre-clip global norm of the last update.
    scale: float ``[]``: the smallest per-tensor factor applied last step.
    clipped_tensors: int32 ``[]``: tensors with a factor < 1 last step.
    count: int32 ``[]``: steps seen (warm-up while ``count <
      warmup_steps``).
    clipped_count: int32 ``[]``: steps with a finite norm and a factor < 1.
    nonfinite_count: int32 ``[]``: steps whose norm was NaN or Inf.
    outlier_streak: int32 ``[]``: warm-up steps in a row whose global norm
      was an outlier (3 start the running minimum again).
    far_streak: int32 ``[tensors]``: per tensor, steps in a row after the
      warm-up with a norm over 100 times its threshold, or a non-zero one
      100 times below ``gamma`` (3 start its ``gamma`` again from its norm).
  """
  gamma: jax.Array
  norm_min: jax.Array
  norm: jax.Array
  scale: jax.Array
  clipped_tensors: jax.Array
  count: jax.Array
  clipped_count: jax.Array
  nonfinite_count: jax.Array
  outlier_streak: jax.Array
  far_streak: jax.Array

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike, tensors: int) -> "AdaGCState":
    """The state before the first step, for ``tensors`` clippable leaves."""
    return cls(gamma=jnp.full([tensors], jnp.inf, dtype),
               norm_min=jnp.full([], jnp.inf, dtype),
               norm=jnp.zeros([], dtype), scale=jnp.ones([], dtype),
               clipped_tensors=counters.zero(), count=counters.zero(),
               clipped_count=counters.zero(), nonfinite_count=counters.zero(),
               outlier_streak=counters.zero(),
               far_streak=jnp.zeros([tensors], jnp.int32))


def _extras(state: AdaGCState) -> dict[str, jax.Array]:
  return {"gamma_min": jnp.min(state.gamma, initial=jnp.inf),
          "gamma_max": jnp.max(state.gamma, initial=0.0),
          "clip_rate": counters.clip_rate(state)}


registry.register(AdaGCState, "adagc", extras=_extras,
                  hide=("gamma", "norm_min", "outlier_streak", "far_streak"))


def _warm_up(state: AdaGCState, norm: jax.Array, clipped_norms: jax.Array
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The warm-up's running minimum: ``gamma``, ``norm_min`` and the
  outlier streak after a finite step with global ``norm``.

  Steps whose global norm is within ``OUTLIER_RATIO`` of the smallest that
  fed it take part; an outlier above does not; one far below (an outlier
  was first), or ``RESTART_AFTER`` outliers in a row (a tiny first norm),
  start it again from this step.
  """
  outlier = running.far_above(norm, state.norm_min)
  streak, again = running.streak_of(state.outlier_streak, outlier,
                                    jnp.ones([], bool))
  restart = running.far_below(norm, state.norm_min) | again
  outlier = outlier & ~restart
  gamma = jnp.where(restart, clipped_norms, jnp.where(
      outlier, state.gamma, jnp.minimum(state.gamma, clipped_norms)))
  norm_min = jnp.where(restart, norm, jnp.where(
      outlier, state.norm_min, jnp.minimum(state.norm_min, norm)))
  return gamma, norm_min, streak


def step(state: AdaGCState, norms: jax.Array, norm: jax.Array, *,
         lambda_abs: Scalar, lambda_rel: Scalar, beta: Scalar,
         warmup_steps: Scalar, eps: Scalar) -> tuple[jax.Array, AdaGCState]:
  """AdaGC's statistics as a pure function: the factor of each tensor
  (``norms``, one per tensor; ``norm`` their global norm, both in the
  state's dtype) and the state after the step (see ``adagc``)."""
  dtype = state.gamma.dtype
  finite = jnp.isfinite(norm)
  # Finite steps only: the thresholds need one finite norm to start from.
  warming = state.count - state.nonfinite_count < warmup_steps
  # After the warm-up, a tensor over OUTLIER_RATIO times its threshold, or
  # (non-zero) as far below its gamma, RESTART_AFTER times in a row (a
  # lasting level, a zero warm-up) starts its gamma again from its norm.
  far = ~warming & (running.far_above(
      norms, jnp.asarray(lambda_rel, dtype) * state.gamma) | (
          _core.below(jnp.zeros_like(norms), norms) & running.far_below(norms, state.gamma)))
  far_streak, release = running.streak_of(state.far_streak, far, finite)
  gamma = jnp.where(release, norms, state.gamma)
  factors = jnp.where(warming, scaling.clip_factor(norm, lambda_abs, eps),
                      scaling.clip_factor(
                         norms, jnp.asarray(lambda_rel, dtype) * gamma, eps))
  clipped_norms = factors * norms
  warm_gamma, norm_min, outlier_streak = _warm_up(state, norm, clipped_norms)
  gamma = jnp.where(warming, warm_gamma, jnp.where(
      release, norms, running.ema_mean(
          gamma, clipped_norms, jnp.asarray(beta, dtype))))
  warm_finite = finite & warming
  clipped = jnp.sum(factors < 1, dtype=jnp.int32)
  return factors, AdaGCState(
      gamma=jnp.where(finite, gamma, state.gamma).astype(dtype),
      norm_min=jnp.where(warm_finite, norm_min, state.norm_min).astype(dtype),
      norm=norm.astype(dtype),
      scale=jnp.min(factors, initial=1.0).astype(dtype),
      clipped_tensors=clipped,
      outlier_streak=jnp.where(warm_finite, outlier_streak,
                               state.outlier_streak),
      far_streak=far_streak,
      **counters.step_counts(state, finite=finite, clipped=clipped > 0))


def adagc(*, lambda_abs: Scalar = 1.0, lambda_rel: Scalar = 1.05, beta: Scalar = 0.98,
          warmup_steps: Scalar = 100, eps: Scalar = 0.0, axis_name: AxisName = None,
          specs: PyTree = None, layer_axis: PyTree = None
          ) -> optax.GradientTransformation:
  """Clips each tensor against an EMA of its own clipped norm (AdaGC).

  Gradient ``g``, tensors ``g_i``: in the first ``warmup_steps`` finite
  steps every tensor gets ``h = min(1, lambda_abs / ||g||)`` and ``gamma_i``
  the least ``||h g_i||``; afterwards ``h_i = min(1, lambda_rel * gamma_i /
  ||g_i||)`` and ``gamma_i = beta * gamma_i + (1 - beta) * ||h_i g_i||``
  (``eps > 0``: ``min(1, threshold / (norm + eps))``). NaN/Inf propagates
  and leaves ``gamma`` alone. The paper's numbers, except that no single
  step (an outlier, a lasting shift, a warm-up of zeros) sets the
  thresholds for thousands of steps. Rules, bounds, defaults and injected
  hyperparameters: [docs/guards.md](../guards.md).

  Args:
    lambda_abs: the global threshold during warm-up (>= 0, or inf).
    lambda_rel: the per-tensor threshold relative to ``gamma`` (>= 0).
    beta: EMA smoothing factor for ``gamma`` in [0, 1] (weight of the past).
    warmup_steps: finite steps that clip globally (an int >= 1).
    eps: added to every norm before dividing (>= 0).
    axis_name: under ``shard_map``/``pmap``, the axis name(s) the updates
      are split over (one all-reduce).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree
      prefix); a split layer axis is fine (init with the whole parameters).
    layer_axis: for scanned layers, the axis that stacks them (an int or a
      tree prefix): each layer's slice is a tensor with its own ``gamma``.

  Returns:
    An ``optax.GradientTransformation`` whose state is an ``AdaGCState``;
    ``init`` needs the parameters (or ``jax.ShapeDtypeStruct``s of them).

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip import adagc
    >>> tx = adagc(warmup_steps=1)
    >>> state = tx.init({"a": jnp.zeros(2), "b": jnp.zeros(2)})
    >>> grads = {"a": jnp.array([0.0, 3.0]), "b": jnp.array([0.0, 4.0])}
    >>> _, state = tx.update(grads, state)  # warm-up: global norm 5 -> 1
    >>> state.gamma
    Array([0.6, 0.8], dtype=float32)
    >>> grads = {"a": jnp.array([0.0, 3.0]), "b": jnp.array([0.0, 0.5])}
    >>> updates, state = tx.update(grads, state)  # "a" cut to 1.05 * 0.6
    >>> updates["a"], updates["b"]
    (Array([0.  , 0.63], dtype=float32), Array([0. , 0.5], dtype=float32))

  References:
    Wang et al., [AdaGC: Enhancing LLM Pretraining Stability via Adaptive
    Gradient Clipping](https://arxiv.org/abs/2502.11034), 2025.
  """
  fn = "adagc"
  lambda_abs = _validation.check_nonnegative(fn, "lambda_abs", lambda_abs,
                                             allow_inf=True)
  lambda_rel = _validation.check_nonnegative(fn, "lambda_rel", lambda_rel)
  beta = _validation.check_unit_interval(fn, "beta", beta)
  warmup_steps = _validation.check_integer(fn, "warmup_steps", warmup_steps, 1)
  eps = _validation.check_nonnegative(fn, "eps", eps)
  where = _core.Where.of(fn, axis_name, specs)
  layers = _core.layers(_validation.check_layer_axis(fn, layer_axis))
  settings = {"lambda_abs": lambda_abs, "lambda_rel": lambda_rel,
              "beta": beta, "warmup_steps": warmup_steps, "eps": eps}

  def init_fn(params):
    return AdaGCState.fresh(running.statistics_dtype(params), sum(
        math.prod(shape) for shape in _core.unit_shapes(fn, params, layers)))

  def update_fn(updates, state, params=None):
    del params
    _validation.check_update(fn, updates, state, AdaGCState)
    measured = _core.measure(fn, updates, 2, where, layers)
    _check_tensors(fn, state, measured, layer_axis)
    dtype = state.gamma.dtype  # the statistics' (see init), every step
    norms = measured.units.astype(dtype)
    # The global norm from the per-tensor norms: no second pass over the
    # updates, no second all-reduce, and the same overflow-safe norm.
    norm = _core.norm_of([norms], 2)
    factors, new_state = step(state, norms, norm, **settings)
    return scaling.scale_leaves(updates, measured.to_leaves(factors)), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def _check_tensors(fn: str, state: AdaGCState, measured: _core.Measured,
                   layer_axis: PyTree) -> None:
  """The state has one threshold per tensor of these updates, or an error
  that says which ``init`` to call."""
  tensors, leaves = measured.units.shape[0], len(measured.here())
  if tensors == state.gamma.shape[0]:
    return
  what = (f"{leaves} floating leaves" if layer_axis is None else
          f"{tensors} (layer slices of {leaves} floating leaves)")
  where = ("the whole parameters, outside shard_map (every device keeps "
           "every layer's threshold, and its layers are split here)"
           if measured.split else
           "the parameters (or a tree of the same structure)")
  raise ValueError(
      f"`{fn}`: the state has a threshold for {state.gamma.shape[0]} "
      f"tensors but the updates have {what}; call init with {where}")
