"""batchstate.sglang against SGLang's own scheduler bookkeeping."""
