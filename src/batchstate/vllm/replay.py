"""`replay(trace)`: a vLLM shadow's trace run through batchstate alone, without vLLM.

Each step's events are applied to a fresh `Replica` made as the trace's pools line
says, and vLLM's recorded state compared with batchstate's, exactly as the live
`Shadow` did. `batchstate replay TRACE` runs it for a trace whose pools line names
vLLM.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from batchstate.vllm.replica import State
from batchstate.vllm.trace import Mismatch, check, make_replica, read


@attrs.frozen
class Replayed:
    """What a replay found: steps replayed, and the first mismatch (None: none) with
    batchstate's state at it."""

    operations: int
    mismatch: Mismatch | None
    batchstate: State | None


def replay(path: Path) -> Replayed:
    """Replay the trace at `path`; stops at the first step where vLLM's recorded state
    and batchstate's differ, or where batchstate refuses what vLLM did.

    Raises:
        TraceError: the file is not a vLLM shadow's trace (names the line).
    """
    config, steps = read(path)
    replica = make_replica(config)
    count = 0
    scheduled: frozenset[str] = frozenset()
    for step in steps:
        count += 1
        mismatch, scheduled = check(replica, step, scheduled)
        if mismatch is not None:
            refused = mismatch.field == "refused"
            return Replayed(count, mismatch, None if refused else replica.state())
    return Replayed(count, None, None)
