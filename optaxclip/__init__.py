"""optaxclip: gradient clipping for JAX, as Optax transformations.

Every transform here chains before any optax optimizer::

    optax.chain(optaxclip.clip_by_global_norm(1.0), optax.adamw(3e-4))

and ``optaxclip.functional`` holds the pure functions they are built on.
"""

from optaxclip import functional as functional
from optaxclip._nonfinite import NonFiniteGradientError as NonFiniteGradientError
from optaxclip._norm_clipping import ClipState as ClipState
from optaxclip._norm_clipping import clip_by_global_norm as clip_by_global_norm
from optaxclip._norm_clipping import clip_by_norm as clip_by_norm
from optaxclip._norm_clipping import clip_grad_norm as clip_grad_norm
from optaxclip._stats import stats as stats
from optaxclip._value import clip_by_value as clip_by_value

__version__ = "0.1.0"

__all__ = [
    "ClipState",
    "NonFiniteGradientError",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip_grad_norm",
    "functional",
    "stats",
]
