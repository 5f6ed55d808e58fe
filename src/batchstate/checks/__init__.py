"""batchstate.checks."""
