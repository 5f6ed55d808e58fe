"""The transition table, as data: which phase goes to which, through what."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final, TypeAlias, final

import attrs

from batchstate.base.errors import (
    BatchConflict,
    ContextTooLong,
    DraftError,
    EmptyExtend,
    EmptyPrompt,
    KeepIndicesError,
    NoChunkBudget,
    NotHeld,
    OutOfKVTokens,
    OutOfReqSlots,
    StaleRecord,
)
from batchstate.captured.graph_buffers import DoesNotFit, GraphBuffersError, fill_buffers
from batchstate.captured.hybrid_buffers import fill_hybrid_buffers
from batchstate.captured.padding import Padded, TooLargeToPad, pad
from batchstate.captured.sizes import PaddingError
from batchstate.forward.hybrid import HybridInputs, hybrid_inputs
from batchstate.forward.inputs import ForwardInputs, ForwardInputsError, forward_inputs
from batchstate.forward.transfer import TransferTargets, transfer_targets
from batchstate.records.chunked import Chunked
from batchstate.records.mixed import Mixed, finish_mixed
from batchstate.records.phases import RUNNING_PHASES, Decoding, Extended, Filtered, Idle
from batchstate.records.verifying import Verifying
from batchstate.speculative.ahead import WindowAhead, exact_window, verify_ahead
from batchstate.speculative.verification import sync, verify
from batchstate.transitions.admission import admit_prefilled, extend, idle
from batchstate.transitions.decoding import decode
from batchstate.transitions.filtering import filter_batch, split
from batchstate.transitions.merging import merge
from batchstate.transitions.mixing import decode_sampled, mix

__all__ = ["TRANSITIONS", "Transition", "render_transitions"]


# A phase's class; each is generic over its column set, which the table leaves open.
Phase: TypeAlias = type[object]


@final
@attrs.frozen
class Transition:
    """One row of the table: `function(source, ...) -> target`.

    `source` is None for a constructor. `operand` is the phase of a second
    batch argument (merge's incoming side). `failures` are the `Failure`
    values it may return, `raises` the exceptions for broken contracts.
    """

    source: Phase | None
    function: Callable[..., object]
    target: Phase
    operand: Phase | None = None
    failures: tuple[type, ...] = ()
    raises: tuple[type[Exception], ...] = ()


_ADMIT_FAILURES: Final = (
    OutOfReqSlots,
    OutOfKVTokens,
    ContextTooLong,
    EmptyExtend,
    EmptyPrompt,
    NotHeld,
)
_MIX_FAILURES: Final = (
    NoChunkBudget,
    EmptyExtend,
    NotHeld,
    EmptyPrompt,
    ContextTooLong,
    OutOfReqSlots,
    OutOfKVTokens,
)

TRANSITIONS: Final[tuple[Transition, ...]] = (
    Transition(None, idle, Idle),
    Transition(Idle, extend, Extended, failures=_ADMIT_FAILURES, raises=(BatchConflict,)),
    Transition(Idle, admit_prefilled, Filtered, failures=_ADMIT_FAILURES, raises=(BatchConflict,)),
    # Where a prebuilt batch's transferred memory goes (a window's tail, a state); no pools.
    Transition(Filtered, transfer_targets, TransferTargets, raises=(StaleRecord, BatchConflict)),
    *(
        Transition(
            source,
            decode,
            Decoding,
            failures=(OutOfKVTokens, ContextTooLong),
            raises=(BatchConflict, StaleRecord),  # other devices; a batch or pools out of date
        )
        for source in RUNNING_PHASES
    ),
    *(
        Transition(source, function, Filtered, raises=(KeepIndicesError,))
        for function in (filter_batch, split)  # split also hands over the rows that left
        for source in RUNNING_PHASES
    ),
    *(
        Transition(source, merge, Filtered, operand=operand, raises=(BatchConflict,))
        for source in (Decoding, Filtered, Idle)
        for operand in (Extended, Filtered)
    ),
    # Speculative decoding: `sync` is the one transition that reads the device.
    Transition(
        Decoding,
        verify,
        Verifying,
        failures=(OutOfKVTokens, ContextTooLong),
        raises=(DraftError, BatchConflict),
    ),
    Transition(Verifying, sync, Filtered, raises=(DraftError,)),
    # Under overlap: the next window opened from the device's counts, unread; settled to an
    # exact window once the counts are on the host (read_verified).
    Transition(
        Verifying,
        verify_ahead,
        WindowAhead,
        failures=(OutOfKVTokens, ContextTooLong),
        raises=(DraftError, BatchConflict),
    ),
    Transition(WindowAhead, exact_window, Verifying, raises=(DraftError,)),
    # Chunked prefill and mixed forwards: new requests (no operand) or a held chunk.
    *(
        Transition(
            source,
            mix,
            Mixed,
            operand=operand,
            failures=_MIX_FAILURES,
            raises=(BatchConflict, StaleRecord),
        )
        for source in (Idle, Filtered)
        for operand in (None, Chunked)
    ),
    # Device-resident tokens: decode fed the last forward's sampled tokens.
    Transition(
        Filtered,
        decode_sampled,
        Mixed,
        failures=(OutOfKVTokens, ContextTooLong),
        raises=(BatchConflict, StaleRecord),
    ),
    # After a mixed forward: the running rows, and a Chunked per prompt that goes on.
    Transition(Mixed, finish_mixed, Filtered),
    Transition(Mixed, finish_mixed, Chunked),
    # What a forward consumes: derived from any record that runs one, then padded to a
    # captured CUDA-graph size. Neither changes the record or the pools.
    *(
        Transition(
            source,
            forward_inputs,
            ForwardInputs,
            raises=(ForwardInputsError, BatchConflict),  # bad page size or slot tokens; devices
        )
        for source in (Idle, Extended, Decoding, Mixed, Verifying)
    ),
    Transition(ForwardInputs, pad, Padded, failures=(TooLargeToPad,), raises=(PaddingError,)),
    # The same, padded, written straight from the record into one captured bucket's buffers,
    # allocated once.
    *(
        Transition(
            source,
            fill_buffers,
            Padded,
            failures=(DoesNotFit,),
            raises=(GraphBuffersError, ForwardInputsError, BatchConflict, PaddingError),
        )
        for source in (Idle, Extended, Decoding, Mixed, Verifying)
    ),
    # A hybrid model's window and recurrent layers: their pages, window starts and state
    # slots, from the pools the forward's transition returned. Changes neither.
    Transition(ForwardInputs, hybrid_inputs, HybridInputs, raises=(ForwardInputsError,)),
    # The same, written into a captured bucket's `HybridBuffers`.
    Transition(
        ForwardInputs,
        fill_hybrid_buffers,
        HybridInputs,
        failures=(DoesNotFit,),
        raises=(GraphBuffersError, ForwardInputsError),
    ),
)


# Render the transition table for the docs, from the same data the tests walk.


_HEADER = (
    "| from phase | transition | with | failure (`Failure`) | raises | to phase |",
    "|---|---|---|---|---|---|",
)


def render_transitions(table: Iterable[Transition] = TRANSITIONS) -> str:
    """The transition table as a Markdown table, one row per transition.

    >>> print(render_transitions()[:60])
    | from phase | transition | with | failure (`Failure`) | rai
    """
    lines = [*_HEADER]
    for row in table:
        cells = (
            _name(row.source) if row.source else "—",
            f"`{row.function.__name__}`",
            _name(row.operand) if row.operand else "",
            ", ".join(_name(kind) for kind in row.failures),
            ", ".join(_name(kind) for kind in row.raises),
            _name(row.target),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _name(kind: type) -> str:
    return f"`{kind.__name__}`"
