"""Drive mode: SGLang's scheduler over batchstate's batch state and memory.

`support.check_drive` refuses, at start and in one line, an SGLang version or server
configuration drive does not run; `memory` presents SGLang's request-to-token pool,
KV allocator and radix cache as views of one `Pools` value; `batch` makes a
`ScheduleBatch`'s mirrored fields reads of one batchstate record; `drive.Drive` runs
SGLang's batch lifecycle as batchstate's transitions on that `Pools`. See
docs/sglang.md, "Drive mode", for how to turn it on, what it runs and what it costs.
"""
