"""Stage three of a step: run the forward, through the token source.

The source builds the forward's inputs from the batch (`forward_inputs`,
padded to a captured CUDA-graph size by its `Feeder`), runs the model, and
samples each row with its own parameters. Host tokens come back for
extend, decode and transfer; with chunks, mixed steps or overlap the tokens
stay on the device (`Sampled`) until the record stage reads them, and a
verify's accepted counts and tokens stay there until the next step's plan.
"""

from __future__ import annotations

from typing import TypeAlias, final

import attrs

from batchstate import Mixed, Sampled, Sampling, check_forward
from batchstate.engine._forwards import (
    DecodeForward,
    ExtendForward,
    Forward,
    MixedForward,
    NoForward,
    Transfer,
    VerifyForward,
)
from batchstate.engine._state import EngineState
from batchstate.engine._verify import Acceptance, UnreadAcceptance

__all__ = [
    "DeviceTokens",
    "HostTokens",
    "NoTokens",
    "Ran",
    "UnreadVerified",
    "VerifiedTokens",
    "run_forward",
]


@final
@attrs.frozen
class HostTokens:
    """Each row's next token on the host (a transfer's first tokens, an extend's, a decode's)."""

    forward: Transfer | ExtendForward | DecodeForward
    tokens: list[int]


@final
@attrs.frozen
class DeviceTokens:
    """Each row's next token, still on the device."""

    forward: MixedForward
    sampled: Sampled


@final
@attrs.frozen
class VerifiedTokens:
    """The drafts each row accepted and the target's token after each window position."""

    forward: VerifyForward
    verified: Acceptance


@final
@attrs.frozen
class UnreadVerified:
    """Overlap: the verify forward's acceptance, left on the device for the next step to read."""

    forward: VerifyForward
    unread: UnreadAcceptance


@final
@attrs.frozen
class NoTokens:
    """The forward ran over no rows."""


Ran: TypeAlias = HostTokens | DeviceTokens | VerifiedTokens | UnreadVerified | NoTokens


def run_forward(state: EngineState, forward: Forward) -> Ran:
    """Run `forward` on the model (or, on meta, draw its tokens).

    On a step whose pools are checked (`check_every`), the forward's
    contract is checked first (`check_forward`): no cell a row reads as its
    prefix is one the forward writes. Not on meta, which runs no model.
    """
    tokens, pools = state.tokens, state.pools
    _check_contract(state, forward)
    match forward:
        case Transfer(batch, prompts):
            return HostTokens(forward, tokens.transfer(batch, pools, prompts))
        case ExtendForward(batch):
            return HostTokens(forward, tokens.after_extend(batch, pools))
        case DecodeForward(batch):
            last = state.last_tokens(batch.rows.rids.tolist())
            return HostTokens(forward, tokens.after_decode(batch, pools, last))
        case MixedForward(batch):
            return DeviceTokens(forward, tokens.after_mixed(batch, pools, _sampling_of(batch)))
        case VerifyForward():
            return _run_verify(state, forward)
        case NoForward():
            tokens.after_idle(state.running)  # ranks sharing a forward join with no rows
            return NoTokens()


def _check_contract(state: EngineState, forward: Forward) -> None:
    # This step's pools are checked once it ends (`Engine._advance`): its forward before it runs.
    every, pools = state.config.check_every, state.pools
    if not every or (len(state.trace) + 1) % every or pools.table.device.device.type == "meta":
        return
    match forward:
        case ExtendForward(batch) | DecodeForward(batch) | MixedForward(batch):
            check_forward(batch, pools)
        case VerifyForward(window=window):
            check_forward(window, pools)
        case _:
            pass  # a transfer or no rows: no forward reads the cache


def _sampling_of(batch: Mixed[Sampling]) -> Sampling | None:
    # The rows' parameters, from the batch's columns; None when every row is greedy
    # (the forward then takes the argmax path, as before columns).
    columns = batch.rows.columns
    return columns if columns.temperature.host.any() else None


def _run_verify(state: EngineState, forward: VerifyForward) -> VerifiedTokens | UnreadVerified:
    # With overlap the acceptance stays on the device; without, it comes back now.
    tokens, pools = state.tokens, state.pools
    window, committed, rows = forward.window, forward.committed, forward.tokens
    if state.config.overlap:
        return UnreadVerified(forward, tokens.verify_unread(window, pools, committed, rows))
    return VerifiedTokens(forward, tokens.after_verify(window, pools, committed, rows))
