"""``mask=``: leaves kept out of a norm and out of the clip (a frozen router).

A mask is what ``optax.masked`` takes: a tree prefix of the gradients with
bool leaves, or a callable of the gradients (of the params at ``init``)
returning one. Where it is False a leaf becomes ``optax.MaskedNode``, an
empty subtree the core never sees, before the transform runs, and is put
back as it was after it: ``clip_by_global_norm(1.0, mask=m)`` is
``optax.masked(clip_by_global_norm(1.0), m)`` with the clipper's own state
(``optaxclip.stats`` reads it the same), and gives the same numbers.
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from optaxclip import _tree, _validation
from optaxclip._types import PyTree

Mask = PyTree | Callable[[PyTree], PyTree] | None


def _is_bool(x: Any) -> bool:
  return isinstance(x, (bool, np.bool_))


def chosen(fn: str, mask: Mask, tree: PyTree) -> PyTree:
  """The mask for ``tree``: ``mask``, or what it returns for ``tree``."""
  if callable(mask) and tree is not None:
    mask = mask(tree)
    _validation.check_mask(fn, mask)
  return mask


def leave_out(fn: str, mask: PyTree, tree: PyTree
              ) -> tuple[PyTree, Callable[[PyTree], PyTree]]:
  """``(inside, put_back)``: ``tree`` with a ``MaskedNode`` for every leaf
  ``mask`` (a tree of bools: ``chosen``) leaves out, and a function putting
  those leaves back into a tree shaped as ``inside`` (a transform's
  output)."""
  if mask is None or tree is None:
    return tree, lambda out: out
  keep = _tree.broadcast_prefix(
      fn, "mask", mask, tree, is_value=_is_bool, holds="bools",
      like="a bool or a tree prefix of the gradients with bool leaves (as "
           "optax.masked's mask)")
  leaves, treedef = jax.tree.flatten(tree)
  if all(keep):
    return tree, lambda out: out
  inside = treedef.unflatten([x if k else optax.MaskedNode()
                              for x, k in zip(leaves, keep)])

  def put_back(out: PyTree) -> PyTree:
    done = treedef.flatten_up_to(out)
    return treedef.unflatten([y if k else x
                              for x, y, k in zip(leaves, done, keep)])
  return inside, put_back


def kept_part(fn: str, mask: Mask, tree: PyTree) -> Callable[[PyTree], PyTree]:
  """The leaves of a tree shaped as ``tree`` that ``mask`` (for ``tree``)
  keeps: ``MaskedNode`` for the others."""
  mask_tree = chosen(fn, mask, tree)
  return lambda like: leave_out(fn, mask_tree, like)[0]


def masked(fn: str, inner: optax.GradientTransformation, mask: Mask
           ) -> optax.GradientTransformationExtraArgs:
  """``inner`` run on the leaves ``mask`` keeps (its state its own); the
  others pass through untouched, bit for bit (``mask``: checked, not None)."""
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return inner.init(leave_out(fn, chosen(fn, mask, params), params)[0])

  def update_fn(updates, state, params=None, **extra_args):
    mask_tree = chosen(fn, mask, updates)  # as optax.masked: of the updates
    inside, put_back = leave_out(fn, mask_tree, updates)
    out, new_state = inner.update(
        inside, state, leave_out(fn, mask_tree, params)[0], **extra_args)
    return put_back(out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
