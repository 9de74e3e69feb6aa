"""The clippers: by value, by norm, by global norm, per group, per AGC unit,
per example; the clip state, the factor and the scaling they share."""
