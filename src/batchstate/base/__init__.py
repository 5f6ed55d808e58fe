"""batchstate.base."""
