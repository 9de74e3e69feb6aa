"""optaxclip: gradient clipping for JAX, as Optax transformations.

Every transform here chains before any optax optimizer::

    optax.chain(optaxclip.clip_by_global_norm(1.0), optax.adamw(3e-4))

and ``optaxclip.functional`` holds the pure functions they are built on.
"""

from optaxclip import functional as functional
from optaxclip._adaptive.adagc import AdaGCState as AdaGCState
from optaxclip._adaptive.adagc import adagc as adagc
from optaxclip._adaptive.autoclip import AutoClipState as AutoClipState
from optaxclip._adaptive.autoclip import auto_clip as auto_clip
from optaxclip._adaptive.zclip import ZClipState as ZClipState
from optaxclip._adaptive.zclip import zclip as zclip
from optaxclip._attention.heads import AttentionHeads as AttentionHeads
from optaxclip._attention.qk_clip import QKClipState as QKClipState
from optaxclip._attention.qk_clip import qk_clip as qk_clip
from optaxclip._clip.agc import AGCState as AGCState
from optaxclip._clip.agc import adaptive_grad_clip as adaptive_grad_clip
from optaxclip._clip.along import along as along
from optaxclip._clip.block_rms import BlockRMSState as BlockRMSState
from optaxclip._clip.block_rms import clip_by_block_rms as clip_by_block_rms
from optaxclip._clip.norm import clip_by_global_norm as clip_by_global_norm
from optaxclip._clip.norm import clip_by_norm as clip_by_norm
from optaxclip._clip.norm import clip_grad_norm as clip_grad_norm
from optaxclip._clip.on_nonfinite import NonFiniteGradientError as NonFiniteGradientError
from optaxclip._clip.per_group import GroupClipState as GroupClipState
from optaxclip._clip.state import ClipState as ClipState
from optaxclip._clip.value import ValueClipState as ValueClipState
from optaxclip._clip.value import clip_by_value as clip_by_value
from optaxclip._guards.loss_scale import LossScaleState as LossScaleState
from optaxclip._guards.loss_scale import LossScaleWrapperState as LossScaleWrapperState
from optaxclip._guards.loss_scale import dynamic_loss_scale as dynamic_loss_scale
from optaxclip._guards.loss_scale import loss_scale as loss_scale
from optaxclip._guards.microbatch import MicrobatchGuardState as MicrobatchGuardState
from optaxclip._guards.microbatch import microbatch_guard as microbatch_guard
from optaxclip._guards.skip import SkipState as SkipState
from optaxclip._guards.skip import SkipStats as SkipStats
from optaxclip._guards.skip import skip_step as skip_step
from optaxclip._stats.registry import stats as stats
from optaxclip._stats.stall import ClipStallWarning as ClipStallWarning
from optaxclip._stats.stall import check_stall as check_stall

__version__ = "0.1.0"

__all__ = [
    "AGCState",
    "AdaGCState",
    "AttentionHeads",
    "AutoClipState",
    "BlockRMSState",
    "ClipStallWarning",
    "ClipState",
    "GroupClipState",
    "LossScaleState",
    "LossScaleWrapperState",
    "MicrobatchGuardState",
    "NonFiniteGradientError",
    "QKClipState",
    "SkipState",
    "SkipStats",
    "ValueClipState",
    "ZClipState",
    "adagc",
    "adaptive_grad_clip",
    "along",
    "auto_clip",
    "check_stall",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip_grad_norm",
    "dynamic_loss_scale",
    "functional",
    "loss_scale",
    "microbatch_guard",
    "qk_clip",
    "skip_step",
    "stats",
    "zclip",
]
