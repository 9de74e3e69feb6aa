"""Where a value lives on a mesh while tracing, and keeping layouts.

On an Explicit mesh a value's PartitionSpec is part of its type; on an Auto
mesh the compiler picks it, and propagates it through whatever values
share an operation. The norms' small per-unit vectors mix leaves of
different layouts: these helpers keep each leaf's layout its own.
"""

from typing import Any

import jax
from jax import lax


def _mesh(x: jax.Array) -> Any:
  """The (abstract) mesh ``x`` is laid out on while tracing, or None."""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  return None if mesh is None or mesh.empty else mesh


def layout_spec(x: jax.Array) -> Any:
  """``x``'s PartitionSpec (a tuple) while tracing; "auto" on a mesh with
  axes whose layouts the compiler picks (Auto); None off any mesh."""
  mesh = _mesh(x)
  if mesh is None:
    return None
  if any(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return "auto"
  return tuple(jax.typeof(x).sharding.spec)


def _whole(x: jax.Array) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(_mesh(x), jax.sharding.PartitionSpec())


def gathered(units: jax.Array) -> jax.Array:
  """``units`` (a few per-unit values) whole on every device where an
  Explicit mesh splits them (a layer axis sharded over a mesh axis), so
  that they flatten and concatenate with vectors of other layouts."""
  spec = layout_spec(units)
  if spec is None or spec == "auto" or all(s is None for s in spec):
    return units
  return jax.sharding.reshard(units, _whole(units))


def whole_on_auto_mesh(factors: jax.Array) -> jax.Array:
  """``factors`` (one per layer or unit of a leaf) constrained whole on
  every device of an Auto mesh: else XLA may give them the layout of a
  vector they share with another leaf's (the statistics concatenate all
  leaves' factors) and pass it on to the update of this leaf."""
  if factors.ndim == 0 or layout_spec(factors) != "auto":
    return factors
  return lax.with_sharding_constraint(factors, _whole(factors))


def without_leading_axis(x: jax.Array) -> Any:
  """On an Explicit mesh, the layout of ``x`` summed over its first axis
  (a batch): its own over the others. None elsewhere (the compiler picks)."""
  spec = layout_spec(x)
  if spec is None or spec == "auto":
    return None
  rest = (tuple(spec) + (None,) * x.ndim)[1:x.ndim]
  return jax.sharding.NamedSharding(_mesh(x), jax.sharding.PartitionSpec(*rest))
