"""Test set-up: 8 host CPU devices, set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402  (after the flags)
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.fixture(autouse=True)
def _x64_off():
  """Every test starts with JAX's default precision."""
  assert not jax.config.jax_enable_x64
  yield
