"""Pure functions over pytrees: the layer every optaxclip transform is built on.

No state, no optax: usable under ``jit``, ``vmap`` (per-example clipping),
``shard_map`` and ``pmap``, and outside any optimizer.
"""

from optaxclip._attention.qk_clip import qk_clip_fn as qk_clip
from optaxclip._clip.agc import adaptive_grad_clip_fn as adaptive_grad_clip
from optaxclip._clip.agc import unitwise_clip as unitwise_clip
from optaxclip._clip.agc import unitwise_norm as unitwise_norm
from optaxclip._clip.block_rms import clip_by_block_rms_fn as clip_by_block_rms
from optaxclip._clip.norm import clip_by_global_norm_fn as clip_by_global_norm
from optaxclip._clip.norm import clip_by_norm_fn as clip_by_norm
from optaxclip._clip.per_example import PerExampleClip as PerExampleClip
from optaxclip._clip.per_example import (
    per_example_clip_by_global_norm as per_example_clip_by_global_norm,
)
from optaxclip._clip.per_example import (
    per_example_clip_by_layer_norm as per_example_clip_by_layer_norm,
)
from optaxclip._clip.pipeline import CombinedNorms as CombinedNorms
from optaxclip._clip.pipeline import PartialNorm as PartialNorm
from optaxclip._clip.pipeline import clip_stage as clip_stage
from optaxclip._clip.pipeline import combine_leaf_norms as combine_leaf_norms
from optaxclip._clip.pipeline import combine_norms as combine_norms
from optaxclip._clip.pipeline import partial_norm as partial_norm
from optaxclip._clip.value import clip_by_value_fn as clip_by_value
from optaxclip._core import all_finite as all_finite
from optaxclip._core import global_norm as global_norm

__all__ = [
    "CombinedNorms",
    "PartialNorm",
    "PerExampleClip",
    "adaptive_grad_clip",
    "all_finite",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip_stage",
    "combine_leaf_norms",
    "combine_norms",
    "global_norm",
    "partial_norm",
    "per_example_clip_by_global_norm",
    "per_example_clip_by_layer_norm",
    "qk_clip",
    "unitwise_clip",
    "unitwise_norm",
]
