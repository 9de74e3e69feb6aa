"""clip_grad_norm: ``torch.nn.utils.clip_grad_norm_`` in JAX (the factor
``max_norm / (norm + 1e-6)``, ``norm_type``, ``error_if_nonfinite``).

PyTorch's own numbers, golden and live, are in test_parity.py. It is
clip_by_global_norm with PyTorch's epsilon: the tests of the options both
take (``leaf_norms``, ``layer_axis``, ``nonfinite="raise"`` naming the
leaves) run for both in test_clip_by_global_norm.py. Elsewhere:
test_contract.py, test_errors.py, test_arguments.py, test_distributed.py,
test_fuzz.py, test_x64.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optaxclip as oc


def test_propagate_inf_norm_zeroes_finite_entries_like_pytorch():
  # PyTorch: clip_coef = max_norm / (inf + 1e-6) = 0, so finite entries
  # become 0 and infinite ones NaN.
  grads = [jnp.array([jnp.inf, 2.0]), jnp.array([3.0])]
  out, state = oc.clip_grad_norm(1.0).update(grads, oc.clip_grad_norm(1.0).init(grads))
  assert np.isnan(out[0][0]) and out[0][1] == 0 and out[1][0] == 0
  assert np.isinf(state.norm) and int(state.nonfinite_count) == 1


@pytest.mark.parametrize("jit", [False, True])
def test_clip_grad_norm_error_if_nonfinite(jit):
  # PyTorch raises a RuntimeError; so do we, eagerly and under jit.
  tx = oc.clip_grad_norm(1.0, error_if_nonfinite=True)
  update = jax.jit(tx.update) if jit else tx.update
  grads = [jnp.array([1.0, jnp.inf])]
  with pytest.raises(RuntimeError, match=r"\[0\]"):
    jax.block_until_ready(update(grads, tx.init(grads)))
  out, _ = update([jnp.array([3.0, 4.0])], tx.init(grads))
  np.testing.assert_allclose(out[0], np.array([3.0, 4.0]) / (5 + 1e-6), rtol=1e-6)
