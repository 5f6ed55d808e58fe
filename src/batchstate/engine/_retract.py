"""Retraction: when decode runs out of KV, a running row (or a held chunk) gives its memory back.

The policy names the victim row; its request goes back to the front of the
queue, to prefill its prompt and what it generated so far again. A held
chunk, when one is held, goes first: it has produced no token yet.
"""

from __future__ import annotations

from batchstate import Filtered, Req, Sampling, release
from batchstate.engine._config import EngineError
from batchstate.engine._state import EngineState

__all__ = ["retract_held", "retract_row"]


def retract_row(state: EngineState, running: Filtered[Sampling]) -> None:
    """The policy's victim leaves the running batch and is queued again, at the front."""
    rids = running.rows.rids.tolist()
    victim = state.policy.victim(rids, [state.remaining(rid) for rid in rids])
    if not 0 <= victim < len(rids):
        raise EngineError(f"the policy named row {victim} of {len(rids)} to retract")
    keep = [row for row in range(len(rids)) if row != victim]
    state.running = state.timed(lambda: state.kept(running, keep))
    live = state.live[rids[victim]]
    state.unread_rids.discard(live.spec.rid)  # its unread token is computed again
    state.waiting.appendleft(Req(live.spec.rid, live.spec.prompt + tuple(live.generated)))
    state.trace.num_retractions += 1


def retract_held(state: EngineState) -> None:
    """The newest held chunk gives its KV back and waits for a fresh prefill."""
    chunk = state.held.pop()
    result = release(chunk, state.running, state.pools)
    pools = result.value_or(None)
    if pools is None:
        raise EngineError(f"release failed: {result.failure()}")
    state.pools = pools
    state.waiting.appendleft(chunk.req)
    state.trace.num_retractions += 1
