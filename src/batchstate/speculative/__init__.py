"""Speculative decoding: the verify window, its one device read, and windows opened ahead of it."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.speculative.ahead import Ahead, AheadStep, settle_ahead, verify_ahead
    from batchstate.speculative.verification import sync, verify
    from batchstate.speculative.verified import Verified, read_verified

__all__ = [
    "Ahead",
    "AheadStep",
    "Verified",
    "read_verified",
    "settle_ahead",
    "sync",
    "verify",
    "verify_ahead",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
