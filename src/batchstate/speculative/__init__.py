"""batchstate.speculative."""
