"""batchstate.pools."""
