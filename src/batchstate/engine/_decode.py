"""Decoding the running rows, retracting while the KV pool is too small for everyone's token.

Without overlap or chunks, `decode` (a `Decoding` record); with them,
`decode_sampled` or a `mix` of decode rows alone (a `Mixed` record), fed
each row's last token on the device or the host.
"""

from __future__ import annotations

from functools import partial

from returns.result import Result

from batchstate import (
    Decoding,
    Filtered,
    Idle,
    Mixed,
    MixError,
    MixStep,
    OutOfKVTokens,
    Sampled,
    Sampling,
    decode,
    decode_sampled,
)
from batchstate.engine._admit import columns_of, mix_rows, running_tokens
from batchstate.engine._config import EngineError
from batchstate.engine._retract import retract_held, retract_row
from batchstate.engine._state import EngineState

__all__ = ["decode_mixed", "decode_rows"]


def decode_rows(state: EngineState) -> Decoding[Sampling]:
    """`decode` over every running row; the policy's victims leave while the KV is short."""
    while True:
        running = state.running
        if isinstance(running, Idle):
            raise EngineError("decode with nothing running")
        result = state.timed(partial(decode, running, state.pools))
        step = result.value_or(None)
        if step is not None:
            state.pools = step.pools
            return step.batch
        failure = result.failure()
        if not isinstance(failure, OutOfKVTokens) or len(running.rows) == 1:
            raise EngineError(f"decode failed with {len(running.rows)} running: {failure}")
        retract_row(state, running)


def decode_mixed(state: EngineState) -> Mixed[Sampling] | None:
    """A decode of every running row as a `Mixed` record; None: no row is running.

    When the KV is short, a held chunk gives its memory back first, then the
    policy's victims.
    """
    while len(state.running.rows):
        running = state.running
        assert isinstance(running, Filtered)
        tokens = running_tokens(state, running)
        result: Result[MixStep[Sampling], MixError]
        if isinstance(tokens, Sampled):
            result = state.timed(partial(decode_sampled, running, tokens, state.pools))
        else:
            no_rows = columns_of(state, (), running.rows.device)
            result = state.timed(partial(mix_rows, running, (), 1, state.pools, tokens, no_rows))
        step = result.value_or(None)
        if step is not None:
            state.pools = step.pools
            return step.batch
        failure = result.failure()
        if not isinstance(failure, OutOfKVTokens):
            raise EngineError(f"decode failed with {len(running.rows)} running: {failure}")
        if state.held:
            retract_held(state)
        elif len(running.rows) > 1:
            retract_row(state, running)
        else:
            raise EngineError(f"decode failed with 1 running: {failure}")
    return None
