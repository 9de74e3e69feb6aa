"""The programs JAX hands XLA:GPU and XLA:TPU, lowered here on the CPU.

XLA:GPU turns a two-branch conditional made of cheap instructions into a
select that runs both branches every step, so on GPU and TPU every norm must
read the gradients once with no conditional that can go two ways at run
time (docs/design.md, "Platforms"). ``lax.platform_dependent``'s own
dispatch lowers to a case on a constant: that one is fine.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxclip as oc

F = oc.functional
ACCELERATORS = ("cuda", "tpu")


def _tree(dtype):
  rng = np.random.default_rng(0)
  return {"embed": jnp.asarray(rng.normal(size=(64, 16)), dtype),
          "layers": jnp.asarray(rng.normal(size=(3, 16, 16)), dtype),
          "bias": [jnp.asarray(rng.normal(size=(16,)), dtype) for _ in range(5)]}


TREE, TREE_BF16 = _tree(jnp.float32), _tree(jnp.bfloat16)


def _step(tx):
  """A whole training step: ``tx``'s update and its application."""
  state = tx.init(TREE)

  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step, (TREE, state, TREE)


def _update(tx):
  return (lambda g, s: tx.update(g, s, TREE)), (TREE, tx.init(TREE))


CLIPPED_ADAMW = optax.chain(oc.clip_by_global_norm(1.0), optax.adamw(1e-3))
PROGRAMS = {
    "global_norm f32": (F.global_norm, (TREE,)),
    "global_norm bf16": (F.global_norm, (TREE_BF16,)),
    **{f"global_norm ord={p}": (lambda t, p=p: F.global_norm(t, p), (TREE,))
       for p in (1, 3, 0.5)},
    "clip_by_global_norm update": _update(oc.clip_by_global_norm(1.0)),
    "clipped adamw step": _step(CLIPPED_ADAMW),
    "skip_step(chain(clip, adamw), zscore=6)":
        _update(oc.skip_step(CLIPPED_ADAMW, zscore=6.0)),
    "dynamic_loss_scale(chain(clip, adamw))":
        _update(oc.dynamic_loss_scale(CLIPPED_ADAMW)),
    "dynamic_loss_scale(adamw, every_k_steps=4)":
        _update(oc.dynamic_loss_scale(optax.adamw(1e-3), every_k_steps=4)),
    "dynamic_loss_scale(adamw, every_k_steps=4, min_scale=2**-20)":
        _update(oc.dynamic_loss_scale(optax.adamw(1e-3), every_k_steps=4,
                                      min_scale=2.0**-20)),
    "dynamic_loss_scale(MultiSteps(adamw))":
        _update(oc.dynamic_loss_scale(optax.MultiSteps(optax.adamw(1e-3), 4))),
    "skip_step(MultiSteps(adamw))":
        _update(oc.skip_step(optax.MultiSteps(optax.adamw(1e-3), 4))),
    "per layer": _update(oc.clip_by_norm(
        1.0, layer_axis={"embed": None, "layers": 0, "bias": None})),
    "leaf norms": _update(oc.clip_by_global_norm(1.0, leaf_norms=True)),
    "adaptive_grad_clip": _step(oc.adaptive_grad_clip(0.1)),
    "per example": (lambda t: F.per_example_clip_by_global_norm(t, 1.0),
                    (TREE["layers"],)),
}


def two_way_conditionals(lowered) -> list[str]:
  """The ``stablehlo.case``/``if`` ops of two or more branches whose index
  is not a constant (each named by its branch count)."""
  found, stack = [], [lowered.compiler_ir("stablehlo").operation]
  while stack:
    for region in stack.pop().regions:
      for block in region.blocks:
        for op in block.operations:
          stack.append(op)
          if op.name in ("stablehlo.case", "stablehlo.if") and len(op.regions) > 1:
            index = op.operands[0].owner
            if getattr(index, "name", None) != "stablehlo.constant":
              found.append(f"{op.name} with {len(op.regions)} branches")
  return found


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_accelerator_programs_hold_no_conditional(name, platform, monkeypatch):
  # Traced on this CPU for another platform, a norm takes the kernel
  # OPTAXCLIP_KERNEL names (the platform is known at trace time only from a
  # mesh: test_deviceless.py traces under one, docs/design.md).
  monkeypatch.setenv("OPTAXCLIP_KERNEL", "one_pass")
  fn, args = PROGRAMS[name]
  # a function of its own: JAX keeps a function's trace (and its kernel)
  lowered = jax.jit(lambda *a: fn(*a)).trace(*args).lower(
      lowering_platforms=(platform,))
  assert two_way_conditionals(lowered) == []


def test_a_norm_traces_only_the_kernel_that_runs():
  # The platform is known while tracing (here the default backend, the
  # CPU): only the rescue is traced, not the one-pass kernel beside it
  # (`lax.platform_dependent` would trace both: the CPU's compile time).
  # (a tree of its own: a norm traced before keeps its kernel)
  tree = {"a": jnp.ones((5, 7)), "b": jnp.ones((3,))}
  jaxpr = str(jax.make_jaxpr(F.global_norm)(tree))
  assert "cond[" in jaxpr and "platform_index" not in jaxpr
  assert " reduce[" not in jaxpr  # the one-pass kernel's pairs


def test_the_cpu_program_keeps_the_rescue():
  # The CPU keeps its branch not taken: the rescue costs nothing there.
  lowered = jax.jit(F.global_norm).trace(TREE).lower(lowering_platforms=("cpu",))
  assert two_way_conditionals(lowered) != []


def test_the_cpu_window_check_keeps_its_branch():
  # dynamic_loss_scale(every_k_steps): the CPU redoes the window's sum only
  # when its bound is too large; accelerators judge the sum every step.
  fn, args = PROGRAMS["dynamic_loss_scale(adamw, every_k_steps=4)"]
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",))
  assert two_way_conditionals(lowered) != []


def test_the_one_pass_kernel_reduces_each_leaf_once(monkeypatch):
  # p = 2: three sibling sums of one input per large leaf, which XLA:GPU
  # fuses into one read (XLA:CPU reads each: counted here before
  # optimisation); small leaves concatenated and reduced as
  # (exponent, sum) pairs of their bits (`_exponent_sums`), on the CPU in
  # a tree of blocks of 16 (an error bound that holds in any order of
  # addition); other orders: variadic reductions in blocks of 16 too. One
  # read of the tree, plus the blocks' pairs: 8 bytes per 16 entries,
  # written once and read once (cost analysis).
  monkeypatch.setenv("OPTAXCLIP_KERNEL", "one_pass")
  large = 8 * oc._core._batching.CPU.limit + 1  # a large leaf: alone
  tree = {"w": jnp.ones((large,)), "b": jnp.ones((256,)), "c": jnp.ones((16, 16))}
  text = jax.jit(F.global_norm).lower(tree).as_text(dialect="hlo")
  reduces = [line for line in text.splitlines() if " reduce(" in line]
  assert sum("f32[] reduce(" in line for line in reduces) == 3  # the large leaf
  # 512 small entries: blocks of 16 to 32 pairs, to 2, to 1; the group's
  # partial, to 1: every other reduction is of pairs
  pairs = [line for line in reduces if "(s32[" in line.split(" reduce(")[0]]
  assert len(pairs) == len(reduces) - 3 == 4
  tree_bytes = sum(x.nbytes for x in jax.tree.leaves(tree))
  partials = 2 * 8 / (4 * 16)
  compiled = jax.jit(lambda t: F.global_norm(t, 3)).lower(tree).compile()
  assert compiled.cost_analysis()["bytes accessed"] / tree_bytes == pytest.approx(
      1.0 + partials, abs=0.03)
