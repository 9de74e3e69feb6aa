"""The stall guard's warning: clippers whose factor kept falling under its floor.

A clip factor far below 1 at every step (a global norm that one set of
leaves inflates) shrinks every other leaf's update to nothing: under
``optax.contrib.muon``'s Newton-Schulz ``eps`` the orthogonalised matrices
stop moving and the loss stalls with no error (Megatron-LM #5394). The
clippers count such steps in ``floor_count`` on the device; ``check_stall``
reads the counters when the user logs, so the guard costs no host sync per
step.
"""

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from optaxclip._stats import registry


class ClipStallWarning(RuntimeWarning):
  """A clipper's factor fell under its ``floor`` on more steps than allowed."""


def check_stall(opt_state: Any, *, max_floor_steps: int = 0) -> dict[str, int]:
  """Warns for every clipper whose factor fell under its floor too often.

  Reads ``floor_count`` and ``min_scale`` from ``optaxclip.stats`` (one
  transfer to the host: call it where you log, not every step) and issues a
  ``ClipStallWarning`` for each clipper with more than ``max_floor_steps``
  such steps, naming its smallest factor and the fix.

  Args:
    opt_state: an optax optimizer state, or the dict ``optaxclip.stats``
      returned for one.
    max_floor_steps: the warning threshold: the number of steps under the
      floor tolerated (an int, at least 0).

  Returns:
    A dict from each warned clipper's ``stats`` prefix (``"clip"``) to its
    ``floor_count``; empty when none warned.

  Examples:
    >>> import jax.numpy as jnp
    >>> import warnings
    >>> import optaxclip as oc
    >>> tx = oc.clip_by_global_norm(1.0)  # floor=1e-4
    >>> _, state = tx.update({"w": jnp.full(4, 1e6)}, tx.init(None))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   oc.check_stall(state)
    {'clip': 1}
    >>> print(caught[0].message)  # doctest: +ELLIPSIS
    clip: the clip factor fell under floor on 1 of 1 steps (smallest 5e-07)...
  """
  if (isinstance(max_floor_steps, (bool, np.bool_))
      or not isinstance(max_floor_steps, (int, np.integer))):
    raise TypeError(f"`check_stall(max_floor_steps=...)` must be an int >= 0 "
                    f"(steps), got {max_floor_steps!r:.80}")
  if max_floor_steps < 0:
    raise ValueError(f"`check_stall(max_floor_steps=...)` must be an int >= 0 "
                     f"(steps), got {max_floor_steps!r}")
  found = opt_state if isinstance(opt_state, Mapping) else registry.stats(opt_state)
  wanted = {key: value for key, value in found.items()
            if key.endswith("/floor_count") or key.endswith("/min_scale")
            or key.endswith("/count")}
  values = jax.device_get(wanted)  # one transfer for every clipper
  stalled = {}
  for key in sorted(values):
    if not key.endswith("/floor_count") or int(values[key]) <= max_floor_steps:
      continue
    prefix = key.removesuffix("/floor_count")
    stalled[prefix] = int(values[key])
    smallest = float(values.get(f"{prefix}/min_scale", np.nan))
    steps = int(values.get(f"{prefix}/count", 0))
    warnings.warn(
        f"{prefix}: the clip factor fell under floor on {stalled[prefix]} of "
        f"{steps} steps (smallest {smallest:.3g}), more than max_floor_steps="
        f"{max_floor_steps}: some leaves dominate the norm and the factor "
        f"shrinks the others' updates to nothing. Under optax.contrib.muon, "
        f"clip the Adam-handled leaves only (docs/muon.md: optax.masked, or "
        f"scale_only=); otherwise find the leaves (leaf_norms=True) and fix "
        f"their scale, or raise max_norm",
        ClipStallWarning, stacklevel=2)
  return stalled
