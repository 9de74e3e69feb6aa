"""clip_by_value (the transform and ``functional.clip_by_value``): every
element clipped to ``[min_value, max_value]`` (``[-max_value, max_value]``
by default), as ``numpy.clip``.

Elsewhere: test_contract.py, test_errors.py (bounds and complex leaves),
test_arguments.py (traced bounds, inf, Python floats, ``state=None``),
test_parity.py (PyTorch's clip_grad_value_, TensorFlow's clip_by_value and
optax.clip, exactly), test_fuzz.py.
"""

import jax
import numpy as np
from fuzzing import SMALL_SETTINGS, small_trees
from hypothesis import given
from hypothesis import strategies as st

import optaxclip as oc

F = oc.functional


@SMALL_SETTINGS
@given(small_trees(), st.floats(-1e3, 1e3, width=32, allow_subnormal=False),
       st.floats(0, 1e3, width=32, allow_subnormal=False))
def test_value_clip_is_numpy_clip(tree, low, width):
  high = low + width
  clipped = jax.jit(F.clip_by_value)(tree, high, low)
  for a, b in zip(clipped, tree):
    np.testing.assert_array_equal(a, np.clip(np.asarray(b), np.float32(low), np.float32(high)))
