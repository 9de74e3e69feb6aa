"""PyTorch, the reference for many small leaves and for accuracy: optional."""

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
