"""One `Pools` value: request slots, KV pages, the prefix cache, a hybrid model's memory."""

# Each name loads on first use (PEP 562): importing the namespace costs nothing.
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.pools.lifecycle import flush, make_pools
    from batchstate.pools.pools import Allocation, Pools

__all__ = [
    "Allocation",
    "Pools",
    "flush",
    "make_pools",
]

if not TYPE_CHECKING:
    from batchstate.base.lazy import attach

    __getattr__, __dir__ = attach(globals())
