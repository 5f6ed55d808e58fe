"""Base values: a device tensor and its host mirror as one value, upper bounds, and `unwrap`."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.base.mirrored import DeviceOnly, Mirrored
    from batchstate.base.results import (
        Err as Err,
    )
    from batchstate.base.results import (
        Ok as Ok,
    )
    from batchstate.base.results import (
        Outcome as Outcome,
    )
    from batchstate.base.results import (
        outcome as outcome,
    )
    from batchstate.base.results import (
        unwrap,
    )
    from batchstate.base.upper_bound import UpperBound

__all__ = [
    "DeviceOnly",
    "Mirrored",
    "UpperBound",
    "unwrap",
]

# Old names: each lookup warns and says what to use instead.
_DEPRECATED = {
    "Err": "returns.result.Failure",
    "Ok": "returns.result.Success",
    "Outcome": "returns.result.Result",
    "outcome": "the Result itself (returns.pipeline.is_successful, then .unwrap() or .failure())",
}

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals(), _DEPRECATED)
