"""batchstate: an LLM serving scheduler's per-step batch as frozen records with pure transitions.

A device tensor and its CPU mirror are one `Mirrored` value; the four phases
`Idle`, `Extended`, `Decoding` and `Filtered` are frozen records; every
transition returns a new record (and new `Pools` where it allocates).
"""

from batchstate._cached_extend import decode_cached, extend_cached
from batchstate._cached_invariants import check_cached_pools
from batchstate._cached_pools import CachedPools, CachedStep, cached_pools
from batchstate._cached_release import release_cached
from batchstate._columns import Columns, HostColumn, NoColumns, build_columns
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
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    PhaseError,
    RecordShapeError,
    ReleaseError,
    StaleRecord,
    StillRunning,
)
from batchstate._extend import ExtendError, Resumed, extend, idle, prebuilt
from batchstate._filter import Departed, Split, filter_batch, keep_indices, split
from batchstate._free_list import FreeList
from batchstate._invariants import check_batch, check_pools
from batchstate._merge import merge
from batchstate._mirrored import DeviceOnly, Mirrored
from batchstate._phases import Batch, Decoding, Extended, Filtered, Idle, Running, Step
from batchstate._pools import Allocation, Pools, make_pools
from batchstate._prefix_cache import PrefixCache
from batchstate._release import release
from batchstate._rows import Req, Rows
from batchstate._sampling import GREEDY, Sampling, SamplingParams
from batchstate._speculative import Verifying, VerifyStep, sync, verify
from batchstate._token_table import TokenTable
from batchstate._transitions import TRANSITIONS, Transition
from batchstate._unwrap import UnwrapError, unwrap
from batchstate._version import __version__

__all__ = [
    "GREEDY",
    "TRANSITIONS",
    "AllocError",
    "Allocation",
    "Batch",
    "BatchConflict",
    "CachedPools",
    "CachedStep",
    "ColumnError",
    "Columns",
    "ContextTooLong",
    "DecodeError",
    "Decoding",
    "Departed",
    "DeviceOnly",
    "DraftError",
    "EmptyExtend",
    "EmptyPrompt",
    "ExtendError",
    "Extended",
    "Filtered",
    "FreeList",
    "HostColumn",
    "Idle",
    "InvariantViolation",
    "KeepIndicesError",
    "Mirrored",
    "NoColumns",
    "NotOwned",
    "OutOfKVTokens",
    "OutOfReqSlots",
    "PhaseError",
    "Pools",
    "PrefixCache",
    "RecordShapeError",
    "ReleaseError",
    "Req",
    "Resumed",
    "Rows",
    "Running",
    "Sampling",
    "SamplingParams",
    "Split",
    "StaleRecord",
    "Step",
    "StillRunning",
    "TokenTable",
    "Transition",
    "UnwrapError",
    "VerifyStep",
    "Verifying",
    "__version__",
    "build_columns",
    "cached_pools",
    "check_batch",
    "check_cached_pools",
    "check_pools",
    "decode",
    "decode_cached",
    "extend",
    "extend_cached",
    "filter_batch",
    "idle",
    "keep_indices",
    "make_pools",
    "merge",
    "prebuilt",
    "release",
    "release_cached",
    "split",
    "sync",
    "unwrap",
    "verify",
]
