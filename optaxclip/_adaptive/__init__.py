"""The adaptive clippers: thresholds that learn from the norms seen so far."""
