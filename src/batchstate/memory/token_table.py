"""The request-to-token table: the one piece of batch memory written in place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate.base.errors import BatchConflict
from batchstate.base.mirrored import Mirrored, describe, frozen, writing
from batchstate.base.read_only import read_only_copies

__all__ = ["TokenTable"]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class TokenTable:
    """`[max_reqs + 1, max_context_len]` int32: slot, position -> KV token location.

    Row 0 is padding and never handed out. A table is too large to copy per
    step, so it is the one thing transitions write in place, on both sides
    at once. `host` is a read-only view: only the transitions write it.

    NOTE: transitions write it only after every allocation of that
    transition has succeeded, and only at cells that the records and pools
    handed in treat as unused (free slots, positions past a row's length),
    but for one kind of write: a row's cells of whole pages the prefix cache
    holds already move onto the cache's pages, which hold the KV of the
    same tokens; below the row's start, only onto KV an earlier forward
    wrote (docs/design.md, "Where device memory is written" and "The
    forward's contract").
    """

    _cells: npt.NDArray[np.int32]  # the host side: read-only but while `write*` writes it
    device: torch.Tensor  # the same, on the batch's device
    host: npt.NDArray[np.int32] = attrs.field(init=False)  # a read-only view of `_cells`
    # Per row, the lowest position `write*` wrote since `check_pools` last read the
    # row (0 at first): what lets it read again only the cells written since.
    written_from: npt.NDArray[np.int64] = attrs.field(init=False)
    # The pools' page size, KV pages and the generation their lineage counts from:
    # what `forward_inputs` and `pad` check their arguments against.
    page_size: int = attrs.field(kw_only=True)
    num_pages: int = attrs.field(kw_only=True)
    first_gen: int = attrs.field(kw_only=True)

    @host.default
    def _read_only(self) -> npt.NDArray[np.int32]:
        # A view of a read-only owner: numpy refuses to make it writable again.
        self._cells.flags.writeable = False
        return self._cells.view()

    @written_from.default
    def _all_unread(self) -> npt.NDArray[np.int64]:
        return frozen(np.zeros(self._cells.shape[0], dtype=np.int64))

    def mark_read(self, slots: npt.NDArray[np.int64]) -> None:
        """`check_pools` read these rows' cells: a later write lowers their mark again."""
        with writing(self.written_from):
            self.written_from[slots] = self.max_context_len

    def _rebuilt(self) -> None:
        # A copy's `host` must be a view of its own cells again, as `write*` writes those;
        # its record of what was written its own, writable again.
        object.__setattr__(self, "host", self._read_only())
        object.__setattr__(self, "written_from", frozen(self.written_from.copy()))

    @classmethod
    def zeros(
        cls,
        max_reqs: int,
        max_context_len: int,
        device: torch.device,
        *,
        page_size: int,
        num_pages: int,
        first_gen: int,
    ) -> TokenTable:
        """An all-padding table for `max_reqs` request slots of pools with these pages."""
        shape = (max_reqs + 1, max_context_len)
        return cls(
            np.zeros(shape, dtype=np.int32),
            torch.zeros(shape, dtype=torch.int32, device=device),
            page_size=page_size,
            num_pages=num_pages,
            first_gen=first_gen,
        )

    @property
    def max_context_len(self) -> int:
        return int(self.host.shape[1])

    @property
    def kv_cache_size(self) -> int:
        """KV locations the pools hand out, padding page 0 included."""
        return (self.num_pages + 1) * self.page_size

    def expect_on(self, device: torch.device) -> None:
        """Raise `BatchConflict` unless the device side lives on `device` (a batch's).

        NOTE: transitions write both sides with the batch's index tensors; on
        another device the device side would be left unwritten.
        """
        if self.device.device != device:
            raise BatchConflict(
                f"the batch is on {device}, the pools' table on {self.device.device}"
            )

    def write(self, slots: Mirrored, positions: Mirrored, locs: Mirrored[np.int32]) -> None:
        """Set `table[slots[i], positions[i]] = locs[i]` on both sides (mutates the table).

        One scatter on the device.
        """
        # NOTE: the device side first: if it fails (out of memory, say) neither
        # side has changed. The host write, last, indexes host memory at cells
        # the device write just accepted.
        self.device[slots.device, positions.device] = locs.device
        cells, marks, rows, columns = self._cells, self.written_from, slots.host, positions.host
        # Both host arrays writable for one block: half the cost of two `writing` blocks,
        # on a path every decode and mix takes.
        cells.setflags(write=True)
        marks.setflags(write=True)
        try:
            cells[rows, columns] = locs.host
            np.minimum.at(marks, rows, columns)
        finally:
            cells.setflags(write=False)
            marks.setflags(write=False)

    def write_rows(
        self, slots: Sequence[int], lengths: Sequence[int], locs: Mirrored[np.int32]
    ) -> None:
        """Set `table[slots[i], :lengths[i]]` to the next `lengths[i]` of `locs` (mutates it).

        For freshly admitted rows: one slice per row and side, no index tensors.
        """
        rows = list(zip(slots, lengths, strict=True))
        done = 0  # rows written on the device side
        try:
            start = 0
            for slot, length in rows:  # as `write`: the device side first
                self.device[slot, :length] = locs.device[start : start + length]
                start += length
                done += 1
        except BaseException:
            # NOTE: a row write failing after others leaves the sides different:
            # put the device rows back from the host side, untouched until now.
            for slot, length in rows[:done]:
                self.device[slot, :length] = torch.from_numpy(self._cells[slot, :length].copy())
            raise
        start = 0
        with writing(self._cells):
            for slot, length in rows:
                self._cells[slot, :length] = locs.host[start : start + length]
                start += length
        with writing(self.written_from):
            self.written_from[[slot for slot, _ in rows]] = 0

    def __repr__(self) -> str:
        return describe("TokenTable", self.device)
