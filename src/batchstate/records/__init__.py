"""The batch as frozen records, one per phase, and what a transition returns with its pools."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.records.chunked import Chunked
    from batchstate.records.mixed import Mixed, MixStep, Settled
    from batchstate.records.phases import Batch, Decoding, Extended, Filtered, Idle, Running, Step
    from batchstate.records.rows import Req, Rows
    from batchstate.records.verifying import Verifying, VerifyStep

__all__ = [
    "Batch",
    "Chunked",
    "Decoding",
    "Extended",
    "Filtered",
    "Idle",
    "MixStep",
    "Mixed",
    "Req",
    "Rows",
    "Running",
    "Settled",
    "Step",
    "VerifyStep",
    "Verifying",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
