"""``microbatch_guard``: bad micro-batches never reach ``optax.MultiSteps``.

``optax.MultiSteps`` averages ``k`` micro-batches in an accumulator before
each optimizer step, and resets the accumulator by multiplying it by 0. A
micro-batch with NaN or Inf stays in it for good (``0 * NaN`` is NaN): a
guard around the optimizer inside (``skip_step``, ``apply_if_finite``) then
skips every later window, for ever. The accumulator must never see such a
micro-batch. ``MultiSteps`` asks its ``should_skip_update_fn`` about every
micro-batch before adding it, and ``microbatch_guard()`` is one: a
micro-batch whose global norm is NaN or Inf (or above ``max_norm``) is
dropped as if it had never come, and the window waits for the next good one.

The guard sees the micro-batch only, never the accumulator: finite
micro-batches whose sum (or the mean's ``grad - acc``) overflows would still
reach the optimizer as Inf. ``skip_step(optax.MultiSteps(...))`` (the guard
inside or not) catches that too: it judges each micro-batch and MultiSteps'
proposed step, and rolls the whole ``MultiSteps`` state (the accumulator
included) back on a bad one.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optaxclip import _core, _validation
from optaxclip._stats import registry
from optaxclip._types import AxisName, Ord, Scalar

PyTree = Any


class MicrobatchGuardState(NamedTuple):
  """The last micro-batch as ``microbatch_guard`` saw it.

  ``MultiSteps`` keeps it as ``MultiStepsState.skip_state``. It gives the
  predicate no memory, so these describe the last micro-batch only: sum
  ``skipped`` over steps to count the dropped ones.

  Attributes:
    norm: float32 ``[]``: the global norm of the last micro-batch.
    skipped: bool ``[]``: whether it was dropped.
  """
  norm: jax.Array
  skipped: jax.Array


registry.register(MicrobatchGuardState, "microbatch", clips=False)

ShouldSkip = Callable[[PyTree, jax.Array, PyTree],
                      tuple[jax.Array, MicrobatchGuardState]]


def microbatch_guard(*, max_norm: Scalar | None = None, ord: Ord = 2,
                     axis_name: AxisName = None) -> ShouldSkip:
  """A ``should_skip_update_fn`` for ``optax.MultiSteps``: drops bad micro-batches.

  A micro-batch is dropped (``MultiSteps`` neither accumulates nor counts
  it) when its global norm is NaN or Inf, or above ``max_norm``. The norm is
  optaxclip's overflow-safe one: finite gradients of any size give a finite
  norm, so only NaN or Inf gradients count as non-finite. Use as::

    optax.MultiSteps(optax.chain(clip_by_global_norm(1.0), optax.adamw(1e-3)),
                     every_k_schedule=4, should_skip_update_fn=microbatch_guard())

  With loss scaling, wrap the whole of it, ``dynamic_loss_scale(
  optax.MultiSteps(...))``: the guard then judges unscaled micro-batches.
  It never sees MultiSteps' accumulator, whose sum of finite micro-batches
  can overflow: ``skip_step(optax.MultiSteps(...))`` or the loss scale
  around it drops such a micro-batch.

  Args:
    max_norm: drop micro-batches whose global norm exceeds it (a number,
      at least 0), or None.
    ord: the norm order: any number ``p > 0`` or ``inf``.
    axis_name: under ``shard_map``/``pmap``, the axis name(s) the gradients
      are split over: every device takes the same decision.

  Returns:
    A function ``(updates, gradient_step, params) -> (should_skip,
    MicrobatchGuardState)``; its state shows in ``optaxclip.stats`` as
    ``microbatch/norm`` and ``microbatch/skipped``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optaxclip as oc
    >>> tx = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2,
    ...                       should_skip_update_fn=oc.microbatch_guard())
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for g in (1.0, jnp.nan, 3.0):  # the NaN micro-batch is dropped
    ...   updates, state = tx.update({"w": jnp.full(2, g)}, state, params)
    >>> updates["w"], state.gradient_step
    (Array([-2., -2.], dtype=float32), Array(1, dtype=int32))
  """
  fn = "microbatch_guard"
  if max_norm is not None:
    max_norm = _validation.check_nonnegative(fn, "max_norm", max_norm,
                                             allow_inf=True)
  p = _validation.check_ord(fn, ord)
  where = _core.Where.of(fn, axis_name)

  def should_skip(updates, gradient_step, params=None):
    del gradient_step, params
    _validation.check_tree(fn, "updates", updates)
    norm = _core.measure(fn, updates, p, where).total
    skip = ~jnp.isfinite(norm)  # decided in the norm's own (wider) dtype
    if max_norm is not None:
      skip = skip | _core.below(jnp.asarray(max_norm, norm.dtype), norm)
    return skip, MicrobatchGuardState(norm=norm.astype(jnp.float32), skipped=skip)

  return should_skip
