"""Structural arguments: static Python values, whatever a factory calls them.

The axes norms keep (``layer_axis``, ``expert_axis``, AGC's ``axis``),
labels (``groups``), masks, mesh axes and modes decide the program's shape,
so they must reach a builder as Python values. ``optax.inject_hyperparams``
turns every number it is given into an array and calls every callable not
in ``static_args`` as a schedule of the step count, under whatever name the
user's factory gives them; ``check_static`` refuses what that produces with
an error naming the argument and ``static_args``.
"""

import numbers
import os
import sys
from typing import Any

import jax
import numpy as np
from jax.core import Tracer


def argument(fn: str, arg: str) -> str:
  """How errors name an argument: ```fn(arg=...)```."""
  return f"`{fn}({arg}=...)`"


def is_traced(value: Any) -> bool:
  """Whether ``value`` is a tracer, whose value is unknown until run time."""
  return isinstance(value, Tracer)


def is_layer_axis(x: Any) -> bool:
  """Whether ``x`` may be a leaf of ``layer_axis``: an int or None."""
  return x is None or (isinstance(x, numbers.Integral)
                       and not isinstance(x, (bool, np.bool_)))


# optax.inject_hyperparams builds the transform inside these functions of
# schedules/_inject.py, with the factory's arguments in `hparams` and the
# scheduled ones' names in `sched_hps` (tests/test_arguments.py pins both).
_INJECT_FUNCTIONS = ("init_fn", "update_fn")
_INJECT_FILE = os.path.join("schedules", "_inject.py")


def _injected() -> tuple[dict[str, Any], set[str]]:
  """What ``optax.inject_hyperparams`` passes to the factory that is
  building a transform now (argument -> value), and the names it computed
  by calling them as schedules; empty outside inject_hyperparams.

  Reading a private frame only ever adds an error: if optax renames these,
  nothing is found and only arrays are refused.
  """
  frame = sys._getframe(1)
  for _ in range(24):  # the checks, the builder, a user's factory and wrappers
    if frame is None:
      break
    code = frame.f_code
    if code.co_name in _INJECT_FUNCTIONS and code.co_filename.endswith(_INJECT_FILE):
      hparams, scheduled = frame.f_locals.get("hparams"), frame.f_locals.get("sched_hps")
      if isinstance(hparams, dict) and isinstance(scheduled, dict):
        return hparams, set(scheduled)
      break
    frame = frame.f_back
  return {}, set()


def _is_number(value: Any) -> bool:
  """Whether ``value`` can be what a schedule of the step count returns."""
  return isinstance(value, (jax.Array, np.ndarray, np.generic)) or (
      isinstance(value, numbers.Number) and not isinstance(value, bool))


def check_static(fn: str, arg: str, value: Any, expected: str) -> None:
  """A structural argument (the axes norms keep, labels, mesh axes, modes):
  static Python values, else a TypeError naming ``arg`` and ``static_args``.

  ``optax.inject_hyperparams`` rebuilds the transform with every number it
  was given as an array and every callable not in ``static_args`` replaced
  by what it returns for the step count, under whatever name the user's
  factory gives them. So refused are: an array or tracer anywhere in
  ``value``; a value (or leaf) that is one inject_hyperparams scheduled; and,
  while it builds the transform, any scheduled value that is not a number
  (a callable of the gradients called on a count), wherever it goes.
  """
  hparams, scheduled = _injected()
  for part in [value, *jax.tree.leaves(value, is_leaf=lambda x: x is None)]:
    name = next((k for k, v in hparams.items() if v is part), None)
    if name in scheduled and part is not None and not isinstance(part, bool):
      raise TypeError(
          f"{argument(fn, arg)} must be static Python values ({expected}), got "
          f"{part!r:.60}, what optax.inject_hyperparams computed by calling "
          f"`{name}` as a schedule of the step count (it calls every callable "
          f"not in static_args); list it in static_args=({name!r},)")
    if isinstance(part, (jax.Array, np.ndarray)):
      fix = (f"optax.inject_hyperparams passes `{name}` as an array: list it "
             f"in static_args=({name!r},)" if name else
             "under optax.inject_hyperparams, list the factory's argument that "
             "carries it in static_args")
      raise TypeError(
          f"{argument(fn, arg)} must be static Python values ({expected}), got "
          f"{'a traced' if is_traced(part) else 'an'} array {part!r:.60}; {fix}")
  for name in sorted(scheduled):
    if not _is_number(hparams.get(name)):
      raise TypeError(
          f"`{fn}`: optax.inject_hyperparams called `{name}` as a schedule of "
          f"the step count (it calls every callable not in static_args) and got "
          f"{hparams.get(name)!r:.60}, not a number. A callable of the gradients "
          f"(as `layer_axis=` or `groups=`) or any structural argument must "
          f"reach {fn} as static Python values: list it in "
          f"static_args=({name!r},)")


def check_layer_axis(fn: str, layer_axis: Any, arg: str = "layer_axis",
                     stacks: str = "layers") -> Any:
  """``layer_axis`` (or ``arg``, an axis that stacks ``stacks``): None, an
  int, a tree prefix with int or None leaves, or a callable returning one;
  whether it fits the gradients is only known at ``update``."""
  check_static(fn, arg, layer_axis,
               "ints or None, or a callable of the gradients returning them")
  if callable(layer_axis):
    return layer_axis
  for axis in jax.tree.leaves(layer_axis, is_leaf=is_layer_axis):
    if not is_layer_axis(axis):
      raise TypeError(
          f"{argument(fn, arg)} must hold ints (the axis that stacks "
          f"{stacks}) or None, got {axis!r:.80} of type {type(axis).__name__}")
  return layer_axis


def check_expert_axis(fn: str, expert_axis: Any) -> Any:
  """``expert_axis``: as ``layer_axis``, the axis that stacks experts."""
  return check_layer_axis(fn, expert_axis, "expert_axis", "experts")


def check_stack_axes(fn: str, expert_axis: Any, layer_axis: Any
                     ) -> tuple[Any, Any]:
  """``(expert_axis, layer_axis)``, both checked (``_core.experts``'s)."""
  return check_expert_axis(fn, expert_axis), check_layer_axis(fn, layer_axis)


def check_mask(fn: str, mask: Any) -> Any:
  """``mask``: None, a tree prefix of the gradients with bool leaves (as
  ``optax.masked``'s), or a callable returning one; static."""
  check_static(fn, "mask", mask, "bools, or a callable of the gradients "
               "returning them")
  if mask is None or (callable(mask) and not isinstance(mask, jax.Array)):
    return mask
  for leaf in jax.tree.leaves(mask):
    if not isinstance(leaf, (bool, np.bool_)):
      raise TypeError(
          f"{argument(fn, 'mask')} must hold Python bools (True: the leaf is "
          f"measured and clipped, False: left out of both), as "
          f"optax.masked's mask; it chooses which leaves take part and must "
          f"be static (with optax.inject_hyperparams list it in static_args: "
          f"static_args=('mask',)), got {leaf!r:.80} of type "
          f"{type(leaf).__name__}")
  return mask
