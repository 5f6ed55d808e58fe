"""Memory kinds and their allocators: free lists, token table, window pages, state slots."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.memory.free_list import FreeList
    from batchstate.memory.hybrid_pools import HybridPools
    from batchstate.memory.kinds import FULL_ATTENTION, MemoryKinds, RecurrentState, SlidingWindow
    from batchstate.memory.state_slots import StateSlots
    from batchstate.memory.token_table import TokenTable
    from batchstate.memory.window_pages import WindowPages

__all__ = [
    "FULL_ATTENTION",
    "FreeList",
    "HybridPools",
    "MemoryKinds",
    "RecurrentState",
    "SlidingWindow",
    "StateSlots",
    "TokenTable",
    "WindowPages",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
