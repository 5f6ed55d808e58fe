"""Stage five of a step: finished rows leave and release their memory; the rest run on.

Finished rows are split off and released (with the prefix cache on, their
KV stays cached); the others join the running batch: admitted rows merge
into it, decoded rows replace it, rows parked during a prefill step come
back. With overlap, the forward's tokens stay unread until the next step,
and each running row's last token stays on the device for the next
forward; a verify window's rows stay in it, unread, until the next step
(`_overlap_verify`). Then the step is traced.
"""

from __future__ import annotations

from time import perf_counter

from batchstate import Filtered, Sampling, idle, merge
from batchstate.engine._forwards import (
    DecodeForward,
    ExtendForward,
    MixedForward,
    Transfer,
    VerifyForward,
)
from batchstate.engine._record import Recorded
from batchstate.engine._run import DeviceTokens, HostTokens, Ran, UnreadVerified, VerifiedTokens
from batchstate.engine._state import EngineState, UnreadWindow

__all__ = ["finish"]


def finish(state: EngineState, ran: Ran, recorded: Recorded | None, start: float) -> None:
    """Retire the finished rows of the step's forward, keep the others running, trace the step."""
    trace = state.trace
    if isinstance(ran, UnreadVerified):
        _hold_window(state, ran)
        trace.append(
            is_extend=False, batch_size=len(ran.forward.rids), kv_tokens_used=state.used(),
            step_s=perf_counter() - start, bookkeeping_s=state.bookkeeping_s,
            audited=state.audited,
        )  # fmt: skip
        return
    if recorded is None:  # no row ran
        trace.append(
            is_extend=False, batch_size=0, kv_tokens_used=state.used(), step_s=0.0,
            bookkeeping_s=0.0, audited=False,
        )  # fmt: skip
        return
    is_extend, batch_size = False, len(recorded.rows.rows)
    match ran:
        case HostTokens(forward=Transfer()):
            state.timed(lambda: _retire_transferred(state, recorded))
            trace.prebuilt_requests += len(recorded.rows.rows)
            trace.prebuilt_steps += 1
            batch_size = 0  # no forward ran
        case HostTokens(forward=ExtendForward()):
            state.timed(lambda: _merge_kept(state, recorded))
            is_extend = True
        case HostTokens(forward=DecodeForward()):
            state.timed(lambda: _replace_kept(state, recorded))
        case DeviceTokens(forward, sampled):
            _finish_mixed(state, forward, recorded)
            is_extend, batch_size = bool(forward.batch.num_extend_rows), len(forward.batch.rows)
            if state.config.overlap:
                # This forward's tokens, read next step, for the rows that go on as they are.
                partial = {forward.batch.rows.reqs[row].rid for row in forward.batch.partial}
                rids = set(recorded.rows.rows.rids.tolist())
                state.unread, state.unread_rids = sampled, rids - recorded.done - partial
        case VerifiedTokens(forward):
            _finish_verify(state, forward, recorded)
    trace.append(
        is_extend=is_extend, batch_size=batch_size, kv_tokens_used=state.used(),
        step_s=perf_counter() - start, bookkeeping_s=state.bookkeeping_s, audited=state.audited,
    )  # fmt: skip


def _merge_kept(state: EngineState, recorded: Recorded) -> None:
    state.running = merge(state.running, state.kept(recorded.rows, recorded.keep))


def _replace_kept(state: EngineState, recorded: Recorded) -> None:
    state.running = state.kept(recorded.rows, recorded.keep)


def _retire_transferred(state: EngineState, recorded: Recorded) -> None:
    # Rows whose first token finished them leave at once; the rest join the running batch.
    assert isinstance(recorded.rows, Filtered)
    kept = state.kept(recorded.rows, recorded.keep)
    if state.config.overlap and len(kept.rows):
        # Their first tokens, known on the host, join the running rows' on the device.
        state.device_tokens = state.joined(state.running, state.uploaded(kept))
    state.running = merge(state.running, kept)


def _finish_mixed(state: EngineState, forward: MixedForward, recorded: Recorded) -> None:
    trace, batch = state.trace, forward.batch
    if state.config.overlap:
        trace.overshoot_tokens += len(recorded.rows.rows) - len(recorded.keep)
    state.timed(lambda: _retire_mixed(state, recorded))
    trace.named_reads += 1
    trace.num_chunks += len(batch.partial)
    trace.prefill_computed += batch.num_extend_tokens
    num_decode = len(batch.rows) - batch.num_extend_rows
    trace.num_mixed_steps += bool(batch.num_extend_rows and num_decode)


def _retire_mixed(state: EngineState, recorded: Recorded) -> None:
    assert isinstance(recorded.rows, Filtered)
    kept = state.kept(recorded.rows, recorded.keep)
    parked = state.parked
    state.parked = None
    if parked is None:
        state.running = kept
        return
    if recorded.done and isinstance(parked, Filtered):
        # Overlap: rows that sat out this prefill step may have finished one step late.
        rids = parked.rows.rids.tolist()
        parked = state.kept(
            parked, [row for row, rid in enumerate(rids) if rid not in recorded.done]
        )
    state.running = merge(parked, kept)


def _finish_verify(state: EngineState, forward: VerifyForward, recorded: Recorded) -> None:
    assert isinstance(recorded.rows, Filtered)
    state.running = state.kept(recorded.rows, recorded.keep)
    if state.config.overlap:
        # The next step may take its tokens from the device: they are host-known here.
        state.device_tokens = state.uploaded(state.running)
    trace = state.trace
    trace.speculative_steps += 1
    trace.drafted_tokens += forward.num_drafted
    trace.accepted_drafts += recorded.accepted


def _hold_window(state: EngineState, ran: UnreadVerified) -> None:
    # The window holds the rows until the next step reads its acceptance.
    forward = ran.forward
    state.window = UnreadWindow(forward.window, forward.rids, forward.committed, ran.unread)
    state.running = idle(forward.window.device, Sampling)
    state.device_tokens = None
    trace = state.trace
    trace.speculative_steps += 1
    trace.drafted_tokens += forward.num_drafted
