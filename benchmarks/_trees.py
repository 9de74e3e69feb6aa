"""The gradient trees the benchmarks run on."""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Small leaves of about 1k elements in a few shapes, as in a model with many
# biases, norms and small projections.
SMALL_SHAPES = ((1000,), (32, 32), (10, 100), (1024,), (8, 128))


def small_leaf_structs(count: int) -> dict[str, jax.ShapeDtypeStruct]:
  """`count` float32 shape/dtype structs cycling through `SMALL_SHAPES`.

  New objects at every call: compile-time measurements build their tree anew.
  """
  return {f"leaf_{i:05d}": jax.ShapeDtypeStruct(SMALL_SHAPES[i % len(SMALL_SHAPES)],
                                                jnp.float32)
          for i in range(count)}


def transformer_shapes(vocab: int, d_model: int, layers: int,
                       seq_len: int) -> dict[str, Any]:
  """Parameter shapes of a GPT-style decoder, as a nested dict."""
  d = d_model

  def layer() -> dict[str, Any]:
    return {
        "ln1": {"scale": (d,), "bias": (d,)},
        "attn": {"qkv": {"w": (d, 3 * d), "b": (3 * d,)},
                 "out": {"w": (d, d), "b": (d,)}},
        "ln2": {"scale": (d,), "bias": (d,)},
        "mlp": {"up": {"w": (d, 4 * d), "b": (4 * d,)},
                "down": {"w": (4 * d, d), "b": (d,)}},
    }

  return {
      "embed": {"tokens": (vocab, d), "positions": (seq_len, d)},
      "layers": [layer() for _ in range(layers)],
      "final_ln": {"scale": (d,), "bias": (d,)},
  }


def stacked_transformer_shapes(vocab: int, d_model: int, layers: int,
                               seq_len: int) -> dict[str, Any]:
  """The same decoder as a scanned model holds it: each layer parameter of
  all layers stacked on a leading axis of size `layers`."""
  shapes = transformer_shapes(vocab, d_model, 1, seq_len)
  shapes["layers"] = jax.tree.map(lambda shape: (layers, *shape),
                                  shapes["layers"][0], is_leaf=_is_shape)
  return shapes


def _is_shape(x: Any) -> bool:
  return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def structs(shapes: Any, dtype=jnp.float32) -> Any:
  """Shape/dtype structs for the `shapes` tree: what compiling needs, no memory."""
  return jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), shapes,
                      is_leaf=_is_shape)


def shapes_where(shapes: Any, keep) -> list[tuple[int, ...]]:
  """The shapes of the `shapes` tree for which `keep(size)` holds, as a list."""
  return [shape for shape in jax.tree.leaves(shapes, is_leaf=_is_shape)
          if keep(math.prod(shape))]


def normal_tree(shapes: Any, seed: int, dtype=jnp.float32) -> Any:
  """N(0, 1) arrays of `dtype` for every shape in the `shapes` tree."""
  rng = np.random.default_rng(seed)

  def leaf(shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)

  return jax.tree.map(leaf, shapes, is_leaf=_is_shape)


def random_tree(shapes: Any, seed: int, dtype=jnp.float32) -> Any:
  """`normal_tree`'s distribution drawn on the default device: a tree of
  gigabytes is not built on the host and copied."""
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([jax.random.normal(key, shape, dtype)
                            for key, shape in zip(keys, leaves)])


def normal_arrays(count: int, size: int, seed: int) -> list[np.ndarray]:
  """`count` float32 numpy vectors of `size` N(0, 1) values."""
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(size, dtype=np.float32) for _ in range(count)]


def tree_bytes(tree: Any) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def tree_size(tree: Any) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))
