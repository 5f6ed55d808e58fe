"""Speculative decoding's forward: every running row's drafts, in a verify window.

The drafts start from each row's last token, so with overlap the last
forward's tokens are read first (and rows they finished leave). Each row
then decodes (retracting when the KV pool runs out), draws up to
`speculative` drafts, and `verify` reserves their KV; with no room for
them, the step verifies no drafts, an ordinary decode.
"""

from __future__ import annotations

from functools import partial

from batchstate import Filtered, verify
from batchstate.engine._decode import decode_rows
from batchstate.engine._forwards import NoForward, VerifyForward
from batchstate.engine._record import read_unread
from batchstate.engine._state import EngineState

__all__ = ["draft_and_verify"]


def draft_and_verify(state: EngineState) -> VerifyForward | NoForward:
    """The verify window over the running rows and their drafts; NoForward: no row is left."""
    done = read_unread(state) if state.unread is not None else set()
    if done and isinstance(state.running, Filtered):
        rids = state.running.rows.rids.tolist()
        state.running = state.kept(
            state.running, [row for row, rid in enumerate(rids) if rid not in done]
        )
    if not len(state.running.rows):
        return NoForward()  # every forward's rows finished one step late
    batch = decode_rows(state)
    rids = batch.rows.rids.tolist()
    histories = [state.prompts[rid] + tuple(state.live[rid].generated) for rid in rids]
    counts = [
        _draft_count(state, rid, int(n))
        for rid, n in zip(rids, batch.rows.seq_lens.host, strict=True)
    ]
    drafts = state.tokens.draft(histories, counts)
    result = state.timed(partial(verify, batch, [len(row) for row in drafts], state.pools))
    step = result.value_or(None)
    if step is None:  # no room for the drafts' KV: this step decodes one token
        drafts = [[] for _ in rids]
        step = state.timed(partial(verify, batch, [0] * len(rids), state.pools)).unwrap()
    window, state.pools = step
    tokens = [[history[-1], *row] for history, row in zip(histories, drafts, strict=True)]
    num_drafted = sum(len(row) for row in drafts)
    return VerifyForward(window, rids, batch.rows.seq_lens.host, tokens, num_drafted)


def _draft_count(state: EngineState, rid: int, seq_len: int) -> int:
    # No more drafts than the request may still output (past its next token) or
    # than fit in its table row.
    room = state.pools.max_context_len - seq_len
    return max(min(state.config.speculative, state.remaining(rid) - 1, room), 0)
