"""Which `Pools` value of a lineage is the newest: a stamp shared by every value of one.

Pools are linear: a successful transition commits its result, which makes
every earlier value stale. The values of one lineage share the table and
free-list buffers, so they share this stamp too.
"""

from __future__ import annotations

import itertools
from typing import Final, final

__all__ = ["GENERATION_BITS", "Stamp"]

# Generations are 64-bit: each lineage numbers its slot allocations from its own
# base, 2**40 apart (2**40 allocations: 35 years at 1,000 a second), so two
# lineages never issue the same generation and a record of one is stale in the
# other. 2**22 lineages per process before the bases wrap around.
GENERATION_BITS: Final = 40
_LINEAGES: Final = 1 << 22
_next_lineage = itertools.count()


@final
class Stamp:
    """The version stamp every `Pools` of one lineage (one `make_pools`) shares.

    It sits beside the table and free-list buffers they share, and holds the
    newest committed value's version. Versions are issued once each, so no
    two values ever carry the same one. `first_gen` is the generation the
    lineage's first slot allocation gets: lineages count from bases 2**40
    apart, so a record holding a slot of one lineage is stale in any other,
    whatever its history.
    """

    __slots__ = ("__weakref__", "current", "first_gen", "issued")

    def __init__(self) -> None:
        self.current = 0
        self.issued = 0
        lineage = next(_next_lineage) % _LINEAGES
        self.first_gen = (lineage << GENERATION_BITS) + 1

    def issue(self) -> int:
        self.issued += 1
        return self.issued
