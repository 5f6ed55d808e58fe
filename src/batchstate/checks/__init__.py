"""Whole-state invariants and leak checks, run on demand over records and pools."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.checks.invariants import check_batch, check_pools
    from batchstate.checks.leaks import Leaks, SlotHolder, check_leaks, find_leaks
    from batchstate.checks.leaks import SlotHolder as Holder

__all__ = [
    "Leaks",
    "SlotHolder",
    "check_batch",
    "check_leaks",
    "check_pools",
    "find_leaks",
]

# Old names, kept for one release: mypy reads them in `__all__` (so code naming
# them still type-checks under --strict); at run time they stay out of it.
if TYPE_CHECKING:
    __all__ += ["Holder"]

# Old names: each lookup warns and says what to use instead.
_DEPRECATED = {
    "Holder": "batchstate.checks.SlotHolder",
}

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals(), _DEPRECATED)
