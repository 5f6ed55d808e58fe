"""batchstate.captured."""
