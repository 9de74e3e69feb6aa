"""AdaGC: per-tensor clipping against an EMA of each tensor's clipped norm.

For the first ``warmup_steps`` steps the updates are clipped globally at
``lambda_abs`` while each tensor's threshold ``gamma_i`` tracks the running
minimum of its clipped norm; afterwards tensor ``i`` is clipped at
``lambda_rel * gamma_i`` and ``gamma_i`` becomes an EMA of its clipped norm.
``gamma`` is one float per clippable leaf (per layer slice of leaves that
stack layers, with ``layer_axis``), so the state's shape is fixed by the
tree given to ``init``. A warm-up step whose global norm is an
outlier does not move ``gamma`` (see ``adagc``).
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxclip import (
  _core,
  _counters,
  _running_stats,
  _scaling,
  _stats,
  _validation,
)
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
  """
  gamma: jax.Array
  norm_min: jax.Array
  norm: jax.Array
  scale: jax.Array
  clipped_tensors: jax.Array
  count: jax.Array
  clipped_count: jax.Array
  nonfinite_count: jax.Array

  @classmethod
  def fresh(cls, dtype: jax.typing.DTypeLike, tensors: int) -> "AdaGCState":
    """The state before the first step, for ``tensors`` clippable leaves."""
    return cls(gamma=jnp.full([tensors], jnp.inf, dtype),
               norm_min=jnp.full([], jnp.inf, dtype),
               norm=jnp.zeros([], dtype), scale=jnp.ones([], dtype),
               clipped_tensors=_counters.zero(), count=_counters.zero(),
               clipped_count=_counters.zero(), nonfinite_count=_counters.zero())


def _extras(state: AdaGCState) -> dict[str, jax.Array]:
  return {"gamma_min": jnp.min(state.gamma, initial=jnp.inf),
          "gamma_max": jnp.max(state.gamma, initial=0.0),
          "clip_rate": _counters.clip_rate(state)}


_stats.register(AdaGCState, "adagc", hide=("gamma", "norm_min"), extras=_extras)


def adagc(*, lambda_abs: Scalar = 1.0, lambda_rel: Scalar = 1.05, beta: Scalar = 0.98,
          warmup_steps: Scalar = 100, eps: Scalar = 0.0, axis_name: AxisName = None,
          specs: PyTree = None, layer_axis: PyTree = None
          ) -> optax.GradientTransformation:
  """Clips each tensor against an EMA of its own clipped norm (AdaGC).

  Step ``t`` (counting from 0) with gradient ``g`` and tensors ``g_i``:

  - warm-up (``t < warmup_steps``): every tensor gets the global factor
    ``h = min(1, lambda_abs / ||g||)`` (``clip_by_global_norm``), and
    ``gamma_i = min(gamma_i, ||h g_i||)``, starting from ``+inf``: the
    running minimum of each tensor's clipped norm;
  - afterwards: ``h_i = min(1, lambda_rel * gamma_i / ||g_i||)`` and
    ``gamma_i = beta * gamma_i + (1 - beta) * ||h_i g_i||``.

  Norms are L2 norms of the clippable leaves (one "tensor" per leaf),
  accumulated in float32 (float64 for float64 parameters under x64, so
  that a float64 norm beyond float32's range is clipped, not taken for
  Inf). With ``eps > 0`` every factor is ``min(1, threshold / (norm +
  eps))`` instead. A NaN or Inf norm propagates into the update but leaves
  ``gamma`` unchanged (counted in ``nonfinite_count``). A tensor whose
  gradient is exactly zero during warm-up gets ``gamma_i = 0`` and, as in
  the paper, stays at zero from then on: its updates are zeroed after
  warm-up.

  One outlier step cannot set ``gamma``. In the paper's warm-up one step
  whose global norm is ``X`` times the usual (a spike in one tensor) lowers
  every other tensor's running minimum ``X``-fold, and after the warm-up
  ``gamma`` rises by at most ``beta + (1 - beta) * lambda_rel`` (0.1%) a
  step: ``log(X) / 0.001`` steps of over-clipping, 44,000 for ``X = 1e19``.
  Here a warm-up step whose global norm is more than 100 times the smallest
  global norm of the steps that fed ``gamma`` is clipped but does not feed
  it, and a step more than 100 times below it (as after an outlier that
  was the first step) starts ``gamma`` again from its own clipped norms.
  Ordinary warm-ups (global norms within a factor of 100) give the paper's
  numbers. After the warm-up the EMA is fed clipped norms, at most
  ``lambda_rel * gamma_i``: one outlier of any size moves ``gamma`` by at
  most that much, and a tensor's spike is clipped from the first step.

  Defaults: ``lambda_rel=1.05``, ``beta=0.98`` and a 100-step warm-up are
  the settings of the paper's experiments (and the defaults of the
  ``pytorch_optimizer`` implementation); ``lambda_abs=1.0`` is the usual
  global-clipping threshold, which the paper's warm-up (and its GlobalGC
  baseline) uses. ``eps=0.0`` gives the paper's ``min(1, .)`` exactly. The
  warm-up is the first ``warmup_steps`` finite steps (implementations that
  count steps from 1 and test ``step < warmup_steps``, as ``pytorch_optimizer``
  does, warm up one step fewer). Steps with NaN or Inf gradients do not
  count: a warm-up that saw no finite step would leave every ``gamma_i`` at
  ``+inf`` for good (per-tensor clipping off, and ``0 * inf = NaN`` with
  ``lambda_rel=0`` or ``beta=0``).

  Injected with ``optax.inject_hyperparams``, the hyperparameters are
  checked when ``init`` runs eagerly; traced (a jitted update after a change
  of the state's hyperparameters), ``beta`` is clamped to [0, 1],
  ``warmup_steps`` to at least 1, and a negative ``lambda_abs``,
  ``lambda_rel`` or ``eps`` acts as 0 (NaN as 0 for all of them).

  Args:
    lambda_abs: the global threshold during warm-up (>= 0; ``inf``: no
      clipping in warm-up).
    lambda_rel: the per-tensor threshold relative to ``gamma`` (>= 0).
    beta: EMA smoothing factor for ``gamma`` in [0, 1] (weight of the past).
    warmup_steps: how many steps clip globally (an int >= 1; may be
      injected).
    eps: added to every norm before dividing (>= 0).
    axis_name: under ``shard_map``/``pmap``, the mesh axis name(s) the updates
      are split over: the norms are then those of the whole, unsplit updates,
      with one all-reduce (see ``functional.global_norm``).
    specs: with ``axis_name``, the updates' ``PartitionSpec`` (a tree prefix, as
      ``shard_map``'s ``in_specs``): a leaf replicated on an axis counts once.
      A split layer axis is fine: each device clips its own layers and
      keeps every layer's threshold (init with the whole parameters).
    layer_axis: for scanned (stacked) layers, the axis that stacks them (an
      int, or a tree prefix of the updates with int or None leaves): each
      layer's slice is a tensor of its own, with its own threshold and
      history (``gamma`` has one entry per slice).

  Returns:
    An ``optax.GradientTransformation`` whose state is an ``AdaGCState``;
    ``init`` needs the parameters (or ``jax.ShapeDtypeStruct``s of them) to
    size ``gamma``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optaxclip import adagc
    >>> tx = adagc(warmup_steps=1)
    >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> grads = {"a": jnp.array([0.0, 3.0]), "b": jnp.array([0.0, 4.0])}
    >>> updates, state = tx.update(grads, state)  # warm-up: global norm 5 -> 1
    >>> state.gamma
    Array([0.6, 0.8], dtype=float32)
    >>> grads = {"a": jnp.array([0.0, 3.0]), "b": jnp.array([0.0, 0.5])}
    >>> updates, state = tx.update(grads, state)  # "a" cut to 1.05 * 0.6
    >>> updates["a"], updates["b"]
    (Array([0.  , 0.63], dtype=float32), Array([0. , 0.5], dtype=float32))

    With stacked layers, one threshold per layer:

    >>> tx = adagc(warmup_steps=1, layer_axis=0)
    >>> tx.init({"w": jnp.zeros((3, 4, 4))}).gamma.shape
    (3,)

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

  def init_fn(params):
    return AdaGCState.fresh(_running_stats.statistics_dtype(params), sum(
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
    finite = jnp.isfinite(norm)
    # Finite steps only: the thresholds need one finite norm to start from.
    warming = state.count - state.nonfinite_count < warmup_steps
    global_factor = _scaling.clip_factor(norm, lambda_abs, eps)
    relative = jnp.asarray(lambda_rel, dtype) * state.gamma
    factors = jnp.where(warming, global_factor,
                        _scaling.clip_factor(norms, relative, eps))
    clipped_norms = factors * norms
    # Warm-up: the running minimum, over the steps whose global norm is
    # within OUTLIER_RATIO of the smallest one that fed it.
    restart = _running_stats.far_below(norm, state.norm_min)
    outlier = _running_stats.far_above(norm, state.norm_min)
    warm_gamma = jnp.where(restart, clipped_norms, jnp.where(
        outlier, state.gamma, jnp.minimum(state.gamma, clipped_norms)))
    norm_min = jnp.where(restart, norm, jnp.where(
        outlier, state.norm_min, jnp.minimum(state.norm_min, norm)))
    b = jnp.asarray(beta, dtype)
    gamma = jnp.where(warming, warm_gamma,
                      _running_stats.ema_mean(state.gamma, clipped_norms, b))
    gamma = jnp.where(finite, gamma, state.gamma)
    norm_min = jnp.where(finite & warming, norm_min, state.norm_min)
    clipped = jnp.sum(factors < 1, dtype=jnp.int32)
    new_state = AdaGCState(
        gamma=gamma.astype(dtype), norm_min=norm_min.astype(dtype),
        norm=norm.astype(dtype),
        scale=jnp.min(factors, initial=1.0).astype(dtype),
        clipped_tensors=clipped,
        **_counters.step_counts(state, finite=finite, clipped=clipped > 0))
    return _scaling.scale_leaves(updates, measured.to_leaves(factors)), new_state

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
