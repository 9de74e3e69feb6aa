"""What a target is: numbers measured in fresh processes, then a section."""

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import jax

from benchmarks import _trees
from benchmarks._config import Config
from benchmarks._report import Section


def _one_job(config: Config) -> list[dict[str, Any]]:
  del config
  return [{}]


@dataclasses.dataclass(frozen=True)
class Target:
  """`measure(config, **job)` runs once per job, each in a fresh process, and
  returns plain numbers (they go to results.json as they are); `render`
  turns the list of them into the report's section, checks included."""
  key: str  # the name `--only` takes
  measure: Callable[..., dict[str, Any]]  # module-level, so a process can run it
  render: Callable[[Config, list[dict[str, Any]]], Section]
  jobs: Callable[[Config], list[dict[str, Any]]] = _one_job
  env: dict[str, str] = dataclasses.field(default_factory=dict)  # of its processes
  platforms: tuple[str, ...] = ("cpu",)  # where a run without `--only` includes it


# Every benchmark process allocates device memory as it needs it: by XLA's
# default the driver would hold 75% of a GPU, and each job's process ask for
# 75% more and fail (issue 28). Ignored on a CPU.
DEVICE_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def process_environment(target: Target) -> dict[str, str]:
  """What a fresh process measuring `target` adds to the environment."""
  return {**DEVICE_ENV, **target.env}


def describe_tree(tree: Any) -> str:
  return (f"{len(jax.tree.leaves(tree))} leaves, {_trees.tree_size(tree) / 1e6:.1f}M "
          f"float32 values ({_trees.tree_bytes(tree) / 2**20:.0f} MiB)")


def select_platform(name: str) -> None:
  """Runs JAX on `name`'s backend, or exits saying why it cannot; without
  the persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`), so that
  every compile timed is a compile, not a read of an earlier one; and
  without preallocating device memory (`DEVICE_ENV`), for this process and
  those it starts, before any backend is initialised."""
  os.environ.update(DEVICE_ENV)
  jax.config.update("jax_enable_compilation_cache", False)
  if name == "cpu":
    jax.config.update("jax_platforms", "cpu")
    return
  try:
    gpus = jax.devices("gpu")
  except RuntimeError as error:
    sys.exit(f"--platform gpu: JAX has no GPU backend on this machine ({error}). "
             "Install a CUDA/ROCm build of jaxlib, or run with --platform cpu.")
  jax.config.update("jax_default_device", gpus[0])


def needs_own_process(job: dict[str, Any]) -> bool:
  """Whether `job` must run in a fresh process whatever the run: a build
  without the rescue branch (`rescue=False`) patches the library."""
  return job.get("rescue") is False


def run_job(key: str, config: Config, job: dict[str, Any]) -> dict[str, Any]:
  """One job of target `key`, in this (fresh) process: its numbers."""
  from benchmarks.targets import TARGETS
  select_platform(config.platform)
  return TARGETS[key].measure(config, **job)
