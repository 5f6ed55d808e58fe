"""batchstate.memory."""
