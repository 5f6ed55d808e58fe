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
    from batchstate.base.errors import (
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
    from batchstate.base.mirrored import DeviceOnly, Mirrored
    from batchstate.base.results import Err, Ok, Outcome, UnwrapError, outcome, unwrap
    from batchstate.base.upper_bound import UpperBound
    from batchstate.base.version import __version__
    from batchstate.cache.anchors import Anchor, HybridCache
    from batchstate.cache.prefix_cache import PrefixCache
    from batchstate.captured.graph_buffers import DoesNotFit, GraphBuffers, GraphBuffersError, fill
    from batchstate.captured.hybrid_buffers import HybridBuffers, fill_hybrid
    from batchstate.captured.padding import (
        FILL_FIELDS,
        SGLANG_FILLS,
        VLLM_FILLS,
        Padded,
        PaddedOutput,
        TooLargeToPad,
        bucket,
        pad,
        unpad,
        unpad_tokens,
    )
    from batchstate.captured.sizes import PaddingError
    from batchstate.checks.invariants import check_batch, check_pools
    from batchstate.checks.leaks import Holder, Leaks, check_leaks, find_leaks
    from batchstate.columns.building import build_columns
    from batchstate.columns.columns import Columns, HostColumn, NoColumns
    from batchstate.columns.sampling import Sampling
    from batchstate.columns.sampling_params import GREEDY, SamplingParams
    from batchstate.forward.accepted_states import StateCopies, accepted_states
    from batchstate.forward.anchor_copies import CachedCopies
    from batchstate.forward.hybrid import HybridInputs, StateInputs, WindowInputs, hybrid_inputs
    from batchstate.forward.inputs import (
        ForwardInputs,
        ForwardInputsError,
        ForwardPhase,
        forward_inputs,
    )
    from batchstate.forward.transfer import TransferTargets, transfer_targets
    from batchstate.memory.free_list import FreeList
    from batchstate.memory.hybrid_pools import HybridPools
    from batchstate.memory.kinds import FULL_ATTENTION, MemoryKinds, RecurrentState, SlidingWindow
    from batchstate.memory.state_slots import StateSlots
    from batchstate.memory.token_table import TokenTable
    from batchstate.memory.window_pages import WindowPages
    from batchstate.pools.lifecycle import flush, make_pools
    from batchstate.pools.pools import Allocation, Pools
    from batchstate.records.chunked import Chunked
    from batchstate.records.mixed import Mixed, MixStep, Settled, settle
    from batchstate.records.phases import Batch, Decoding, Extended, Filtered, Idle, Running, Step
    from batchstate.records.rows import Req, Rows
    from batchstate.records.verifying import Verifying, VerifyStep
    from batchstate.speculative.ahead import Ahead, AheadStep, settle_ahead, verify_ahead
    from batchstate.speculative.verified import Verified, read_verified
    from batchstate.speculative.verify import sync, verify
    from batchstate.table import TRANSITIONS, Transition
    from batchstate.transitions.decode import DecodeError, decode
    from batchstate.transitions.extend import ExtendError, extend, idle, prebuilt
    from batchstate.transitions.filter import Departed, Split, filter_batch, keep_indices, split
    from batchstate.transitions.merge import merge
    from batchstate.transitions.mix import MixError, decode_sampled, mix
    from batchstate.transitions.release import release
    from batchstate.transitions.sampled import Sampled, follow, join_sampled, read_sampled


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
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
