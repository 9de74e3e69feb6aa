"""The types in optaxclip's public signatures, named for what they accept."""

from collections.abc import Hashable
from typing import Any, Literal

import jax

# A pytree of arrays (optax's ``chex.ArrayTree``, without the dependency).
PyTree = Any

# A hyperparameter: a Python number or a scalar array (traced when injected
# with ``optax.inject_hyperparams``).
Scalar = jax.typing.ArrayLike

# A norm order: a number ``p > 0``, ``inf``, or ``"inf"`` as in PyTorch.
Ord = jax.typing.ArrayLike | Literal["inf"]

# The mesh axis name(s) of ``shard_map``/``pmap`` the updates are split over.
AxisName = Hashable | tuple[Hashable, ...] | None

# What a clipper does with a NaN or Inf norm.
NonFinite = Literal["propagate", "zero", "raise"]
