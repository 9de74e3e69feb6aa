"""PyTorch, the reference for many small leaves, large trees, AdamW and
accuracy: optional."""

from collections.abc import Callable, Sequence
from typing import Any


def load(platform: str) -> tuple[Any, str | None, str]:
  """`(torch module or None, device, why it is missing)`."""
  try:
    import torch
  except ImportError:
    return None, None, "torch is not installed"
  if platform == "cpu":
    return torch, "cpu", ""
  if torch.cuda.is_available():
    return torch, "cuda", ""
  return None, None, "this torch has no CUDA"


def synced(torch: Any, device: str, fn: Callable[[], Any]) -> Callable[[], None]:
  """`fn`, waiting for the device: CUDA runs asynchronously, as JAX does."""
  def call() -> None:
    fn()
    if device == "cuda":
      torch.cuda.synchronize()
  return call


def parameters(torch: Any, device: str, shapes: Sequence[tuple[int, ...]], dtype_name: str,
               seed: int) -> list[Any]:
  """Parameters of `shapes` whose `.grad` holds N(0, 1) values, drawn on `device`."""
  generator = torch.Generator(device=device).manual_seed(seed)
  dtype = getattr(torch, dtype_name)
  params = []
  for shape in shapes:
    p = torch.nn.Parameter(torch.randn(shape, device=device, dtype=dtype, generator=generator))
    p.grad = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    params.append(p)
  return params
