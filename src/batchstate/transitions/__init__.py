"""batchstate.transitions."""
