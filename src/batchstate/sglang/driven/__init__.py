"""Drive mode: SGLang's scheduler over batchstate's batch state and memory.

`support.check_drive` refuses, at start and in one line, an SGLang version or server
configuration drive does not run; `memory` presents SGLang's request-to-token pool,
KV allocator and radix cache (counters, match, lock) as views of one `Pools` value;
`batch_fields` reads the fields SGLang's model runner reads off a batch from one
record. See docs/sglang.md, "Drive mode", for what is driven so far and what is not.
"""
