"""optaxclip inside the JAX ecosystem: Flax (NNX, Linen scan, Linen TrainState),
Equinox, Orbax checkpoints, and optax's wrappers (MultiSteps,
inject_hyperparams, masked, partition, named_chain).

Each test trains a few steps of a tiny model and checks the clipping and
``optaxclip.stats`` against values computed independently.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import CLIP_KEYS, keys, np_norm

import optaxclip as oc


def regression_data(n=32, d_in=4, d_out=2, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (n, d_in))
  # Large targets: the gradients start well above the clip threshold.
  y = 2.0 * x @ jax.random.normal(kw, (d_in, d_out))
  return x, y


def assert_norm_of(stats, prefix, grads):
  np.testing.assert_allclose(stats[f"{prefix}/norm"],
                             oc.functional.global_norm(grads), rtol=1e-6)


# --------------------------------------------------------------------- Flax NNX

def test_flax_nnx_optimizer():
  nnx = pytest.importorskip("flax.nnx")

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(4, 16, rngs=rngs)
      self.l2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x)))

  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
      model, optax.chain(oc.clip_by_global_norm(1.0), optax.adamw(1e-2)),
      wrt=nnx.Param)
  x, y = regression_data()

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      return jnp.mean((model(x) - y) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, grads, oc.stats(nnx.as_pure(optimizer.opt_state))

  steps = 15
  losses = []
  for _ in range(steps):
    loss, grads, jit_stats = train_step(model, optimizer, x, y)
    losses.append(float(loss))
  assert losses[-1] < 0.9 * losses[0]
  stats = oc.stats(nnx.as_pure(optimizer.opt_state))
  assert set(stats) == keys("clip", CLIP_KEYS)
  assert int(stats["clip/count"]) == steps
  assert int(stats["clip/clipped_count"]) == steps  # gradients start large
  assert_norm_of(stats, "clip", grads)
  assert float(stats["clip/norm"]) > 1.0
  for k in stats:
    np.testing.assert_array_equal(jit_stats[k], stats[k])


def test_flax_nnx_raw_opt_state_stats_are_arrays():
  """``oc.stats`` on nnx's opt_state as it is (without ``nnx.as_pure``).

  flax 0.12 keeps every optax leaf in an ``nnx.OptArray`` Variable; stats
  unwraps them, so the documented ``dict[str, jax.Array]`` holds either way.
  """
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
      model, optax.chain(oc.clip_by_global_norm(1.0), optax.adamw(1e-2)),
      wrt=nnx.Param)
  raw = oc.stats(optimizer.opt_state)
  pure = oc.stats(nnx.as_pure(optimizer.opt_state))
  assert set(raw) == set(pure) == keys("clip", CLIP_KEYS)
  for k in pure:
    np.testing.assert_array_equal(np.asarray(raw[k]), pure[k])
    assert isinstance(pure[k], jax.Array)
  assert all(isinstance(v, jax.Array) for v in raw.values()), raw


# ------------------------------------------------- Flax NNX: scanned layers

SCAN_LAYERS, SCAN_WIDTH = 4, 6


def _scanned_and_twin(nnx):
  """A model whose blocks are stacked by ``nnx.vmap`` and applied by
  ``nnx.scan``, and an unscanned twin (a list of blocks) with the same
  weights; each as (pure param dict, loss of a pure param dict)."""

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(SCAN_WIDTH, SCAN_WIDTH, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.lin(x))

  class Scanned(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=SCAN_LAYERS)
      @nnx.vmap(in_axes=0, out_axes=0)
      def make(rngs):
        return Block(rngs)
      self.blocks = make(rngs)
      self.head = nnx.Linear(SCAN_WIDTH, 2, rngs=rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, block):
        return block(x)
      return self.head(body(x, self.blocks))

  class Twin(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs) for _ in range(SCAN_LAYERS)])
      self.head = nnx.Linear(SCAN_WIDTH, 2, rngs=rngs)

    def __call__(self, x):
      for block in self.blocks:
        x = block(x)
      return self.head(x)

  kx, ky = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (16, SCAN_WIDTH))
  y = 10.0 * jax.random.normal(ky, (16, 2))  # gradients well above 1

  def functional(model):
    graphdef, state = nnx.split(model, nnx.Param)

    def loss(pure):
      nnx.replace_by_pure_dict(state, pure)
      return jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)
    return nnx.to_pure_dict(state), loss

  scanned, scanned_loss = functional(Scanned(nnx.Rngs(0)))
  twin = {"blocks": {i: jax.tree.map(lambda a: a[i], scanned["blocks"])
                     for i in range(SCAN_LAYERS)},
          "head": scanned["head"]}
  twin_template, twin_loss = functional(Twin(nnx.Rngs(1)))
  assert jax.tree.structure(twin) == jax.tree.structure(twin_template)
  return (scanned, scanned_loss), (twin, twin_loss)


def _unstack(tree):
  """A scanned model's pure params (or updates) in its twin's layout."""
  return {"blocks": {i: jax.tree.map(lambda a: a[i], tree["blocks"])
                     for i in range(SCAN_LAYERS)}, "head": tree["head"]}


SCAN_LAYER_AXIS = {"blocks": 0, "head": None}
SCAN_MAX_NORM = 3.0
SCAN_CLIPS = {
    "clip_by_global_norm": lambda **kw: oc.clip_by_global_norm(1.0, leaf_norms=True, **kw),
    # Between the smallest and largest layer norms: some layers clipped.
    "clip_by_norm": lambda **kw: oc.clip_by_norm(SCAN_MAX_NORM, leaf_norms=True, **kw),
}


def _assert_trees_close(actual, expected):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               actual, expected)


def _with_gradients(scanned_and_twin):
  """``(params, grads)`` of the scanned model and of its twin."""
  (params, loss), (twin_params, twin_loss) = scanned_and_twin
  return (params, jax.grad(loss)(params)), (twin_params, jax.grad(twin_loss)(twin_params))


@functools.cache
def _gradients_of(library):
  """`_with_gradients` of the nnx or the Linen models, built once for the
  tests that share them (their arrays are never written to)."""
  if library == "nnx":
    return _with_gradients(_scanned_and_twin(pytest.importorskip("flax.nnx")))
  return _with_gradients(_linen_scanned_and_twin(pytest.importorskip("flax.linen")))


@pytest.mark.parametrize("clip", sorted(SCAN_CLIPS))
def test_nnx_scan_layer_norms_and_step_match_unscanned_twin(clip):
  (params, grads), (twin_params, twin_grads) = _gradients_of("nnx")
  # The scan and the unrolled loop compute the same gradients, per layer.
  _assert_trees_close(_unstack(grads), twin_grads)

  tx = optax.chain(SCAN_CLIPS[clip](layer_axis=SCAN_LAYER_AXIS), optax.sgd(0.1))
  twin_tx = optax.chain(SCAN_CLIPS[clip](), optax.sgd(0.1))
  step = jax.jit(lambda tx, g, s, p: optax.apply_updates(p, tx.update(g, s, p)[0]),
                 static_argnums=0)
  new = jax.jit(tx.update)(grads, tx.init(params), params)
  twin_new = jax.jit(twin_tx.update)(twin_grads, twin_tx.init(twin_params), twin_params)
  stats, twin_stats = oc.stats(new[1]), oc.stats(twin_new[1])

  # One norm per layer of each stacked leaf, equal to the twin's per-leaf
  # norm of that layer and to numpy's norm of the twin's gradient leaf.
  layer_keys = [k for k in stats if k.startswith("clip/layer_norm/blocks/")]
  assert len(layer_keys) == 2 * SCAN_LAYERS  # kernel and bias, per layer
  for name in ("kernel", "bias"):
    np.testing.assert_allclose(
        stats[f"clip/leaf_norm/blocks/lin/{name}"],
        np_norm([twin_grads["blocks"][i]["lin"][name] for i in range(SCAN_LAYERS)]),
        rtol=1e-5)
  for i in range(SCAN_LAYERS):
    for name in ("kernel", "bias"):
      reference = np_norm([twin_grads["blocks"][i]["lin"][name]])
      scanned_norm = stats[f"clip/layer_norm/blocks/lin/{name}/{i}"]
      np.testing.assert_allclose(scanned_norm, reference, rtol=1e-5)
      np.testing.assert_allclose(scanned_norm,
                                 twin_stats[f"clip/leaf_norm/blocks/{i}/lin/{name}"],
                                 rtol=1e-5)
  for name in ("kernel", "bias"):
    np.testing.assert_allclose(stats[f"clip/leaf_norm/head/{name}"],
                               twin_stats[f"clip/leaf_norm/head/{name}"], rtol=1e-5)
  np.testing.assert_allclose(stats["clip/norm"], twin_stats["clip/norm"], rtol=1e-5)
  if clip == "clip_by_norm":  # some layers clipped, some not: a real test
    norms = np.array([stats[k] for k in layer_keys])
    assert norms.min() < SCAN_MAX_NORM < norms.max(), norms

  # The step: the scanned model's updated params are the twin's, layer by layer.
  updated = step(tx, grads, tx.init(params), params)
  twin_updated = step(twin_tx, twin_grads, twin_tx.init(twin_params), twin_params)
  _assert_trees_close(_unstack(updated), twin_updated)
  # Independently: each twin leaf moved by -0.1 * its clipped gradient.
  def clipped(g):
    return np.asarray(g, np.float64) * min(1.0, SCAN_MAX_NORM / np_norm([g]))
  if clip == "clip_by_norm":
    expected = jax.tree.map(lambda p, g: np.asarray(p, np.float64) - 0.1 * clipped(g),
                            twin_params, twin_grads)
    _assert_trees_close(_unstack(updated), expected)



# ----------------------------------------------- Flax Linen: scanned layers

LINEN_LAYER_AXIS = {"params": {"blocks": 0, "head": None}}


def _linen_scanned_and_twin(nn):
  """A Linen model whose blocks are applied by ``nn.scan`` (their params
  stacked on axis 0), and an unscanned twin (a loop over ``blocks_<i>``)
  with the same weights; each as (params, loss of params)."""

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return jnp.tanh(nn.Dense(SCAN_WIDTH, name="lin")(x)), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      blocks = nn.scan(Block, variable_axes={"params": 0},
                       split_rngs={"params": True}, length=SCAN_LAYERS)
      x, _ = blocks(name="blocks")(x, None)
      return nn.Dense(2, name="head")(x)

  class Twin(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(SCAN_LAYERS):
        x, _ = Block(name=f"blocks_{i}")(x, None)
      return nn.Dense(2, name="head")(x)

  kx, ky = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (16, SCAN_WIDTH))
  y = 10.0 * jax.random.normal(ky, (16, 2))  # gradients well above 1

  def functional(model, seed):
    def loss(params):
      return jnp.mean((model.apply(params, x) - y) ** 2)
    return model.init(jax.random.key(seed), x), loss

  scanned, scanned_loss = functional(Scanned(), 0)
  twin = _linen_unstack(scanned)
  twin_template, twin_loss = functional(Twin(), 1)
  assert (jax.tree.map(jnp.shape, twin)
          == jax.tree.map(jnp.shape, twin_template)), twin_template
  return (scanned, scanned_loss), (twin, twin_loss)


def _linen_unstack(tree):
  """A scanned Linen model's params (or updates) in its twin's layout."""
  stacked = tree["params"]
  return {"params": {**{f"blocks_{i}": jax.tree.map(lambda a: a[i], stacked["blocks"])
                        for i in range(SCAN_LAYERS)},
                     "head": stacked["head"]}}


@pytest.mark.parametrize("clip", sorted(SCAN_CLIPS))
def test_linen_scan_layer_norms_and_step_match_unscanned_twin(clip):
  (params, grads), (twin_params, twin_grads) = _gradients_of("linen")
  # The scan and the unrolled loop compute the same gradients, per layer.
  _assert_trees_close(_linen_unstack(grads), twin_grads)

  tx = optax.chain(SCAN_CLIPS[clip](layer_axis=LINEN_LAYER_AXIS), optax.sgd(0.1))
  twin_tx = optax.chain(SCAN_CLIPS[clip](), optax.sgd(0.1))
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  twin_updates, twin_state = jax.jit(twin_tx.update)(
      twin_grads, twin_tx.init(twin_params), twin_params)
  stats, twin_stats = oc.stats(state), oc.stats(twin_state)

  # One norm per layer of each stacked leaf (keys end in the layer index),
  # equal to numpy's norm of the twin's gradient leaf and to the twin's stat.
  twin_grad_leaves = twin_grads["params"]
  layer_keys = [k for k in stats if k.startswith("clip/layer_norm/params/blocks/")]
  assert len(layer_keys) == 2 * SCAN_LAYERS  # kernel and bias, per layer
  for name in ("kernel", "bias"):
    np.testing.assert_allclose(
        stats[f"clip/leaf_norm/params/blocks/lin/{name}"],
        np_norm([twin_grad_leaves[f"blocks_{i}"]["lin"][name]
                 for i in range(SCAN_LAYERS)]), rtol=1e-5)
  for i in range(SCAN_LAYERS):
    for name in ("kernel", "bias"):
      scanned_norm = stats[f"clip/layer_norm/params/blocks/lin/{name}/{i}"]
      np.testing.assert_allclose(
          scanned_norm, np_norm([twin_grad_leaves[f"blocks_{i}"]["lin"][name]]),
          rtol=1e-5)
      np.testing.assert_allclose(
          scanned_norm, twin_stats[f"clip/leaf_norm/params/blocks_{i}/lin/{name}"],
          rtol=1e-5)
  for name in ("kernel", "bias"):
    np.testing.assert_allclose(stats[f"clip/leaf_norm/params/head/{name}"],
                               np_norm([twin_grad_leaves["head"][name]]), rtol=1e-5)
  # clip/norm: the global norm, or (clip_by_norm) the largest layer's norm.
  twin_norms = [np_norm([g]) for g in jax.tree.leaves(twin_grads)]
  global_norm = np.sqrt(sum(n ** 2 for n in twin_norms))
  np.testing.assert_allclose(stats["clip/norm"], twin_stats["clip/norm"], rtol=1e-5)
  np.testing.assert_allclose(
      stats["clip/norm"], max(twin_norms) if clip == "clip_by_norm" else global_norm,
      rtol=1e-5)
  if clip == "clip_by_norm":  # some layers clipped, some not: a real test
    norms = np.array([stats[k] for k in layer_keys])
    assert norms.min() < SCAN_MAX_NORM < norms.max(), norms

  # The step: the scanned model's updated params are the twin's, layer by layer,
  # and, independently, each twin leaf moved by -0.1 * its clipped gradient.
  updated = optax.apply_updates(params, updates)
  _assert_trees_close(_linen_unstack(updated),
                      optax.apply_updates(twin_params, twin_updates))
  def scale(g):
    norm = np_norm([g]) if clip == "clip_by_norm" else global_norm
    max_norm = SCAN_MAX_NORM if clip == "clip_by_norm" else 1.0
    return min(1.0, max_norm / norm)
  expected = jax.tree.map(
      lambda p, g: np.asarray(p, np.float64) - 0.1 * scale(g) * np.asarray(g, np.float64),
      twin_params, twin_grads)
  _assert_trees_close(_linen_unstack(updated), expected)


def test_linen_scan_adaptive_grad_clip_matches_unscanned_twin():
  (params, grads), (twin_params, twin_grads) = _gradients_of("linen")

  tx = oc.adaptive_grad_clip(0.01, layer_axis=LINEN_LAYER_AXIS)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  # Each layer clipped as optax's AGC clips the twin's own (unstacked) leaves.
  reference = optax.adaptive_grad_clip(0.01)
  expected, _ = reference.update(twin_grads, reference.init(twin_params), twin_params)
  _assert_trees_close(_linen_unstack(updates), expected)
  # And as optaxclip's AGC clips the twin.
  twin_tx = oc.adaptive_grad_clip(0.01)
  twin_updates, twin_state = jax.jit(twin_tx.update)(
      twin_grads, twin_tx.init(twin_params), twin_params)
  _assert_trees_close(_linen_unstack(updates), twin_updates)
  # A real test: some units were clipped, and both count the same ones.
  stats, twin_stats = oc.stats(state), oc.stats(twin_state)
  assert 0 < int(stats["agc/clipped_count"]), stats
  assert int(stats["agc/clipped_count"]) == int(twin_stats["agc/clipped_count"])


# ------------------------------------------------------------ Flax TrainState

def test_flax_train_state():
  pytest.importorskip("flax")
  from flax.training import train_state

  x, y = regression_data()
  params = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}

  def apply_fn(p, x):
    return x @ p["w"] + p["b"]

  state = train_state.TrainState.create(
      apply_fn=apply_fn, params=params,
      tx=optax.chain(oc.clip_grad_norm(1.0), optax.sgd(0.1)))

  @jax.jit
  def train_step(state):
    def loss_fn(p):
      return jnp.mean((state.apply_fn(p, x) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss, grads

  steps = 10
  losses = []
  for _ in range(steps):
    prev_params = state.params
    state, loss, grads = train_step(state)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert int(state.step) == steps
  stats = oc.stats(state.opt_state)
  assert set(stats) == keys("clip", CLIP_KEYS)
  assert int(stats["clip/count"]) == steps
  assert_norm_of(stats, "clip", grads)
  # The last step moved the parameters by 0.1 * the clipped gradients:
  # norm 1 (up to PyTorch's 1e-6 in the divisor).
  delta = jax.tree.map(lambda a, b: a - b, state.params, prev_params)
  np.testing.assert_allclose(oc.functional.global_norm(delta), 0.1, rtol=1e-5)


# --------------------------------------------------------------------- Equinox

def test_equinox():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(4, 2, 16, 1, key=jax.random.key(0))
  tx = optax.chain(oc.clip_by_global_norm(1.0), optax.adam(1e-2))
  opt_state = tx.init(eqx.filter(model, eqx.is_array))
  x, y = regression_data()

  @eqx.filter_jit
  def train_step(model, opt_state, x, y):
    @eqx.filter_value_and_grad
    def loss_fn(model):
      return jnp.mean((jax.vmap(model)(x) - y) ** 2)
    loss, grads = loss_fn(model)
    updates, opt_state = tx.update(grads, opt_state,
                                   eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss, grads

  steps = 15
  losses = []
  for _ in range(steps):
    model, opt_state, loss, grads = train_step(model, opt_state, x, y)
    losses.append(float(loss))
  assert losses[-1] < 0.9 * losses[0]
  stats = oc.stats(opt_state)
  assert set(stats) == keys("clip", CLIP_KEYS)
  assert int(stats["clip/count"]) == steps
  assert int(stats["clip/clipped_count"]) == steps
  assert_norm_of(stats, "clip", grads)


# ------------------------------------------------------------------ MultiSteps

def test_multisteps_clips_the_accumulated_gradient():
  lr, k = 0.5, 4
  tx = optax.MultiSteps(optax.chain(oc.clip_by_global_norm(1.0),
                                    optax.sgd(lr)), every_k_schedule=k)
  params = {"w": jnp.zeros(3), "b": jnp.zeros(2)}
  g = {"w": jnp.array([3.0, 4.0, 0.0]), "b": jnp.array([0.0, 12.0])}  # norm 13
  d = {"w": jnp.array([0.1, -0.2, 0.3]), "b": jnp.array([0.25, 0.0])}
  neg = jax.tree.map(jnp.negative, g)
  # Micro-batches g, -g, g, -g + 4d: each norm > 1, the mean is d (norm < 1).
  last = jax.tree.map(lambda a, b: a + 4 * b, neg, d)
  micro = [g, neg, g, last]
  for m in micro:
    assert oc.functional.global_norm(m) > 1.0
  mean = jax.tree.map(lambda *xs: sum(xs) / k, *micro)
  assert oc.functional.global_norm(mean) < 1.0

  update = jax.jit(tx.update)
  state = tx.init(params)
  for cycle in range(2):
    for i, m in enumerate(micro):
      updates, state = update(m, state, params)
      stats = oc.stats(state)
      assert set(stats) == keys("clip", CLIP_KEYS)
      if i < k - 1:
        for u in jax.tree.leaves(updates):
          np.testing.assert_array_equal(u, 0.0)
        assert int(stats["clip/count"]) == cycle
      else:
        # The unclipped SGD step on the mean gradient.
        for u, a in zip(jax.tree.leaves(updates), jax.tree.leaves(mean)):
          np.testing.assert_allclose(u, -lr * a, rtol=1e-5, atol=1e-6)
        assert int(stats["clip/count"]) == cycle + 1
        assert int(stats["clip/clipped_count"]) == 0
        assert float(stats["clip/scale"]) == 1.0
        np.testing.assert_allclose(stats["clip/norm"],
                                   oc.functional.global_norm(mean), rtol=1e-5)


# ------------------------------------------------------------ inject_hyperparams

def test_inject_hyperparams_schedule_for_max_norm():
  schedule = optax.linear_schedule(10.0, 0.1, 10)
  tx = optax.inject_hyperparams(oc.clip_by_global_norm)(max_norm=schedule)
  params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
  grads = {"w": jnp.full((2, 3), 2.0), "b": jnp.full(3, 1.0)}
  norm = float(oc.functional.global_norm(grads))  # sqrt(27) ~ 5.2
  state = tx.init(params)
  update = jax.jit(tx.update)
  clipped_steps = 0
  for step in range(14):
    updates, state = update(grads, state, params)
    threshold = float(schedule(step))
    expected = min(norm, threshold)
    clipped_steps += norm > threshold
    np.testing.assert_allclose(oc.functional.global_norm(updates), expected,
                               rtol=1e-5)
    stats = oc.stats(state)
    assert set(stats) == keys("clip", CLIP_KEYS)
    np.testing.assert_allclose(stats["clip/norm"], norm, rtol=1e-6)
    np.testing.assert_allclose(stats["clip/scale"], min(1.0, threshold / norm),
                               rtol=1e-5)
    assert int(stats["clip/count"]) == step + 1
    assert int(stats["clip/clipped_count"]) == clipped_steps
    np.testing.assert_allclose(state.hyperparams["max_norm"], threshold,
                               rtol=1e-5)
  assert 0 < clipped_steps < 14  # the schedule crossed the norm


# ---------------------------------------------------------- masked / partition

def _groups():
  params = {"a": {"w": jnp.zeros(3)}, "b": {"w": jnp.zeros(2)}}
  grads = {"a": {"w": jnp.array([3.0, 0.0, 4.0])},
           "b": {"w": jnp.array([6.0, 8.0])}}
  return params, grads


def test_masked_clips_only_the_selected_group():
  params, grads = _groups()
  tx = optax.masked(oc.clip_by_global_norm(0.1), {"a": True, "b": False})
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["a"]["w"], [0.06, 0.0, 0.08], rtol=1e-6)
  np.testing.assert_array_equal(updates["b"]["w"], grads["b"]["w"])
  stats = oc.stats(state)
  assert set(stats) == keys("clip", CLIP_KEYS)
  np.testing.assert_allclose(stats["clip/norm"], 5.0, rtol=1e-6)  # "a" only
  assert int(stats["clip/clipped_count"]) == 1


def test_partition_clips_only_the_selected_group():
  params, grads = _groups()
  tx = optax.partition({"clip": oc.clip_by_global_norm(0.1),
                        "free": optax.identity()},
                       {"a": "free", "b": "clip"})
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["a"]["w"], grads["a"]["w"])
  np.testing.assert_allclose(updates["b"]["w"], [0.06, 0.08], rtol=1e-6)
  stats = oc.stats(state)
  assert set(stats) == keys("clip/clip", CLIP_KEYS)
  np.testing.assert_allclose(stats["clip/clip/norm"], 10.0, rtol=1e-6)
  assert int(stats["clip/clip/clipped_count"]) == 1


# ----------------------------------------------------------------------- Orbax

def _rich_tx():
  return oc.skip_step(
      optax.chain(oc.zclip(warmup_steps=3), optax.adamw(1e-2)),
      zscore=6.0, warmup_steps=2)


def test_orbax_checkpoint_round_trip_is_bit_identical(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = _rich_tx()
  x, y = regression_data()
  params = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}

  @jax.jit
  def train_step(params, opt_state, i):
    noise = 1.0 + 0.5 * jnp.sin(i)  # a varying gradient scale
    def loss_fn(p):
      return noise * jnp.mean((x @ p["w"] + p["b"] - y) ** 2)
    grads = jax.grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def run(params, opt_state, start, stop):
    for i in range(start, stop):
      params, opt_state = train_step(params, opt_state, jnp.float32(i))
    return params, opt_state

  n, m = 5, 4
  ref = run(params, tx.init(params), 0, n + m)

  mid = run(params, tx.init(params), 0, n)
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, {"params": mid[0], "opt_state": mid[1]})
    ckptr.wait_until_finished()
  # A fresh state (as after a restart) gives the structure to restore into.
  target = {"params": params, "opt_state": tx.init(params)}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, abstract)

  assert (jax.tree_util.tree_structure(restored["opt_state"])
          == jax.tree_util.tree_structure(mid[1]))
  assert type(restored["opt_state"]) is oc.SkipState
  assert type(restored["opt_state"].stats) is oc.SkipStats
  assert type(restored["opt_state"].inner_state[0]) is oc.ZClipState
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(
      {"params": mid[0], "opt_state": mid[1]})):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)

  out = run(restored["params"], restored["opt_state"], n, n + m)
  assert (jax.tree_util.tree_structure(out)
          == jax.tree_util.tree_structure(ref))
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(a, b)
  stats = oc.stats(out[1])
  assert int(stats["zclip/count"]) == int(stats["skip/count"]) - int(
      stats["skip/skipped_count"])
  assert int(stats["skip/count"]) == n + m
  assert int(out[1].inner_state[0].collected) >= 3  # past the warm-up
