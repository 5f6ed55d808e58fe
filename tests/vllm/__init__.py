"""batchstate.vllm against vLLM's own v1 scheduler and KV cache manager."""
