"""Statistics: running moments, spike tests, per-leaf norms, step counters,
and the registry behind ``stats()``."""
