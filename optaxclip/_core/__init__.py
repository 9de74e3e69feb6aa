"""The norm core: the one computation behind every norm, and its only door.

Transforms say *what* they measure and get back what they need::

    where = _core.Where.of("clip_by_norm", axis_name, specs)   # at build
    measured = _core.measure("clip_by_norm", updates, p, where,
                             _core.layers(layer_axis))         # in update
    factors = clip_factor(measured.units, max_norm, eps)
    clipped = scale_leaves(updates, measured.to_leaves(factors))

Inside (docs/design.md): ``_measure`` (``measure``, ``Measured``), ``_kept``
(which axes a view keeps), ``_joint`` (an expert's norm over all its
tensors), ``_norms`` (the compiled, differentiable norm,
its kernel chosen by platform), ``_sums`` (the CPU kernel: powers, the
plain power sums and the overflow rescue), ``_one_pass`` (the GPU/TPU
kernel: one read, no conditional), ``_exponent_sums`` (its reductions of
the entries' bits, for small leaves and pair orders), ``_blocks`` (a
reduction in a tree of blocks, for XLA:CPU),
``_tangents`` (the derivative by formula), ``_exact`` (exact powers of
two), ``_batching`` (small leaves grouped for compile time) and ``_mesh``
(specs, the one all-reduce, layouts); ``_partials`` (pipeline stages'
leaf, layer and expert norms, combined in one fixed order).
"""

from optaxclip._core._exact import at_most as at_most
from optaxclip._core._exact import below as below
from optaxclip._core._exact import quotient as quotient
from optaxclip._core._joint import Joint as Joint
from optaxclip._core._joint import joint_shapes as joint_shapes
from optaxclip._core._joint import measure_joint as measure_joint
from optaxclip._core._kept import PER_LEAF as PER_LEAF
from optaxclip._core._kept import TOTAL as TOTAL
from optaxclip._core._kept import Kept as Kept
from optaxclip._core._kept import agc_units as agc_units
from optaxclip._core._kept import examples as examples
from optaxclip._core._kept import experts as experts
from optaxclip._core._kept import layers as layers
from optaxclip._core._measure import KnownNorm as KnownNorm
from optaxclip._core._measure import Measured as Measured
from optaxclip._core._measure import all_finite as all_finite
from optaxclip._core._measure import global_norm as global_norm
from optaxclip._core._measure import measure as measure
from optaxclip._core._measure import measure_pair as measure_pair
from optaxclip._core._measure import norm_of as norm_of
from optaxclip._core._measure import sharing as sharing
from optaxclip._core._measure import sum_over_examples as sum_over_examples
from optaxclip._core._measure import unit_shapes as unit_shapes
from optaxclip._core._mesh import HERE as HERE
from optaxclip._core._mesh import Where as Where
from optaxclip._core._mesh import layout_spec as layout_spec
from optaxclip._core._partials import combined_norm as combined_norm
from optaxclip._core._partials import leaf_norms as leaf_norms
from optaxclip._core._sums import any_in_batch as any_in_batch
from optaxclip._core._sums import rescue_enabled as rescue_enabled
