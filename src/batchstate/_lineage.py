"""Which `Pools` value of a lineage is the newest: a stamp shared by every value of one.

Pools are linear: a successful transition commits its result, which makes
every earlier value stale. The values of one lineage share the table and
free-list buffers, so they share this stamp too.
"""

from __future__ import annotations

from typing import final

__all__ = ["Stamp"]


@final
class Stamp:
    """The version stamp every `Pools` of one lineage (one `make_pools`) shares.

    It sits beside the table and free-list buffers they share, and holds the
    newest committed value's version. Versions are issued once each, so no
    two values ever carry the same one.
    """

    __slots__ = ("current", "issued")

    def __init__(self) -> None:
        self.current = 0
        self.issued = 0

    def issue(self) -> int:
        self.issued += 1
        return self.issued
