"""Every target, in the order of the report."""

from benchmarks.targets import (
  accuracy,
  compile_time,
  fallback,
  guards,
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
    train_step.TARGET,
    standalone.TARGET,
    many_leaves.TARGET,
    accuracy.TARGET,
    fallback.TARGET,
    qk_clip.TARGET,
)}
