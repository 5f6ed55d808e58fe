"""`replay(trace)`: a shadow's trace run through batchstate alone, without SGLang.

Each operation is applied to a fresh `Replica` made as the trace's pools line
says, and its recorded SGLang state compared with batchstate's, exactly as the
live `Shadow` did. `batchstate replay TRACE` is its command line.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from batchstate.sglang.replica import Replica, State
from batchstate.sglang.trace import Checked, Mismatch, apply, check, read


@attrs.frozen
class Replayed:
    """What a replay found: operations replayed, and the first mismatch (None: none) with
    batchstate's state at it."""

    operations: int
    mismatch: Mismatch | None
    batchstate: State | None


def replay(path: Path) -> Replayed:
    """Replay the trace at `path`; stops at the first step where SGLang's recorded state
    and batchstate's differ, or where batchstate refuses an operation SGLang made.

    Raises:
        TraceError: the file is not a trace (names the line).
    """
    config, operations = read(path)
    replica = Replica(
        page_size=config.page_size,
        kv_tokens=config.kv_tokens,
        rows=config.rows,
        context=config.context,
    )
    count, checked = 0, Checked()
    for op in operations:
        count += 1
        try:
            apply(replica, op)
        except Exception as error:  # batchstate refused the call: the divergence
            refused = Mismatch(
                op.step, op.op, "refused", "done", repr(error), op.rid, checked.since(op)
            )
            return Replayed(count, refused, None)
        published = not replica.unpublished
        mismatch = check(op, replica, pools=published)
        if mismatch is not None:
            found = attrs.evolve(mismatch, since=checked.since(op))
            return Replayed(count, found, replica.state(op.batch))
        checked.passed(op, pools=published)
    return Replayed(count, None, None)
