"""What a step runs: one forward kind per record, chosen by the step's planning stage.

Every step runs exactly one of them. Capabilities pick the kind (chunking,
mixed steps and overlap make admissions and decodes `MixedForward`;
speculation makes a decode `VerifyForward`; prebuilt arrivals make a
`Transfer`); the stages after planning do what the kind asks.
"""

from __future__ import annotations

from typing import TypeAlias, final

import attrs
import numpy as np
import numpy.typing as npt

from batchstate import Decoding, Extended, Filtered, Mixed, Sampling, Verifying

__all__ = [
    "DecodeForward",
    "ExtendForward",
    "Forward",
    "MixedForward",
    "NoForward",
    "Transfer",
    "VerifyForward",
]


@final
@attrs.frozen
class Transfer:
    """Prebuilt arrivals: their KV and first token come from a prefill server; no forward."""

    batch: Filtered[Sampling]
    prompts: list[tuple[int, ...]]  # each row's input ids, whose KV arrives


@final
@attrs.frozen
class ExtendForward:
    """Whole prompts of newly admitted requests; they join the running rows afterwards."""

    batch: Extended[Sampling]


@final
@attrs.frozen
class DecodeForward:
    """One token for every running row."""

    batch: Decoding[Sampling]


@final
@attrs.frozen
class MixedForward:
    """Chunks of prompts, decode rows, or both, in one forward (`mix`, `decode_sampled`)."""

    batch: Mixed[Sampling]


@final
@attrs.frozen
class VerifyForward:
    """Every running row's decode token and its drafts, checked by the target model."""

    window: Verifying[Sampling]
    rids: list[int]  # the rows' requests, in row order
    committed: npt.NDArray[np.int64]  # each row's length before its drafts
    tokens: list[list[int]]  # each row's last token, then its drafts
    num_drafted: int


@final
@attrs.frozen
class NoForward:
    """No row runs: the forward goes over no tokens (ranks sharing a forward take part)."""


Forward: TypeAlias = (
    Transfer | ExtendForward | DecodeForward | MixedForward | VerifyForward | NoForward
)
