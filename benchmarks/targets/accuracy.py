"""Accuracy of the norm against a float64 reference (`accuracy`)."""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxclip as oc
from benchmarks import _torch
from benchmarks._config import Config
from benchmarks._report import Check, Section, Table, verdict
from benchmarks.targets._base import Target

LIMIT = 1e-6  # relative error of optaxclip's norm
LIBRARIES = ("optaxclip", "optax", "torch")


def _float64_norm(arrays: list[np.ndarray]) -> float:
  """The exact-enough norm, summed in float64 chunk by chunk."""
  total = 0.0
  for a in arrays:
    flat = a.reshape(-1)
    for start in range(0, flat.size, 1 << 22):
      chunk = flat[start:start + (1 << 22)].astype(np.float64)
      total += float(chunk @ chunk)
  return math.sqrt(total)


def _relative_error(value: Any, reference: float) -> float:
  value = float(value)
  return abs(value - reference) / reference if math.isfinite(value) else math.inf


def _torch_norm(platform: str, arrays: list[np.ndarray], dtype_name: str) -> float | None:
  """What `clip_grad_norm_` computes: the norm of the per-tensor norms."""
  torch, device, _ = _torch.load(platform)
  if torch is None:
    return None
  dtype = getattr(torch, dtype_name)
  tensors = [torch.from_numpy(np.require(a, requirements="W")).to(device=device, dtype=dtype)
             for a in arrays]
  norms = torch.stack([torch.linalg.vector_norm(x) for x in tensors])
  return float(torch.linalg.vector_norm(norms))


def _errors(platform: str, arrays: list[np.ndarray], dtype: Any) -> dict[str, float | None]:
  tree = [jnp.asarray(a, dtype) for a in arrays]
  seen = [np.asarray(x.astype(jnp.float32)) for x in tree]  # the rounded values
  reference = _float64_norm(seen)
  torch_norm = _torch_norm(platform, seen, jnp.dtype(dtype).name)
  return {"optaxclip": _relative_error(jax.jit(oc.functional.global_norm)(tree), reference),
          "optax": _relative_error(jax.jit(optax.tree.norm)(tree), reference),
          "torch": None if torch_norm is None else _relative_error(torch_norm, reference)}


def measure(config: Config) -> dict[str, Any]:
  rng = np.random.default_rng(3)
  cases = [
      ("float32, one vector", [rng.standard_normal(config.accuracy_size, np.float32)],
       jnp.float32),
      ("bfloat16 tree", [rng.standard_normal(s, np.float32) for s in config.half_shapes],
       jnp.bfloat16),
      ("float16 tree", [rng.standard_normal(s, np.float32) for s in config.half_shapes],
       jnp.float16),
  ]
  return {"cases": [{"case": case, "elements": sum(a.size for a in arrays),
                     "errors": _errors(config.platform, arrays, dtype)}
                    for case, arrays, dtype in cases],
          "torch_missing": _torch.load(config.platform)[2]}


def render(config: Config, results: list[dict[str, Any]]) -> Section:
  del config
  [result] = results
  rows, checks = [], []
  for case in result["cases"]:
    errors = case["errors"]
    cells = {k: "n/a" if e is None else f"{e:.1e}" for k, e in errors.items()}
    passed = errors["optaxclip"] <= LIMIT
    rows.append([case["case"], f"{case['elements']:.3g}", f"**{cells['optaxclip']}**",
                 cells["optax"], cells["torch"], f"<= {LIMIT:g}", verdict(passed)])
    checks.append(Check(f"{case['case']}: relative error", cells["optaxclip"],
                        f"<= {LIMIT:g}", passed))
  missing = result["torch_missing"]
  return Section(
      key="accuracy", title="Accuracy of the norm",
      measured="N(0, 1) values, relative error against a float64 numpy norm.",
      tables=[Table(["case", "elements", *LIBRARIES, "threshold", "status"], rows)],
      checks=checks, notes=[f"PyTorch left out: {missing}."] if missing else [])


TARGET = Target("accuracy", measure, render, platforms=("cpu", "gpu"))
