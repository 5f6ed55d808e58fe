"""The batch as frozen records, one per phase, and what a transition returns with its pools."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.records.chunked import Chunked
    from batchstate.records.mixed import FinishedMixed, Mixed, MixStep
    from batchstate.records.mixed import FinishedMixed as Settled
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

__all__ = [
    "Batch",
    "BatchAndPools",
    "Chunked",
    "Decoding",
    "Extended",
    "Filtered",
    "FinishedMixed",
    "Idle",
    "MixStep",
    "Mixed",
    "Req",
    "Rows",
    "Running",
    "VerifyStep",
    "Verifying",
]

# Old names, kept for one release: mypy reads them in `__all__` (so code naming
# them still type-checks under --strict); at run time they stay out of it.
if TYPE_CHECKING:
    __all__ += ["Settled", "Step"]

# Old names: each lookup warns and says what to use instead.
_DEPRECATED = {
    "Settled": "batchstate.records.FinishedMixed",
    "Step": "batchstate.records.BatchAndPools",
}

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals(), _DEPRECATED)
