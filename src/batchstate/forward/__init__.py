"""batchstate.forward."""
