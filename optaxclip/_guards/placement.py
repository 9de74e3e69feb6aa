"""Where loss scaling sits in an optimizer state, for every transform to see.

A clipper must see unscaled gradients, and ``skip_step`` must let a loss
scale's back-off stick and judge the unscaled norm: so transforms recognise
loss-scale states (registered here by ``_guards.loss_scale``) without importing
the loss-scale module. Everything here reads only the state's structure:
it is free under ``jit``.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optaxclip import _core, _tree
from optaxclip._stats import registry

PyTree = Any

_LOSS_SCALES: set[type] = set()
_WRAPPERS: set[type] = set()


def register_loss_scale(state_type: type, wrapper_type: type) -> None:
  """Makes ``state_type`` (a loss scale, with a ``scale`` field) known here,
  with the state of its wrapper form ``dynamic_loss_scale(inner)``."""
  _LOSS_SCALES.add(state_type)
  _WRAPPERS.add(wrapper_type)


def is_loss_scale_state(x: Any) -> bool:
  """Whether ``x`` is the state of a loss scale (it has a ``scale``)."""
  return type(x) in _LOSS_SCALES


def find_loss_scale_states(opt_state: Any) -> list[Any]:
  """Every loss-scale state in ``opt_state``, in tree order.

  The search depends only on the state's structure, so it costs nothing
  under ``jit``.
  """
  nodes = jax.tree.leaves(opt_state, is_leaf=is_loss_scale_state)
  return [node for node in nodes if is_loss_scale_state(node)]


def _is_placed(x: Any) -> bool:
  """A loss scaler's or a clipper's state: what ``check_placement`` orders."""
  return (type(x) in _LOSS_SCALES or type(x) in _WRAPPERS or
          registry.is_clipper_state(x))


def _route(tree: PyTree, path: tuple[Any, ...]) -> list[tuple[Any, int]]:
  """``(container, position)`` for each step of ``path`` down ``tree``.

  Positions follow the order updates flow in: a dict's insertion order (that
  of ``optax.named_chain``; JAX would sort the keys), else the tree's.
  """
  route = []
  for key in path:
    children, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x, node=tree: x is not node)  # one level down
    position, child = next((i, c) for i, ((k,), c) in enumerate(children)
                           if k == key)
    if isinstance(tree, dict):
      position = list(tree).index(key.key)
    route.append((tree, position))
    tree = child
  return route


def _comes_before(first: list[Any], second: list[Any]) -> bool:
  """Whether updates flow through ``first`` before ``second`` (two routes)."""
  for depth, ((_, i), (_, j)) in enumerate(zip(first, second)):
    if i != j:  # the labels of optax.partition are parallel, not in a row
      parallel = depth > 0 and isinstance(first[depth - 1][0],
                                          optax.PartitionState)
      return i < j and not parallel
  return False


# Wrappers that must not hold the loss scaling, and why.
_NOT_AROUND = {
    optax.MultiStepsState: (
        "optax.MultiSteps, whose accumulator would then sum scaled gradients: "
        "one overflow makes it NaN for good (MultiSteps resets it by "
        "multiplying by 0). Let the loss scaling accumulate, "
        "optaxclip.dynamic_loss_scale(optimizer, every_k_steps=k) "
        "(PyTorch's GradScaler), or put it outside: "
        "optaxclip.dynamic_loss_scale(optax.MultiSteps(optimizer, k))"),
    optax.ApplyIfFiniteState: (
        "optax.apply_if_finite, which rolls the scale's back-off back on an "
        "overflow, so the next steps overflow again. dynamic_loss_scale "
        "drops overflowed steps itself: put apply_if_finite inside, "
        "optaxclip.dynamic_loss_scale(optax.apply_if_finite(optimizer, n)), "
        "or leave it out"),
}


def check_placement(opt_state: Any, where: str, root: str = "opt_state") -> None:
  """Raises where the loss scaling sits in ``opt_state`` gives wrong updates.

  After an optaxclip clipper (outside the scaler's own ``inner``), the clipper
  saw scaled gradients; inside ``optax.MultiSteps`` or
  ``optax.apply_if_finite``, see ``_NOT_AROUND``. Structure only:
  free under ``jit``. ``where`` and ``root`` name the caller and the state
  in the message.
  """
  found, _ = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_placed)
  placed = [(path, node, _route(opt_state, path))
            for path, node in found if _is_placed(node)]
  for path, node, route in placed:
    if registry.is_clipper_state(node):
      continue
    at = f"{root}{jax.tree_util.keystr(path)}"
    for container, _ in route:
      if type(container) in _NOT_AROUND:
        raise ValueError(f"`{where}`: dynamic_loss_scale's state ({at}) is "
                         f"inside {_NOT_AROUND[type(container)]}")
    for clip_path, clipper, clip_route in placed:
      if registry.is_clipper_state(clipper) and _comes_before(clip_route, route):
        raise ValueError(
            f"`{where}`: the clipper state {type(clipper).__name__} at "
            f"{root}{jax.tree_util.keystr(clip_path)} comes before "
            f"dynamic_loss_scale's state ({at}), so the clipper sees the "
            f"scaled gradients (loss scale times too large) and clips them "
            f"wrongly. Put the loss scaling first: optax.chain("
            f"optaxclip.dynamic_loss_scale(...), clipper, optimizer), or "
            f"optaxclip.dynamic_loss_scale(optax.chain(clipper, optimizer))")


def multisteps_finite(updates: PyTree, inner_state: Any,
                      axis_name: Any = None) -> jax.Array:
  """Whether ``optax.MultiSteps``' proposed step is finite (True, nothing
  read, when ``inner_state`` is not a ``MultiStepsState``).

  A wrapper judges each micro-batch; MultiSteps' own accumulator can still
  overflow from finite ones (a sum, or the mean's ``grad - acc``), and its
  optimizer would take that Inf. Judged: the proposed updates, the
  accumulator as the optimizer gets it (cast to the updates' dtype) and the
  optimizer's state: one read of each, on every micro-batch, and only
  around MultiSteps (read from the state's type at trace time).
  """
  if not isinstance(inner_state, optax.MultiStepsState):
    return jnp.asarray(True)
  received = inner_state.acc_grads
  if jax.tree.structure(received) == jax.tree.structure(updates):
    received = jax.tree.map(
        lambda a, u: a.astype(u.dtype) if _tree.is_clippable(a)
        and _tree.is_clippable(u) else a, received, updates)
  return _core.all_finite((updates, received, inner_state.inner_opt_state),
                          axis_name=axis_name)
