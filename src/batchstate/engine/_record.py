"""Stage four of a step: record each row's new tokens and which requests finished.

Host tokens are recorded as they come. A mixed forward's tokens are settled
(rows whose prompt is not done are held as chunks); without overlap they
are read at once, with overlap the previous step's are read instead (one
step late: this step's stay on the device for the next step's inputs). A
verify forward's accepted drafts are synced, then each row's accepted
drafts and the target's token after them are recorded, up to a stop; with
overlap, the next step's plan reads and records them (`_overlap_verify`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import attrs

from batchstate import Decoding, Extended, Filtered, Mixed, Sampled, Sampling, finish_mixed, sync
from batchstate.engine._run import (
    DeviceTokens,
    HostTokens,
    NoTokens,
    Ran,
    UnreadVerified,
    VerifiedTokens,
)
from batchstate.engine._state import EngineState

__all__ = ["Recorded", "read_unread", "record"]


@final
@attrs.frozen
class Recorded:
    """The forward's rows, which of them go on, and the requests that finished this step."""

    rows: Extended[Sampling] | Decoding[Sampling] | Filtered[Sampling]
    keep: list[int]  # row indices of `rows` that go on
    done: set[int]  # requests that finished (with overlap: the previous step's rows too)
    accepted: int = 0  # verify: drafts the target accepted


def record(state: EngineState, ran: Ran) -> Recorded | None:
    """Record `ran`'s tokens into each request's output; None: no row ran."""
    match ran:
        case HostTokens(forward, tokens):
            rows = forward.batch
            rids = rows.rows.rids.tolist()
            done = state.record_tokens(zip(rids, tokens, strict=True))
            return Recorded(rows, [row for row, rid in enumerate(rids) if rid not in done], done)
        case DeviceTokens(forward, sampled):
            return _record_mixed(state, forward.batch, sampled)
        case VerifiedTokens(forward, verified):
            window = forward.window
            rows, state.pools = state.timed(lambda: sync(window, verified.accepted, state.pools))
            rids = forward.rids
            accepted = (rows.rows.seq_lens.host - forward.committed).tolist()
            done = _record_each(state, rids, verified.targets, accepted)
            keep = [row for row, rid in enumerate(rids) if rid not in done]
            return Recorded(rows, keep, done, sum(accepted))
        case UnreadVerified():
            return None  # read next step, when the next window is open
        case NoTokens():
            if state.config.overlap:
                read_unread(state)  # the previous step's tokens, read one step late
            return None


def _record_mixed(state: EngineState, batch: Mixed[Sampling], sampled: Sampled) -> Recorded:
    overlap = state.config.overlap
    done = read_unread(state) if overlap else set()
    if overlap:
        # Each running row's last token after this forward. A prefill step's rows
        # join the parked rows, whose tokens are still the last forward's.
        parked = state.parked
        state.device_tokens = sampled if parked is None else state.joined(parked, sampled)
    settled = state.timed(lambda: finish_mixed(batch))
    state.held.extend(settled.held)
    running = settled.running
    rids = running.rows.rids.tolist()
    if not overlap:
        by_rid = dict(zip(sampled.rids.tolist(), state.tokens.read(sampled), strict=True))
        done = state.record_tokens((rid, by_rid[rid]) for rid in rids)
    return Recorded(running, [row for row, rid in enumerate(rids) if rid not in done], done)


def read_unread(state: EngineState) -> set[int]:
    """Overlap: the previous forward's tokens reach the host, the one named read of the step."""
    if state.unread is None:
        return set()
    tokens = state.tokens.read(state.unread)
    rids = state.unread.rids.tolist()
    wanted = state.unread_rids
    state.unread, state.unread_rids = None, set()
    return state.record_tokens(
        (rid, token) for rid, token in zip(rids, tokens, strict=True) if rid in wanted
    )


def _record_each(
    state: EngineState,
    rids: Sequence[int],
    targets: Sequence[Sequence[int]],
    accepted: Sequence[int],
) -> set[int]:
    # Each row's accepted drafts and the target's token after them, up to a stop.
    done = set()
    for rid, outs, count in zip(rids, targets, accepted, strict=True):
        for token in outs[: count + 1]:
            if state.record_tokens([(rid, token)]):
                done.add(rid)
                break
    return done
