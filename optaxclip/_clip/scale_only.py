"""``scale_only``: leaves a global norm measures but does not scale.

``clip_by_global_norm(max_norm, scale_only=...)`` measures the norm of every
leaf and multiplies only the leaves marked True by the factor; the others
pass through as they came (bit for bit). This is what an optimizer that
rescales some leaves itself needs: ``optax.contrib.muon`` orthogonalises its
matrices, so a clip factor on them does nothing but push them towards
Newton-Schulz's ``eps``, while their size still belongs in the norm that
sets the factor for the Adam-handled leaves (docs/muon.md). ``mask``, by
contrast, leaves leaves out of the norm as well.

``scale_only`` is a tree prefix of the gradients with bool leaves, or a
callable from the gradients to one; it is static (it chooses the program).
``nonfinite="zero"`` still zeroes every leaf of a step whose norm is NaN or
Inf: the step is dropped, not only its scaled part.
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from optaxclip import _tree, _validation
from optaxclip._types import PyTree

# A tree prefix of bools, or a callable from the gradients to one.
ScaleOnly = Callable[[PyTree], PyTree] | PyTree

_ARG = "scale_only"
_LIKE = ("a tree prefix of the gradients with bool leaves (True: scaled), "
         "or a callable returning one")


def _is_flag(x: Any) -> bool:
  return isinstance(x, (bool, np.bool_))


def _check_flag(fn: str, flag: Any) -> None:
  if isinstance(flag, (jax.Array, np.ndarray)):
    raise TypeError(
        f"`{fn}({_ARG}=...)` chooses which leaves are scaled and must be "
        f"static: Python bools, not arrays (with optax.inject_hyperparams list "
        f"it in static_args=({_ARG!r},)), got {flag!r:.80}")
  if not _is_flag(flag):
    raise TypeError(
        f"`{fn}({_ARG}=...)` must hold bools (True: the leaf is scaled), got "
        f"{flag!r:.80} of type {type(flag).__name__}")


def check(fn: str, scale_only: Any) -> Any:
  """``scale_only``: None, a callable, or a tree of bools (else a TypeError
  when the transform is built; whether it fits the gradients is known at
  ``init``)."""
  _validation.check_static(fn, _ARG, scale_only,
                           "bools, a tree prefix of them, or a callable")
  if scale_only is None or (callable(scale_only)
                            and not isinstance(scale_only, jax.Array)):
    return scale_only
  for flag in jax.tree.leaves(scale_only, is_leaf=_is_flag):
    _check_flag(fn, flag)
  return scale_only


def flags(fn: str, tree: PyTree, scale_only: Any) -> list[bool] | None:
  """Whether each clippable leaf of ``tree`` is scaled, in tree order
  (None: every leaf is)."""
  if scale_only is None:
    return None
  prefix = scale_only(tree) if callable(scale_only) else scale_only
  for flag in jax.tree.leaves(prefix, is_leaf=_is_flag):
    _check_flag(fn, flag)
  per_leaf = _tree.broadcast_prefix(fn, _ARG, prefix, tree, is_value=_is_flag,
                                    holds="bools (True: the leaf is scaled)",
                                    like=_LIKE)
  return [bool(flag) for flag, x in zip(per_leaf, jax.tree.leaves(tree))
          if _tree.is_clippable(x)]
