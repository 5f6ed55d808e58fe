"""Whole-state invariants and leak checks, run on demand over records and pools."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.checks.invariants import check_batch, check_pools
    from batchstate.checks.leaks import Holder, Leaks, check_leaks, find_leaks

__all__ = [
    "Holder",
    "Leaks",
    "check_batch",
    "check_leaks",
    "check_pools",
    "find_leaks",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
