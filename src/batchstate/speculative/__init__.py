"""Speculative decoding: the verify window, its one device read, and windows opened ahead of it."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.speculative.ahead import (
        WindowAhead,
        WindowAheadStep,
        exact_window,
        verify_ahead,
    )
    from batchstate.speculative.ahead import WindowAhead as Ahead
    from batchstate.speculative.ahead import WindowAheadStep as AheadStep
    from batchstate.speculative.ahead import exact_window as settle_ahead
    from batchstate.speculative.verification import sync, verify
    from batchstate.speculative.verified import Verified, read_verified

__all__ = [
    "Verified",
    "WindowAhead",
    "WindowAheadStep",
    "exact_window",
    "read_verified",
    "sync",
    "verify",
    "verify_ahead",
]

# Old names, kept for one release: mypy reads them in `__all__` (so code naming
# them still type-checks under --strict); at run time they stay out of it.
if TYPE_CHECKING:
    __all__ += ["Ahead", "AheadStep", "settle_ahead"]

# Old names: each lookup warns and says what to use instead.
_DEPRECATED = {
    "Ahead": "batchstate.speculative.WindowAhead",
    "AheadStep": "batchstate.speculative.WindowAheadStep",
    "settle_ahead": "batchstate.speculative.exact_window",
}

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals(), _DEPRECATED)
