"""batchstate.cache."""
