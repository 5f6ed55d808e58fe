"""Stage two of a step: choose the forward, retracting when decode runs out of KV.

Admissions run as they were admitted (a `Transfer`, an `ExtendForward` or a
`MixedForward`). With none, the running rows decode: a `VerifyForward`
with speculation, a `MixedForward` with chunks, mixed steps or overlap, a
`DecodeForward` otherwise. With speculation and overlap, an unread verify
window opens the next one ahead of its read (`verify_overlapped`). A held
chunk that nothing can run beside starts again afresh; with overlap, a step
may have no rows left to run (`NoForward`) while the last forward's tokens
are still to be read.
"""

from __future__ import annotations

from batchstate.engine._admit import admit_chunks
from batchstate.engine._config import EngineError
from batchstate.engine._decode import decode_mixed, decode_rows
from batchstate.engine._drafts import draft_and_verify
from batchstate.engine._forwards import (
    DecodeForward,
    ExtendForward,
    Forward,
    MixedForward,
    NoForward,
    Transfer,
)
from batchstate.engine._overlap_verify import verify_overlapped
from batchstate.engine._retract import retract_held
from batchstate.engine._state import EngineState

__all__ = ["plan"]


def plan(state: EngineState, admitted: Transfer | ExtendForward | MixedForward | None) -> Forward:
    """The step's one forward, its batch built (and KV allocated) by the transitions."""
    if admitted is not None:
        return admitted
    if state.window is not None:
        ahead = verify_overlapped(state)
        if ahead is not None:
            return ahead
        if not len(state.running.rows):
            return NoForward()  # the window's rows all finished
    config = state.config
    if not config.uses_mix:
        return draft_and_verify(state) if config.speculative else DecodeForward(decode_rows(state))
    # A held chunk that could not go on is left to the plain decode, which gives its
    # memory back first when decode runs out.
    if config.speculative and len(state.running.rows) and not state.held:
        return draft_and_verify(state)
    batch = decode_mixed(state)
    if batch is None and state.unread is None and state.held:
        retract_held(state)  # nothing runs beside the held chunk: start it afresh
        batch = admit_chunks(state)
    if batch is None and state.unread is None:
        raise EngineError(f"nothing can run: {len(state.waiting)} waiting, none fits")
    return NoForward() if batch is None else MixedForward(batch)
