"""Sliding-window pages: the window layers' own KV pages, given back as rows grow past them.

Position `p` of a window layer reads positions `[p - window + 1, p]`. A row
holds window pages for its page indices `[start // page_size, pages)`:
`start` (a multiple of the page size) is its window start, a host value.
When a transition grows a row from `old` to `new` tokens, the forward it
builds reads positions from `old - window + 1` on, so every page wholly
before that is given back, and each new page gets a window page. Nothing
here reads the device: the window page table is a host array, and the
forward inputs upload the few window pages each row reads.
"""

from __future__ import annotations

from typing import Final, final

import attrs
import numpy as np
import numpy.typing as npt

from batchstate.base.errors import PoolsArgumentError
from batchstate.base.mirrored import HostArray, frozen, writing
from batchstate.base.read_only import read_only_copies
from batchstate.cache.anchors import tail_start
from batchstate.memory.free_list import FreeList
from batchstate.memory.kinds import SlidingWindow

__all__ = ["WindowPages"]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class WindowPages:
    """The window layers' pages: free ones, and each request slot's, as a value.

    `table[slot, k]` is the window page holding positions
    `[k * page_size, (k + 1) * page_size)` of the row in `slot`, for `k` from
    `starts[slot] // page_size` to the row's last page. Like the token table
    it is written in place, only at cells the values before treat as unused
    (pages past a row's end); cells before a row's start are stale.
    """

    kind: SlidingWindow
    page_size: int
    page_list: FreeList  # free window pages, 1..num_pages (page 0 is padding)
    starts: HostArray  # read-only int64 [max_reqs + 1]: slot -> window start (0 when free)
    table: npt.NDArray[np.int64]  # [max_reqs + 1, pages per row], read-only but while growing

    @classmethod
    def empty(
        cls, kind: SlidingWindow, page_size: int, max_reqs: int, max_context_len: int
    ) -> WindowPages:
        """Every window page free, no row holding one."""
        num_pages = kind.num_tokens // page_size
        table = np.zeros((max_reqs + 1, -(-max_context_len // page_size)), dtype=np.int64)
        table.flags.writeable = False
        return cls(
            kind,
            page_size,
            FreeList.of(np.arange(1, num_pages + 1, dtype=np.int64)),
            frozen(np.zeros(max_reqs + 1, dtype=np.int64)),
            table,
        )

    @property
    def window(self) -> int:
        return self.kind.window

    @property
    def num_pages(self) -> int:
        """Usable window pages; page 0 is padding and never handed out."""
        return self.kind.num_tokens // self.page_size

    @property
    def num_free_tokens(self) -> int:
        return len(self.page_list) * self.page_size

    def moved(self, starts: HostArray) -> WindowPages:
        """The same pages with other window starts (rows opened at a cached prefix's tail)."""
        return WindowPages(self.kind, self.page_size, self.page_list, starts, self.table)

    def with_free(self, page_list: FreeList) -> WindowPages:
        """The same rows with another free list (pages the prefix cache took or gave back)."""
        return WindowPages(self.kind, self.page_size, page_list, self.starts, self.table)

    def row_pages(self, slot: int, num_tokens: int) -> HostArray:
        """The window pages the row in `slot`, holding `num_tokens` tokens, holds, in order."""
        start = int(self.starts[slot]) // self.page_size
        return self.table[slot, start : -(-num_tokens // self.page_size)]

    def tail_pages(self, slot: int, end: int) -> HostArray:
        """The window pages of the row in `slot` holding the tail a resume at `end` reads.

        Positions `[tail_start(end), end)`, `end` a page boundary: what an
        anchor at `end` keeps, and what a row resuming there copies it into.
        """
        start = tail_start(end, self.window, self.page_size)
        return self.table[slot, start // self.page_size : end // self.page_size]

    def num_tail_pages(self, end: int) -> int:
        """How many pages the tail a resume at `end` (a page boundary) reads spans."""
        return (end - tail_start(end, self.window, self.page_size)) // self.page_size

    def grow(
        self, slots: HostArray, old_lens: HostArray, new_lens: HostArray, reads_from: HostArray
    ) -> WindowPages | tuple[int, int]:
        """Rows grown from `old_lens` to `new_lens`: new pages taken, pages out of window freed.

        `reads_from` is the first position each row's forward queries:
        `old_lens`, or less for a forward that queries tokens again (a
        verify window its decode token), or more for rows whose memory
        arrives from elsewhere (`admit_prefilled`: `new_lens`, what the next decode
        queries), which take window pages for their window's tail only.
        Returns the new value, or `(pages needed, pages available)` when
        the window pages fall short (nothing changed then).
        """
        page_size = self.page_size
        start = self.starts[slots]
        # A row opened at a cached prefix's window tail holds no page before its start:
        # it grows from there (the tail's pages are new, filled by a copy).
        old_lens = np.maximum(old_lens, start)
        # The forward reads from `reads_from - window + 1` on: pages wholly before it are free.
        keep = np.maximum(reads_from - (self.window - 1), 0)
        keep -= keep % page_size
        dropping = np.flatnonzero(keep > start)  # a decode step: a row now and then
        round_up = page_size - 1
        held_end = (old_lens + round_up) // page_size
        first_new = held_end  # new pages from the row's end on
        num_new = (new_lens + round_up) // page_size - held_end
        dropped = _NO_PAGES
        if dropping.shape[0]:
            first_dropped = start[dropping] // page_size
            keep_page, ends = keep[dropping] // page_size, held_end[dropping]
            past = keep_page > ends  # its window starts past its end: a prebuilt row
            if past.any():  # it holds nothing to drop, and takes pages from its window's start
                keep_page = np.minimum(keep_page, ends)
                first_new = held_end.copy()
                first_new[dropping[past]] = keep[dropping[past]] // page_size
                num_new = np.maximum((new_lens + round_up) // page_size - first_new, 0)
            dropped = self.table[_cells(slots[dropping], first_dropped, keep_page - first_dropped)]
        total_new = int(num_new.sum())
        if total_new > len(self.page_list) + dropped.shape[0]:
            return total_new, len(self.page_list) + dropped.shape[0]
        page_list, starts = self.page_list, self.starts
        if dropped.shape[0]:
            page_list = page_list.give(dropped)
        if dropping.shape[0]:  # a prebuilt row's start moves with nothing dropped
            moved = starts.copy()
            moved[slots[dropping]] = keep[dropping]
            starts = frozen(moved)
        if total_new:
            pages, page_list = page_list.take(total_new)
            opening = np.flatnonzero(num_new)  # a decode step: rows whose token opens a page
            cells = _cells(slots[opening], first_new[opening], num_new[opening])
            with writing(self.table):  # cells past each row's end: unused by every value
                self.table[cells] = pages
        return WindowPages(self.kind, page_size, page_list, starts, self.table)

    def shrink(self, slots: HostArray, held: HostArray, new_lens: HostArray) -> WindowPages:
        """Rows cut from `held` back to `new_lens` tokens: the window pages past them freed.

        Raises:
            PoolsArgumentError: a row cut back so far that its next forward
                would read positions whose window pages were given back.
        """
        page_size = self.page_size
        starts = self.starts[slots]
        short = starts > np.maximum(new_lens - self.window + 1, 0)
        if short.any():
            at = int(short.argmax())
            raise PoolsArgumentError(
                f"slot {int(slots[at])} gave back its window pages before position"
                f" {int(starts[at])}: it cannot shrink to {int(new_lens[at])} tokens, whose"
                f" next forward reads from {int(new_lens[at]) - self.window + 1}"
            )
        start_page = starts // page_size
        kept = np.maximum(-(-new_lens // page_size), start_page)
        num_freed = np.maximum(-(-held // page_size) - kept, 0)
        if not int(num_freed.sum()):
            return self
        freed = self.table[_cells(slots, kept, num_freed)]
        return WindowPages(
            self.kind, page_size, self.page_list.give(freed), self.starts, self.table
        )

    def give_back(self, slots: HostArray, held: HostArray) -> WindowPages:
        """Released rows holding `held` tokens: every window page they hold freed."""
        page_size = self.page_size
        start_page = self.starts[slots] // page_size
        num_held = np.maximum(-(-held // page_size) - start_page, 0)
        freed = self.table[_cells(slots, start_page, num_held)]
        starts = self.starts.copy()
        starts[slots] = 0
        return WindowPages(
            self.kind, page_size, self.page_list.give(freed), frozen(starts), self.table
        )

    def __repr__(self) -> str:
        return (
            f"WindowPages(window={self.window}, free_pages={len(self.page_list)}/{self.num_pages},"
            f" page_size={self.page_size})"
        )


_NO_PAGES: Final = frozen(np.empty(0, dtype=np.int64))


def _cells(slots: HostArray, first: HostArray, counts: HostArray) -> tuple[HostArray, HostArray]:
    # Table cells (slot, page index) of `counts[i]` pages from `first[i]` on, row after row.
    rows = np.repeat(np.arange(slots.shape[0]), counts)
    offsets = np.cumsum(counts) - counts
    return slots[rows], first[rows] + np.arange(rows.shape[0]) - offsets[rows]
