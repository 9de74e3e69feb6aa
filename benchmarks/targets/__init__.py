"""Every target, in the order of the report."""

from benchmarks.targets import (
  accelerators,
  accuracy,
  compile_time,
  experts,
  fallback,
  guards,
  large_step,
  large_tree,
  many_leaves,
  qk_clip,
  scanned,
  standalone,
  traffic,
  train_step,
)
from benchmarks.targets._base import Target

TARGETS: dict[str, Target] = {t.key: t for t in (
    compile_time.STEP_TARGET,
    compile_time.ALONE_TARGET,
    traffic.TARGET,
    guards.TARGET,
    scanned.TARGET,
    experts.TARGET,
    train_step.TARGET,
    standalone.TARGET,
    many_leaves.TARGET,
    large_tree.TARGET,
    large_step.TARGET,
    accuracy.TARGET,
    fallback.TARGET,
    qk_clip.TARGET,
    accelerators.TARGET,
)}
