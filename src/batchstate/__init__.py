"""batchstate: an LLM serving scheduler's per-step batch as frozen records with pure transitions.

A device tensor and its CPU mirror are one `Mirrored` value; the four phases
`Idle`, `Extended`, `Decoding` and `Filtered` are frozen records, with
`Mixed` (prompt chunks and decode rows in one forward), `Chunked` (a request
between chunks) and `Verifying` (speculation's window) beside them; every
transition returns a new record (and new `Pools` where it allocates).
"""

# The names below load on first use (PEP 562's module `__getattr__`): a light
# import of the package, such as `batchstate --help`'s, does not pay for torch.
# mypy and the docs read these imports as written; at run time, `attach`
# reads the same lines to find the module of each name in `__all__`.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate._ahead import Ahead, AheadStep, settle_ahead, verify_ahead
    from batchstate._cached_copies import CachedCopies
    from batchstate._captured_sizes import PaddingError
    from batchstate._chunked import Chunked
    from batchstate._column_building import build_columns
    from batchstate._columns import Columns, HostColumn, NoColumns
    from batchstate._decode import DecodeError, decode
    from batchstate._errors import (
        AllocError,
        BatchConflict,
        ColumnError,
        ContextTooLong,
        DraftError,
        EmptyExtend,
        EmptyPrompt,
        InvariantViolation,
        KeepIndicesError,
        MemoryKindError,
        NoChunkBudget,
        NotHeld,
        NotOwned,
        OutOfKVTokens,
        OutOfReqSlots,
        PhaseError,
        PoolsArgumentError,
        RecordShapeError,
        ReleaseError,
        StalePools,
        StaleRecord,
        StillRunning,
    )
    from batchstate._extend import ExtendError, extend, idle, prebuilt
    from batchstate._fill import fill
    from batchstate._fill_tables import FILL_FIELDS, SGLANG_FILLS, VLLM_FILLS
    from batchstate._filter import Departed, Split, filter_batch, keep_indices, split
    from batchstate._forward_inputs import (
        ForwardInputs,
        ForwardInputsError,
        ForwardPhase,
        forward_inputs,
    )
    from batchstate._free_list import FreeList
    from batchstate._graph_buffers import DoesNotFit, GraphBuffers, GraphBuffersError
    from batchstate._hybrid_buffers import HybridBuffers, fill_hybrid
    from batchstate._hybrid_cache import Anchor, HybridCache
    from batchstate._hybrid_inputs import HybridInputs, StateInputs, WindowInputs, hybrid_inputs
    from batchstate._hybrid_pools import HybridPools
    from batchstate._invariants import check_batch, check_pools
    from batchstate._leaks import Holder, Leaks, check_leaks, find_leaks
    from batchstate._memory_kinds import FULL_ATTENTION, MemoryKinds, RecurrentState, SlidingWindow
    from batchstate._merge import merge
    from batchstate._mirrored import DeviceOnly, Mirrored
    from batchstate._mix import MixError, decode_sampled, mix
    from batchstate._mixed import Mixed, MixStep, Settled, settle
    from batchstate._outcome import Err, Ok, Outcome, outcome
    from batchstate._padding import (
        Padded,
        PaddedOutput,
        TooLargeToPad,
        bucket,
        pad,
        unpad,
        unpad_tokens,
    )
    from batchstate._phases import Batch, Decoding, Extended, Filtered, Idle, Running, Step
    from batchstate._pool_lifecycle import flush, make_pools
    from batchstate._pools import Allocation, Pools
    from batchstate._prefix_cache import PrefixCache
    from batchstate._release import release
    from batchstate._rows import Req, Rows
    from batchstate._sampled import Sampled, follow, join_sampled, read_sampled
    from batchstate._sampling import Sampling
    from batchstate._sampling_params import GREEDY, SamplingParams
    from batchstate._speculative import sync, verify
    from batchstate._state_copies import StateCopies, accepted_states
    from batchstate._state_slots import StateSlots
    from batchstate._token_table import TokenTable
    from batchstate._transfer_targets import TransferTargets, transfer_targets
    from batchstate._transitions import TRANSITIONS, Transition
    from batchstate._unwrap import UnwrapError, unwrap
    from batchstate._upper_bound import UpperBound
    from batchstate._verified import Verified, read_verified
    from batchstate._verifying import Verifying, VerifyStep
    from batchstate._version import __version__
    from batchstate._window_pages import WindowPages


__all__ = [
    "FILL_FIELDS",
    "FULL_ATTENTION",
    "GREEDY",
    "SGLANG_FILLS",
    "TRANSITIONS",
    "VLLM_FILLS",
    "Ahead",
    "AheadStep",
    "AllocError",
    "Allocation",
    "Anchor",
    "Batch",
    "BatchConflict",
    "CachedCopies",
    "Chunked",
    "ColumnError",
    "Columns",
    "ContextTooLong",
    "DecodeError",
    "Decoding",
    "Departed",
    "DeviceOnly",
    "DoesNotFit",
    "DraftError",
    "EmptyExtend",
    "EmptyPrompt",
    "Err",
    "ExtendError",
    "Extended",
    "Filtered",
    "ForwardInputs",
    "ForwardInputsError",
    "ForwardPhase",
    "FreeList",
    "GraphBuffers",
    "GraphBuffersError",
    "Holder",
    "HostColumn",
    "HybridBuffers",
    "HybridCache",
    "HybridInputs",
    "HybridPools",
    "Idle",
    "InvariantViolation",
    "KeepIndicesError",
    "Leaks",
    "MemoryKindError",
    "MemoryKinds",
    "Mirrored",
    "MixError",
    "MixStep",
    "Mixed",
    "NoChunkBudget",
    "NoColumns",
    "NotHeld",
    "NotOwned",
    "Ok",
    "OutOfKVTokens",
    "OutOfReqSlots",
    "Outcome",
    "Padded",
    "PaddedOutput",
    "PaddingError",
    "PhaseError",
    "Pools",
    "PoolsArgumentError",
    "PrefixCache",
    "RecordShapeError",
    "RecurrentState",
    "ReleaseError",
    "Req",
    "Rows",
    "Running",
    "Sampled",
    "Sampling",
    "SamplingParams",
    "Settled",
    "SlidingWindow",
    "Split",
    "StalePools",
    "StaleRecord",
    "StateCopies",
    "StateInputs",
    "StateSlots",
    "Step",
    "StillRunning",
    "TokenTable",
    "TooLargeToPad",
    "TransferTargets",
    "Transition",
    "UnwrapError",
    "UpperBound",
    "Verified",
    "VerifyStep",
    "Verifying",
    "WindowInputs",
    "WindowPages",
    "__version__",
    "accepted_states",
    "bucket",
    "build_columns",
    "check_batch",
    "check_leaks",
    "check_pools",
    "decode",
    "decode_sampled",
    "extend",
    "fill",
    "fill_hybrid",
    "filter_batch",
    "find_leaks",
    "flush",
    "follow",
    "forward_inputs",
    "hybrid_inputs",
    "idle",
    "join_sampled",
    "keep_indices",
    "make_pools",
    "merge",
    "mix",
    "outcome",
    "pad",
    "prebuilt",
    "read_sampled",
    "read_verified",
    "release",
    "settle",
    "settle_ahead",
    "split",
    "sync",
    "transfer_targets",
    "unpad",
    "unpad_tokens",
    "unwrap",
    "verify",
    "verify_ahead",
]


if not TYPE_CHECKING:
    from batchstate._lazy import attach

    __getattr__, __dir__ = attach(globals())
