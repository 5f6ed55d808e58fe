"""Everything batchstate reports, under one base class: `except batchstate.errors.Error`.

Failure values are what a transition returns in a `returns` `Failure`
when it runs out of something (`OutOfKVTokens`, `OutOfReqSlots`, ...):
frozen records with the facts to act on, compared by value. Exceptions are
what a broken contract raises (`PhaseError`, `StaleRecord`, ...); each
also subclasses the builtin a caller would already catch. The type aliases
(`ExtendError`, `DecodeError`, `MixError`, `AllocError`, `ReleaseError`)
are the unions of failure values each transition can return.

The engine's and the SGLang integration's own exceptions
(`batchstate.engine.EngineError`, `batchstate.sglang.Divergence`, ...)
derive from `Error` too.
"""

# The names below load on first use (PEP 562), as the package's own do.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.audit import DeviceReadError
    from batchstate.base.errors import (
        AllocError,
        BatchConflict,
        ColumnError,
        ContextTooLong,
        DecodeError,
        DoesNotFit,
        DraftError,
        EmptyExtend,
        EmptyPrompt,
        Error,
        ExtendError,
        ForwardInputsError,
        GraphBuffersError,
        InvariantViolation,
        KeepIndicesError,
        MemoryKindError,
        MixError,
        NoChunkBudget,
        NotHeld,
        NotOwned,
        OutOfKVTokens,
        OutOfReqSlots,
        PaddingError,
        PhaseError,
        PoolsArgumentError,
        RecordShapeError,
        ReleaseError,
        StalePools,
        StaleRecord,
        StillRunning,
        TokenIdError,
        TooLargeToPad,
        UnwrapError,
    )

__all__ = [
    "AllocError",
    "BatchConflict",
    "ColumnError",
    "ContextTooLong",
    "DecodeError",
    "DeviceReadError",
    "DoesNotFit",
    "DraftError",
    "EmptyExtend",
    "EmptyPrompt",
    "Error",
    "ExtendError",
    "ForwardInputsError",
    "GraphBuffersError",
    "InvariantViolation",
    "KeepIndicesError",
    "MemoryKindError",
    "MixError",
    "NoChunkBudget",
    "NotHeld",
    "NotOwned",
    "OutOfKVTokens",
    "OutOfReqSlots",
    "PaddingError",
    "PhaseError",
    "PoolsArgumentError",
    "RecordShapeError",
    "ReleaseError",
    "StalePools",
    "StaleRecord",
    "StillRunning",
    "TokenIdError",
    "TooLargeToPad",
    "UnwrapError",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
