"""``stats``: every optaxclip statistic in an optimizer state, flat for a logger.

Each optaxclip state class registers a short name (``"clip"`` for
``ClipState``) and how to summarise it. ``stats`` walks any optax state
(``chain``, ``named_chain``, ``masked``, ``partition``, ``MultiSteps``,
``inject_hyperparams``, ...) and names each statistic
``[<dict keys on the way>/]<name>[_<k>]/<field>``: the dictionary keys that
lead to the state (``named_chain`` and ``partition`` labels) come first, and
the ``k``-th repeat of the same name (counting from 1) gets a suffix.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

Summary = Callable[[Any], dict[str, jax.Array]]
_REGISTRY: dict[type, tuple[str, Summary]] = {}
_CLIPPERS: set[type] = set()


def register(state_type: type, name: str, summary: Summary | None = None, *,
             hide: tuple[str, ...] = (), extras: Summary | None = None,
             clips: bool = True) -> None:
  """Makes ``stats`` report states of ``state_type`` under ``name``.

  The statistics of a state are its fields, less those in ``hide``
  (bookkeeping), followed by ``extras(state)`` (derived ones, such as a
  rate); or, when given, ``summary(state)`` in place of all that.
  ``clips``: the transform rescales gradients by what it measures, so it must
  see unscaled ones (``dynamic_loss_scale`` checks that none comes first).
  """
  def derived(state: Any) -> dict[str, jax.Array]:
    # A field that is None holds nothing this configuration measures.
    fields = {k: v for k, v in state._asdict().items()
              if k not in hide and v is not None}
    return {**fields, **(extras(state) if extras else {})}

  _REGISTRY[state_type] = (name, summary or derived)
  if clips:
    _CLIPPERS.add(state_type)


def summary(state: Any) -> dict[str, jax.Array]:
  """The statistics ``stats`` reports for one registered state."""
  return _REGISTRY[type(state)][1](state)


def is_clipper_state(x: Any) -> bool:
  """Whether ``x`` is the state of a registered transform that clips."""
  return type(x) in _CLIPPERS


def _is_registered(x: Any) -> bool:
  return type(x) in _REGISTRY


def _dict_keys(path: tuple[Any, ...]) -> list[str]:
  return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]


def stats(opt_state: optax.OptState) -> dict[str, jax.Array]:
  """Every optaxclip statistic in ``opt_state``, as flat scalar entries.

  Works on any (chained, nested, wrapped) optax state, eagerly or under
  ``jit``; the keys depend only on the optimizer's structure, so they are
  the same every step.

  Args:
    opt_state: an optax optimizer state.

  Returns:
    A dict from names such as ``"clip/norm"`` to scalar arrays.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optaxclip as oc
    >>> tx = optax.chain(oc.clip_by_global_norm(1.0), optax.adam(1e-3))
    >>> params = {"w": jnp.ones(4)}
    >>> _, state = tx.update(params, tx.init(params), params)
    >>> print(*sorted(oc.stats(state)))
    clip/clip_rate clip/clipped_count clip/count clip/floor_count clip/min_scale
    clip/nonfinite_count clip/norm clip/scale
    >>> oc.stats(state)["clip/norm"]
    Array(2., dtype=float32)
  """
  found, _ = jax.tree_util.tree_flatten_with_path(opt_state,
                                                  is_leaf=_is_registered)
  result: dict[str, jax.Array] = {}
  seen: dict[str, int] = {}
  for path, node in found:
    if not _is_registered(node):
      continue
    name, summary = _REGISTRY[type(node)]
    prefix = "/".join(_dict_keys(path) + [name])
    repeat = seen.get(prefix, 0)
    seen[prefix] = repeat + 1
    if repeat:
      prefix = f"{prefix}_{repeat}"
    for field, value in summary(node).items():
      # jnp.asarray unwraps containers such as flax.nnx's OptArray.
      result[f"{prefix}/{field}"] = jnp.asarray(value)
  return result
