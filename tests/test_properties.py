"""Invariants of clipping, checked on random trees with hypothesis."""

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import optaxclip as oc

F = oc.functional
SHAPES = [(3,), (2, 4)]  # one tree structure: each new one costs a compile
ORDERS = [1.0, 2.0, 3.0, math.inf]
SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def trees(draw):
  exponent = draw(st.integers(-6, 6))  # magnitudes 1e-6 .. 1e6
  leaves = []
  for shape in SHAPES:
    values = draw(hnp.arrays(np.float32, shape, elements=st.floats(
        -10, 10, width=32, allow_subnormal=False)))
    values = values * np.float32(10.0 ** exponent)
    # XLA on CPU flushes subnormals to zero; keep clear of that range.
    values[np.abs(values) < 1e-30] = 0
    leaves.append(jnp.asarray(values))
  return leaves


# 0, or 2**-20..1e5: a factor below the smallest normal float (max_norm under
# ~1e-38 times the norm) flushes to zero, a documented limit.
thresholds = st.one_of(st.just(0.0),
                        st.floats(2.0**-20, 1e5, width=32))


@functools.cache
def jitted(fn, ord):
  return jax.jit(lambda tree, max_norm: fn(tree, max_norm, ord=ord))


@functools.cache
def norm_fn(ord):
  return jax.jit(lambda tree: F.global_norm(tree, ord))


@SETTINGS
@given(trees(), thresholds, st.sampled_from(ORDERS), st.sampled_from([0.0, 1e-6]))
def test_global_clip_bounds_norm_keeps_direction_and_is_a_no_op_below(tree, max_norm, ord, eps):
  clip = jitted(functools.partial(F.clip_by_global_norm, eps=eps), ord)
  clipped, norm = clip(tree, max_norm)
  after = norm_fn(ord)(clipped)
  assert after <= max_norm * (1 + 1e-6) + 1e-30
  if norm + eps <= max_norm:
    for a, b in zip(clipped, tree):
      np.testing.assert_array_equal(a, b)
  factor = min(1.0, max_norm / (float(norm) + eps)) if norm > 0 else 1.0
  for a, b in zip(clipped, tree):  # one common factor: direction preserved
    np.testing.assert_allclose(a, np.asarray(b) * factor, rtol=2e-6, atol=1e-37)


@SETTINGS
@given(trees(), thresholds, st.sampled_from(ORDERS))
def test_per_leaf_clip_bounds_each_leaf(tree, max_norm, ord):
  clipped = jitted(F.clip_by_norm, ord)(tree, max_norm)
  for a, b in zip(clipped, tree):
    norm = float(norm_fn(ord)(b))
    assert norm_fn(ord)(a) <= max_norm * (1 + 1e-6) + 1e-30
    if norm <= max_norm:
      np.testing.assert_array_equal(a, b)
    else:
      np.testing.assert_allclose(a, np.asarray(b) * (max_norm / norm), rtol=2e-6,
                                 atol=1e-37)


@SETTINGS
@given(trees(), st.floats(-1e3, 1e3, width=32, allow_subnormal=False),
       st.floats(0, 1e3, width=32, allow_subnormal=False))
def test_value_clip_is_numpy_clip(tree, low, width):
  high = low + width
  clipped = jax.jit(F.clip_by_value)(tree, high, low)
  for a, b in zip(clipped, tree):
    np.testing.assert_array_equal(a, np.clip(np.asarray(b), np.float32(low), np.float32(high)))
