"""batchstate.records."""
