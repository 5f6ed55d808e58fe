"""batchstate beside a live vLLM v1 scheduler (vLLM 0.33 and the `vllm` extra).

`Shadow(scheduler)` replays every block allocation, eviction and free of vLLM's
`KVCacheManager` as batchstate transitions on its own pools, compares after every
scheduler call, and names the first step where the two differ; `replay` runs its
trace through batchstate alone. `batchstate.vllm.drive` builds vLLM's real scheduler
on a CPU and drives it with a fake model runner. See docs/vllm.md.
"""

from batchstate.vllm.replay import Replayed, replay
from batchstate.vllm.shadow import Shadow, ShadowDivergence, ShadowError
from batchstate.vllm.trace import Mismatch, TraceError

__all__ = [
    "Mismatch",
    "Replayed",
    "Shadow",
    "ShadowDivergence",
    "ShadowError",
    "TraceError",
    "replay",
]
