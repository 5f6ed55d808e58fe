"""batchstate.columns."""
