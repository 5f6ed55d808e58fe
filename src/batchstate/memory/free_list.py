"""Free ids (request slots, KV pages) as a value, without copying them on every change."""

from __future__ import annotations

from typing import final

import attrs
import numpy as np
import numpy.typing as npt

from batchstate.base.mirrored import HostArray, writing
from batchstate.base.read_only import read_only_copies

__all__ = ["FreeList"]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class FreeList:
    """Free ids, handed out from the front and given back at the back.

    The ids live in a host buffer shared by successive values: `take` moves
    `head`, `give` writes past `tail`, at cells no earlier value covers. So
    every earlier value still reads the ids it had, and neither costs a copy
    of the whole list (an engine's KV pool holds millions of pages). When
    the buffer's end is reached the live ids move to a new buffer, once per
    `capacity` ids given back. What a value exposes (`ids`, taken ids) is a
    read-only view.

    NOTE: linear, like the pools that hold it: give back through the newest
    value only. Two values derived from one would write the same cells.

    >>> ids = FreeList.of(np.arange(1, 5))
    >>> taken, rest = ids.take(3)
    >>> taken.tolist(), rest.give(np.array([2, 1])).ids.tolist(), ids.ids.tolist()
    ([1, 2, 3], [4, 2, 1], [1, 2, 3, 4])
    """

    # int64 [2 * capacity]; cells [head, tail) are the free ids. Read-only but
    # while `give` writes past `tail`; values expose views of it.
    _buffer: HostArray
    head: int
    tail: int

    @classmethod
    def of(cls, ids: npt.NDArray[np.integer], capacity: int | None = None) -> FreeList:
        """Free ids (1-D integers) of a pool of `capacity` ids (default: as many as `ids`)."""
        capacity = ids.shape[0] if capacity is None else max(capacity, ids.shape[0])
        buffer = np.empty(max(2 * capacity, 1), dtype=np.int64)
        buffer[: ids.shape[0]] = ids
        buffer.flags.writeable = False  # only `give` writes it, past every value's end
        return cls(buffer, 0, ids.shape[0])

    @property
    def ids(self) -> HostArray:
        """The free ids, in hand-out order: a read-only view, `[len(self)]`."""
        return self._buffer[self.head : self.tail]  # read-only, as its buffer

    def __len__(self) -> int:
        return self.tail - self.head

    def take(self, count: int) -> tuple[HostArray, FreeList]:
        """The first `count` ids (a read-only view; `count <= len(self)`), and the rest."""
        head = self.head + count
        return self._buffer[self.head : head], FreeList(self._buffer, head, self.tail)

    def give(self, ids: npt.NDArray[np.integer]) -> FreeList:
        """The list with `ids` (a 1-D integer array) appended. Writes only past `tail`."""
        count = ids.shape[0]
        tail = self.tail + count
        if tail <= self._buffer.shape[0]:
            with writing(self._buffer):
                self._buffer[self.tail : tail] = ids
            return FreeList(self._buffer, self.head, tail)
        return FreeList.of(np.concatenate((self.ids, ids)), self._buffer.shape[0] // 2)

    def __repr__(self) -> str:
        return f"FreeList({len(self)} free)"
