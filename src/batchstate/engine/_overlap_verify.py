"""Speculative decoding under overlap: the next verify window opens before the last is read.

With overlap, a verify forward's acceptance stays on the device
(`UnreadWindow`). The next step's plan opens the next window from those
counts unread (`verify_ahead`: KV for every draft accepted), then makes
the step's one named read (`read_verified`: counts and tokens together),
records each row's tokens, settles the window to exact lengths
(`exact_window`), drafts from the histories now known and verifies.

Rows that finished stay in the window one step (their tokens past the
stop are dropped). When the window holds such rows, or requests wait to be
admitted, or the bound does not fit, the step closes the window instead:
the same read, then `sync`, the finished rows released, and the step goes
on the usual way from a running batch.
"""

from __future__ import annotations

from functools import partial

from batchstate import Verified, exact_window, sync, verify_ahead
from batchstate.engine._forwards import VerifyForward
from batchstate.engine._state import EngineState, UnreadWindow

__all__ = ["close_window", "verify_overlapped"]


def verify_overlapped(state: EngineState) -> VerifyForward | None:
    """The next verify window, opened before the last one's acceptance is read.

    None: the last window was closed instead (`close_window`); the step
    goes on from the running rows.
    """
    last = state.window
    assert last is not None
    if state.waiting or state.held or any(rid not in state.live for rid in last.rids):
        close_window(state)
        return None
    drafts = [_draft_count(state, last, row) for row in range(len(last.rids))]
    result = state.timed(
        partial(verify_ahead, last.window, last.unread.counts, drafts, state.pools)
    )
    step = result.value_or(None)
    if step is None:  # the bound does not fit: close, and let decode retract
        close_window(state)
        return None
    ahead, state.pools = step
    state.window = None
    verified, _ = _read(state, last)
    settled, state.pools = state.timed(lambda: exact_window(ahead, verified.counts, state.pools))
    committed = last.committed + verified.counts + 1  # the token after the accepted ones
    rids = last.rids
    histories = [state.prompts[rid] + state.generated(rid) for rid in rids]
    proposed = state.tokens.draft(histories, drafts)
    tokens = [[history[-1], *row] for history, row in zip(histories, proposed, strict=True)]
    return VerifyForward(settled, rids, committed, tokens, sum(drafts))


def close_window(state: EngineState) -> set[int]:
    """Read the unread window, `sync` it, release its finished rows; the requests that finished."""
    last = state.window
    assert last is not None
    state.window = None
    verified, done = _read(state, last)
    rows, state.pools = state.timed(lambda: sync(last.window, verified.counts, state.pools))
    keep = [row for row, rid in enumerate(last.rids) if rid in state.live]
    state.running = state.kept(rows, keep)
    # The next step may take its tokens from the device: they are host-known here.
    state.device_tokens = state.uploaded(state.running)
    return done


def _read(state: EngineState, last: UnreadWindow) -> tuple[Verified, set[int]]:
    # The step's one named read, then each live row's accepted drafts and the token after
    # them, up to a stop (rows that finished before this window record nothing).
    verified = state.tokens.read_acceptance(last.unread)
    trace = state.trace
    trace.named_reads += 1
    trace.accepted_drafts += int(verified.counts.sum())
    done = set()
    for row, rid in enumerate(last.rids):
        if rid not in state.live:
            continue
        for token in verified.accepted_tokens(row):
            if state.record_tokens([(rid, token)]):
                done.add(rid)
                break
    return verified, done


def _draft_count(state: EngineState, last: UnreadWindow, row: int) -> int:
    # The next window's drafts, before the last one's count is known: no more than the
    # request may output past the last window's fewest tokens (one) and the next token,
    # nor than fit in its table row with every draft of the last window accepted.
    held = int(last.committed[row] + last.window.draft_lens[row])
    room = state.pools.max_context_len - held - 1
    return max(min(state.config.speculative, state.remaining(last.rids[row]) - 2, room), 0)
