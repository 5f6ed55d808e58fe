"""`replay(trace)`: a vLLM shadow's trace run through batchstate alone, without vLLM.

Each step's events are applied to a fresh `Replica` made as the trace's pools line
says, and vLLM's recorded state compared with batchstate's, exactly as the live
`Shadow` did. `batchstate replay TRACE` runs it for a trace whose pools line names
vLLM.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from batchstate.errors import Error
from batchstate.vllm.replica import ReplicaError, State
from batchstate.vllm.trace import Mismatch, apply, compare, make_replica, read


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
    for step in steps:
        count += 1
        try:
            apply(replica, step)
        except Error as error:  # batchstate refused what vLLM did: the divergence
            rid = error.rid if isinstance(error, ReplicaError) else ""
            return Replayed(
                count, Mismatch(step.step, step.op, "refused", "done", str(error), rid), None
            )
        mismatch = compare(step, replica.state())
        if mismatch is not None:
            return Replayed(count, mismatch, replica.state())
    return Replayed(count, None, None)
