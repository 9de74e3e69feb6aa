"""Test set-up: 8 host CPU devices and the CPU backend only, set before JAX starts."""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The CPU backend only: the tests run on host devices, and the deviceless
# GPU/TPU compiles (tests/deviceless.py) need the CUDA plugin registered
# compile-only, which it is only when JAX does not try to start it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the run: the same program compiled
# again, in another test, an xdist worker or a subprocess (examples, the
# benchmark's smoke run), is read back instead (set by the first process;
# the workers and subprocesses it starts inherit it; removed at its end).
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
      prefix="optaxclip-test-jax-cache-")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402  (after the flags)
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.fixture(autouse=True)
def _x64_off():
  """Every test starts with JAX's default precision."""
  assert not jax.config.jax_enable_x64
  yield


def pytest_unconfigure(config):
  if _OWN_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
