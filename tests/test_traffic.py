"""Memory traffic of the clips, read from XLA's cost analysis: deterministic,
so asserted here (the `traffic` benchmark reports the same on a transformer).

`bytes accessed` of a compiled program over the bytes of the gradient tree
counts passes over the tree. A clip alone needs 3.0 (one read for the norm,
then read and write to scale); inside AdamW's step 1.0 more than AdamW alone
(the norm's read: the factor fuses into AdamW's own pass). The norm's rescue
branch (a `lax.cond` that runs only when the plain sum of squares overflows
or underflows) is counted too: its share is measured in a build without it,
made in a process of its own.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import optaxclip as oc  # noqa: E402
from benchmarks import _cost, _timing  # noqa: E402

CLIPS = ["optaxclip", "optaxclip clip_grad_norm"]
FLOORS = {"alone": 3.0, "step extra": 1.0}


def _structs(*shapes):
  return [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]


# Leaves above 2**15 elements, three of one shape (reduced side by side) and
# two others; ~4.4 MB.
LARGE = _structs((256, 1024), (256, 1024), (256, 1024), (1024, 300), (40000,))
# The same with small leaves too (0.4% of the bytes), which the norm groups.
MIXED = LARGE + _structs((1000,), (1000,), (32, 32))
# Scalars (the norm, counters) and, in MIXED, the copy that groups the small
# leaves (2 x 0.4%), in passes over the tree.
TOLERANCE = 0.01


@pytest.fixture(scope="module")
def with_rescue():
  return _cost.traffic(CLIPS, {"mixed": MIXED})


@pytest.fixture(scope="module")
def without_rescue():
  return _timing.in_fresh_process(_cost.traffic, CLIPS, {"mixed": MIXED, "large": LARGE},
                                  rescue=False)


def test_an_elementwise_pass_counts_two_passes():
  # The measure itself: read the tree once, write a new one.
  assert _cost.alone(optax.scale(0.5), LARGE) == pytest.approx(2.0, abs=1e-3)


@pytest.mark.parametrize("measure", FLOORS)
@pytest.mark.parametrize("clip", CLIPS)
def test_traffic_is_the_floor_plus_the_rescue_share(with_rescue, without_rescue,
                                                    clip, measure):
  value = with_rescue["mixed"][clip][measure]
  share = value - without_rescue["mixed"][clip][measure]
  assert share >= 0
  assert value <= FLOORS[measure] + share + TOLERANCE


@pytest.mark.parametrize("measure", FLOORS)
@pytest.mark.parametrize("clip", CLIPS)
def test_without_the_rescue_branch_large_leaves_are_at_the_floor(without_rescue,
                                                                  clip, measure):
  assert without_rescue["large"][clip][measure] == pytest.approx(FLOORS[measure],
                                                                 abs=1e-3)


def test_the_build_without_rescue_refuses_to_patch_this_process():
  with pytest.raises(RuntimeError, match="in_fresh_process"):
    _cost.traffic(CLIPS, {"large": LARGE}, rescue=False)


# --------------------------------------------------------------------------
# Step guards: one read of the gradients whatever guards are on. The guard
# shares the clipper's measurement (``update(..., grad_norm=...)``), so what
# remains beyond ``chain(clip, adamw)`` is the rollback: an exact
# ``jnp.where(skip, old, new)`` of AdamW's moments costs one read on XLA:CPU
# (a hand-written AdamW step with that select measures the same), and
# optax's apply_if_finite costs several.

def _adamw_step_passes(tx, grads, **extra):
  def step(g, state, params):
    updates, state = tx.update(g, state, params, **extra)
    return optax.apply_updates(params, updates), state
  state = jax.eval_shape(tx.init, grads)
  return _cost.bytes_accessed(step, grads, state, grads) / sum(
      x.size * x.dtype.itemsize for x in grads)


def _hand_written_rollback():
  """AdamW with its moments and update selected by a skip flag: the floor."""
  adamw = optax.adamw(1e-3)

  def update(grads, state, params=None):
    skip = ~(oc.functional.global_norm(grads) < jnp.inf)
    grads = jax.tree.map(lambda g: jnp.where(skip, 0, g), grads)
    updates, new = adamw.update(grads, state, params)
    return (jax.tree.map(lambda u: jnp.where(skip, 0, u), updates),
            jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, state))
  return optax.GradientTransformation(adamw.init, update)


GUARDED = {
    "skip_step(adamw)": lambda clip, adamw: oc.skip_step(adamw),
    "skip_step(chain(clip, adamw), zscore, loss_zscore)":
        lambda clip, adamw: oc.skip_step(optax.chain(clip, adamw), zscore=6.0,
                                         loss_zscore=6.0),
    "dynamic_loss_scale(chain(clip, adamw))":
        lambda clip, adamw: oc.dynamic_loss_scale(optax.chain(clip, adamw)),
    "dynamic_loss_scale(skip_step(chain(clip, adamw)))":
        lambda clip, adamw: oc.dynamic_loss_scale(
            oc.skip_step(optax.chain(clip, adamw), zscore=6.0)),
}


@pytest.fixture(scope="module")
def guard_passes():
  """Passes beyond chain(clip_by_global_norm, adamw), each composition's and
  the hand-written rollback's (over adamw's own norm-and-select step)."""
  clip, adamw = oc.clip_by_global_norm(1.0), optax.adamw(1e-3)
  base = _adamw_step_passes(optax.chain(clip, adamw), MIXED)
  extra = {name: _adamw_step_passes(
      make(clip, adamw), MIXED,
      **({"loss": jnp.float32(1.0)} if "loss_zscore" in name else {})) - base
           for name, make in GUARDED.items()}
  norm_only = optax.GradientTransformation(
      adamw.init, lambda g, s, p=None: adamw.update(
          jax.tree.map(lambda x: x * (oc.functional.global_norm(g) < jnp.inf), g),
          s, p))
  floor = (_adamw_step_passes(_hand_written_rollback(), MIXED)
           - _adamw_step_passes(norm_only, MIXED))
  return extra, floor


def test_the_rollback_floor_is_one_read(guard_passes):
  _, floor = guard_passes
  assert floor == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("name", GUARDED)
def test_guards_add_no_read_beyond_the_rollback(guard_passes, name):
  extra, floor = guard_passes
  print(f"{name}: +{extra[name]:.3f} passes (rollback floor +{floor:.3f})")
  assert extra[name] <= floor + TOLERANCE
