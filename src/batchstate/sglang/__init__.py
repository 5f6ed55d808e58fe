"""batchstate beside a live SGLang scheduler (SGLang 0.5.23 and the `sglang` extra).

`audit(batch)` checks a live `ScheduleBatch`, its pools and its radix cache against
batchstate's invariants; `Watch` does so after every lifecycle call and names the
first call that breaks one; `Shadow` replays every lifecycle call as batchstate
transitions on its own pools and names the first call where the two differ, and
`replay` runs its trace through batchstate alone. See docs/sglang.md, whose Install
section gives the commands.
"""

from batchstate.sglang._fields import (
    SUPPORTED_VERSIONS,
    NotReplayed,
    UnsupportedCache,
    UnsupportedSGLang,
)
from batchstate.sglang._topology import cpu_topology
from batchstate.sglang.audit import AuditReport, Violation, audit
from batchstate.sglang.replay import Replayed, replay
from batchstate.sglang.shadow import Shadow, ShadowDivergence
from batchstate.sglang.trace import Mismatch, TraceError
from batchstate.sglang.watch import Divergence, TraceStep, Watch

__all__ = [
    "SUPPORTED_VERSIONS",
    "AuditReport",
    "Divergence",
    "Mismatch",
    "NotReplayed",
    "Replayed",
    "Shadow",
    "ShadowDivergence",
    "TraceError",
    "TraceStep",
    "UnsupportedCache",
    "UnsupportedSGLang",
    "Violation",
    "Watch",
    "audit",
    "cpu_topology",
    "replay",
]
