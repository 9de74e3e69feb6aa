"""Helpers for the tests of running statistics (zclip, skip_step, adagc,
auto_clip): gradients with given norms, one outlier, and compiled runs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

OUTLIER_SIZES = [1e3, 1e10, 2e19, 3e38]  # multiples of the usual norm (~1)
SPIKE = 1e6  # the probe: a spike every transform must catch again


def over_outlier_sizes(test):
  """Runs ``test(..., size)`` for outlier sizes from 1e3 to 3e38: a few drawn
  by hypothesis and always the four sizes of ``OUTLIER_SIZES``."""
  for size in OUTLIER_SIZES:
    test = example(size=size).via("the sizes of the issue")(test)
  return settings(max_examples=6, deadline=None)(
      given(size=st.floats(1e3, 3e38))(test))


def ordinary_norms(steps, seed=0):
  """Norms around 1 with 10% noise."""
  return 1.0 + 0.1 * np.random.default_rng(seed).standard_normal(steps)


def trees_with_norms(norms, seed=3):
  """Float32 gradient trees stacked over steps, with the given global norms."""
  rng = np.random.default_rng(seed)
  w, b = rng.normal(size=8), rng.normal(size=4)
  length = np.sqrt(np.sum(w ** 2) + np.sum(b ** 2))
  n = np.asarray(norms, np.float64)[:, None]
  return {"w": jnp.asarray(n * w / length, jnp.float32),
          "b": jnp.asarray(n * b / length, jnp.float32)}


@functools.cache
def scan_of(tx):
  """A compiled run of ``tx`` over stacked gradients: every step's output."""
  def run(grads):
    params = jax.tree.map(lambda g: jnp.ones_like(g[0]), grads)

    def step(state, g):
      updates, state = tx.update(g, state, params)
      return state, (updates, state)

    return jax.lax.scan(step, tx.init(params), grads)[1]

  return jax.jit(run)


def norms_with_outlier(size, at, probe, seed=0):
  """Ordinary norms with ``size`` at step ``at`` and ``SPIKE`` at ``probe``."""
  norms = ordinary_norms(probe + 1, seed)
  norms[at] *= size
  norms[probe] *= SPIKE
  return norms


def assert_finite(*arrays):
  for x in arrays:
    assert np.all(np.isfinite(np.asarray(x))), x


def outlier_step(where, warmup):
  return {"first": 0, "warm-up": warmup // 2, "after": warmup + 2}[where]


def gradients_through_updates(tx, steps=6):
  """``jax.grad`` of a weighted sum of ``steps`` updates of ``tx`` with
  respect to the gradients, for each history of ``HISTORIES``: zero
  gradients, a constant norm (the statistics' variance is 0), and a
  constant norm then zero."""
  params = {"w": jnp.ones(3), "b": jnp.ones(2)}
  weights = {"w": jnp.arange(1.0, 4.0), "b": jnp.arange(4.0, 6.0)}

  def loss(grads):
    def step(state, g):
      updates, state = tx.update(g, state, params)
      return state, sum(jnp.sum(u * c) for u, c in zip(
          jax.tree.leaves(updates), jax.tree.leaves(weights)))
    return jnp.sum(jax.lax.scan(step, tx.init(params), grads)[1])

  gradient = jax.jit(jax.grad(loss))
  return {name: gradient(jax.tree.map(
      lambda p: jnp.stack([p * per_step(k) for k in range(steps)]), params))
      for name, per_step in HISTORIES.items()}


HISTORIES = {"zero": lambda k: 0.0, "constant": lambda k: 3.0,
             "constant_then_zero": lambda k: 0.0 if k == 5 else 0.25}
