"""batchstate: an LLM serving scheduler's per-step batch as frozen records with pure transitions.

A device tensor and its CPU mirror are one `Mirrored` value; the four phases
`Idle`, `Extended`, `Decoding` and `Filtered` are frozen records, with
`Mixed` (prompt chunks and decode rows in one forward), `Chunked` (a request
between chunks) and `Verifying` (speculation's window) beside them; every
transition returns a new record (and new `Pools` where it allocates).

This namespace holds what a scheduler uses every step (`__all__`). The rest
lives in namespaces by concept: `batchstate.errors` (every failure and
exception, under `batchstate.errors.Error`), `batchstate.columns`,
`batchstate.memory`, `batchstate.cache`, `batchstate.pools`,
`batchstate.records`, `batchstate.transitions`, `batchstate.speculative`,
`batchstate.forward`, `batchstate.captured`, `batchstate.checks` and
`batchstate.table`. Names that lived here before still import from here.
"""

# The names below load on first use (PEP 562's module `__getattr__`): a light
# import of the package, such as `batchstate --help`'s, does not pay for torch.
# mypy and the docs read these imports as written; at run time, `attach`
# reads the same lines to find the module of each name.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Every name importable from here: the core (`__all__` below) and, for code written
    # before the namespaces, their names too (`X as X`: an explicit re-export for mypy).
    from batchstate.base.errors import (
        AllocError as AllocError,
    )
    from batchstate.base.errors import (
        BatchConflict as BatchConflict,
    )
    from batchstate.base.errors import (
        ColumnError as ColumnError,
    )
    from batchstate.base.errors import (
        ContextTooLong as ContextTooLong,
    )
    from batchstate.base.errors import (
        DecodeError as DecodeError,
    )
    from batchstate.base.errors import (
        DoesNotFit as DoesNotFit,
    )
    from batchstate.base.errors import (
        DraftError as DraftError,
    )
    from batchstate.base.errors import (
        EmptyExtend as EmptyExtend,
    )
    from batchstate.base.errors import (
        EmptyPrompt as EmptyPrompt,
    )
    from batchstate.base.errors import (
        ExtendError as ExtendError,
    )
    from batchstate.base.errors import (
        ForwardInputsError as ForwardInputsError,
    )
    from batchstate.base.errors import (
        GraphBuffersError as GraphBuffersError,
    )
    from batchstate.base.errors import (
        InvariantViolation as InvariantViolation,
    )
    from batchstate.base.errors import (
        KeepIndicesError as KeepIndicesError,
    )
    from batchstate.base.errors import (
        MemoryKindError as MemoryKindError,
    )
    from batchstate.base.errors import (
        MixError as MixError,
    )
    from batchstate.base.errors import (
        NoChunkBudget as NoChunkBudget,
    )
    from batchstate.base.errors import (
        NotHeld as NotHeld,
    )
    from batchstate.base.errors import (
        NotOwned as NotOwned,
    )
    from batchstate.base.errors import (
        OutOfKVTokens as OutOfKVTokens,
    )
    from batchstate.base.errors import (
        OutOfReqSlots as OutOfReqSlots,
    )
    from batchstate.base.errors import (
        PaddingError as PaddingError,
    )
    from batchstate.base.errors import (
        PhaseError as PhaseError,
    )
    from batchstate.base.errors import (
        PoolsArgumentError as PoolsArgumentError,
    )
    from batchstate.base.errors import (
        RecordShapeError as RecordShapeError,
    )
    from batchstate.base.errors import (
        ReleaseError as ReleaseError,
    )
    from batchstate.base.errors import (
        StalePools as StalePools,
    )
    from batchstate.base.errors import (
        StaleRecord as StaleRecord,
    )
    from batchstate.base.errors import (
        StillRunning as StillRunning,
    )
    from batchstate.base.errors import (
        TokenIdError as TokenIdError,
    )
    from batchstate.base.errors import (
        TooLargeToPad as TooLargeToPad,
    )
    from batchstate.base.errors import (
        UnwrapError as UnwrapError,
    )
    from batchstate.base.lazy import attach as attach
    from batchstate.base.mirrored import DeviceOnly, Mirrored
    from batchstate.base.results import Err as Err
    from batchstate.base.results import Ok as Ok
    from batchstate.base.results import Outcome as Outcome
    from batchstate.base.results import outcome as outcome
    from batchstate.base.results import unwrap
    from batchstate.base.upper_bound import UpperBound
    from batchstate.base.version import __version__
    from batchstate.cache.anchors import HybridCache as HybridCache
    from batchstate.cache.anchors import ResumePoint as Anchor
    from batchstate.cache.anchors import ResumePoint as ResumePoint
    from batchstate.cache.prefix_cache import PrefixCache as PrefixCache
    from batchstate.captured.graph_buffers import GraphBuffers as GraphBuffers
    from batchstate.captured.graph_buffers import fill_buffers as fill
    from batchstate.captured.graph_buffers import fill_buffers as fill_buffers
    from batchstate.captured.hybrid_buffers import (
        HybridBuffers as HybridBuffers,
    )
    from batchstate.captured.hybrid_buffers import (
        fill_hybrid_buffers as fill_hybrid,
    )
    from batchstate.captured.hybrid_buffers import (
        fill_hybrid_buffers as fill_hybrid_buffers,
    )
    from batchstate.captured.padding import (
        PAD_FIELDS as FILL_FIELDS,
    )
    from batchstate.captured.padding import (
        PAD_FIELDS as PAD_FIELDS,
    )
    from batchstate.captured.padding import (
        SGLANG_PAD_VALUES as SGLANG_FILLS,
    )
    from batchstate.captured.padding import (
        SGLANG_PAD_VALUES as SGLANG_PAD_VALUES,
    )
    from batchstate.captured.padding import (
        VLLM_PAD_VALUES as VLLM_FILLS,
    )
    from batchstate.captured.padding import (
        VLLM_PAD_VALUES as VLLM_PAD_VALUES,
    )
    from batchstate.captured.padding import (
        Padded as Padded,
    )
    from batchstate.captured.padding import (
        PaddedOutput as PaddedOutput,
    )
    from batchstate.captured.padding import (
        captured_size as bucket,
    )
    from batchstate.captured.padding import (
        captured_size as captured_size,
    )
    from batchstate.captured.padding import pad, unpad
    from batchstate.captured.padding import (
        unpad_tokens as unpad_tokens,
    )
    from batchstate.checks.invariants import check_batch, check_pools
    from batchstate.checks.leaks import Leaks as Leaks
    from batchstate.checks.leaks import SlotHolder as Holder
    from batchstate.checks.leaks import SlotHolder as SlotHolder
    from batchstate.checks.leaks import check_leaks as check_leaks
    from batchstate.checks.leaks import find_leaks
    from batchstate.columns.building import build_columns
    from batchstate.columns.columns import Columns, HostColumn, NoColumns
    from batchstate.columns.sampling import Sampling
    from batchstate.columns.sampling_params import GREEDY, SamplingParams
    from batchstate.forward.anchor_copies import CachedCopies as CachedCopies
    from batchstate.forward.contract import check_forward as check_forward
    from batchstate.forward.hybrid import (
        HybridInputs as HybridInputs,
    )
    from batchstate.forward.hybrid import (
        StateInputs as StateInputs,
    )
    from batchstate.forward.hybrid import (
        WindowInputs as WindowInputs,
    )
    from batchstate.forward.hybrid import (
        hybrid_inputs as hybrid_inputs,
    )
    from batchstate.forward.inputs import ForwardInputs, forward_inputs
    from batchstate.forward.inputs import ForwardPhase as ForwardPhase
    from batchstate.forward.speculative_states import (
        StateCopies as StateCopies,
    )
    from batchstate.forward.speculative_states import (
        accepted_states as accepted_states,
    )
    from batchstate.forward.transfer import (
        TransferTargets as TransferTargets,
    )
    from batchstate.forward.transfer import (
        transfer_targets as transfer_targets,
    )
    from batchstate.memory.free_list import FreeList as FreeList
    from batchstate.memory.hybrid_pools import HybridPools as HybridPools
    from batchstate.memory.kinds import (
        FULL_ATTENTION as FULL_ATTENTION,
    )
    from batchstate.memory.kinds import (
        MemoryKinds as MemoryKinds,
    )
    from batchstate.memory.kinds import (
        RecurrentState as RecurrentState,
    )
    from batchstate.memory.kinds import (
        SlidingWindow as SlidingWindow,
    )
    from batchstate.memory.state_slots import StateSlots as StateSlots
    from batchstate.memory.token_table import TokenTable as TokenTable
    from batchstate.memory.window_pages import WindowPages as WindowPages
    from batchstate.pools.lifecycle import flush, make_pools
    from batchstate.pools.pools import Allocation as Allocation
    from batchstate.pools.pools import Pools
    from batchstate.records.chunked import Chunked
    from batchstate.records.mixed import FinishedMixed as FinishedMixed
    from batchstate.records.mixed import FinishedMixed as Settled
    from batchstate.records.mixed import Mixed, MixStep, finish_mixed
    from batchstate.records.mixed import finish_mixed as settle
    from batchstate.records.phases import (
        Batch,
        BatchAndPools,
        Decoding,
        Extended,
        Filtered,
        Idle,
        Running,
    )
    from batchstate.records.phases import BatchAndPools as Step
    from batchstate.records.rows import Req, Rows
    from batchstate.records.verifying import Verifying, VerifyStep
    from batchstate.speculative.ahead import (
        WindowAhead as Ahead,
    )
    from batchstate.speculative.ahead import (
        WindowAhead as WindowAhead,
    )
    from batchstate.speculative.ahead import (
        WindowAheadStep as AheadStep,
    )
    from batchstate.speculative.ahead import (
        WindowAheadStep as WindowAheadStep,
    )
    from batchstate.speculative.ahead import (
        exact_window as exact_window,
    )
    from batchstate.speculative.ahead import (
        exact_window as settle_ahead,
    )
    from batchstate.speculative.ahead import (
        verify_ahead as verify_ahead,
    )
    from batchstate.speculative.verification import sync, verify
    from batchstate.speculative.verified import Verified as Verified
    from batchstate.speculative.verified import read_verified as read_verified
    from batchstate.table import TRANSITIONS
    from batchstate.table import Transition as Transition
    from batchstate.transitions.admission import admit_prefilled as admit_prefilled
    from batchstate.transitions.admission import admit_prefilled as prebuilt
    from batchstate.transitions.admission import extend, idle
    from batchstate.transitions.decoding import decode
    from batchstate.transitions.filtering import Departed, Split, filter_batch, split
    from batchstate.transitions.filtering import keep_indices as keep_indices
    from batchstate.transitions.merging import merge
    from batchstate.transitions.mixing import decode_sampled, mix
    from batchstate.transitions.releasing import release
    from batchstate.transitions.sampled import Sampled, gather_sampled, join_sampled, read_sampled
    from batchstate.transitions.sampled import gather_sampled as follow

__all__ = [
    "GREEDY",
    "TRANSITIONS",
    "Batch",
    "BatchAndPools",
    "Chunked",
    "Columns",
    "Decoding",
    "Departed",
    "DeviceOnly",
    "Extended",
    "Filtered",
    "ForwardInputs",
    "HostColumn",
    "Idle",
    "Mirrored",
    "MixStep",
    "Mixed",
    "NoColumns",
    "Pools",
    "Req",
    "Rows",
    "Running",
    "Sampled",
    "Sampling",
    "SamplingParams",
    "Split",
    "UpperBound",
    "VerifyStep",
    "Verifying",
    "__version__",
    "build_columns",
    "check_batch",
    "check_pools",
    "decode",
    "decode_sampled",
    "extend",
    "filter_batch",
    "find_leaks",
    "finish_mixed",
    "flush",
    "forward_inputs",
    "gather_sampled",
    "idle",
    "join_sampled",
    "make_pools",
    "merge",
    "mix",
    "pad",
    "read_sampled",
    "release",
    "split",
    "sync",
    "unpad",
    "unwrap",
    "verify",
]

# Old names, kept for one release. mypy reads the renamed ones in `__all__`, so
# that code naming them still type-checks under --strict; at run time they stay
# out of it (and out of `import *` and the docs), and each lookup warns and says
# what to use instead.
if TYPE_CHECKING:
    __all__ += [
        "FILL_FIELDS",
        "SGLANG_FILLS",
        "VLLM_FILLS",
        "Ahead",
        "AheadStep",
        "Anchor",
        "Holder",
        "Settled",
        "Step",
        "bucket",
        "fill",
        "fill_hybrid",
        "follow",
        "prebuilt",
        "settle",
        "settle_ahead",
    ]

_DEPRECATED = {
    "Ahead": "batchstate.speculative.WindowAhead",
    "AheadStep": "batchstate.speculative.WindowAheadStep",
    "Anchor": "batchstate.cache.ResumePoint",
    "Err": "returns.result.Failure",
    "FILL_FIELDS": "batchstate.captured.PAD_FIELDS",
    "Holder": "batchstate.checks.SlotHolder",
    "Ok": "returns.result.Success",
    "Outcome": "returns.result.Result",
    "SGLANG_FILLS": "batchstate.captured.SGLANG_PAD_VALUES",
    "Settled": "batchstate.records.FinishedMixed",
    "Step": "batchstate.BatchAndPools",
    "VLLM_FILLS": "batchstate.captured.VLLM_PAD_VALUES",
    "bucket": "batchstate.captured.captured_size",
    "fill": "batchstate.captured.fill_buffers",
    "fill_hybrid": "batchstate.captured.fill_hybrid_buffers",
    "follow": "batchstate.gather_sampled",
    "outcome": "the Result itself (returns.pipeline.is_successful, then .unwrap() or .failure())",
    "prebuilt": "batchstate.transitions.admit_prefilled",
    "settle": "batchstate.finish_mixed",
    "settle_ahead": "batchstate.speculative.exact_window",
}

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals(), _DEPRECATED)
