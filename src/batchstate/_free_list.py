"""Free ids (request slots, KV pages) as a value, without copying them on every change."""

from __future__ import annotations

from typing import final

import attrs
import torch

__all__ = ["FreeList"]


@final
@attrs.frozen(eq=False, repr=False)
class FreeList:
    """Free ids, handed out from the front and given back at the back.

    The ids live in a host buffer shared by successive values: `take` moves
    `head`, `give` writes past `tail`, at cells no earlier value covers. So
    every earlier value still reads the ids it had, and neither costs a copy
    of the whole list (an engine's KV pool holds millions of pages). When
    the buffer's end is reached the live ids move to a new buffer, once per
    `capacity` ids given back.

    NOTE: linear, like the pools that hold it: give back through the newest
    value only. Two values derived from one would write the same cells.

    >>> ids = FreeList.of(torch.arange(1, 5))
    >>> taken, rest = ids.take(3)
    >>> taken.tolist(), rest.give(torch.tensor([2, 1])).ids.tolist(), ids.ids.tolist()
    ([1, 2, 3], [4, 2, 1], [1, 2, 3, 4])
    """

    buffer: torch.Tensor  # host int64 [2 * capacity]; cells [head, tail) are the free ids
    head: int
    tail: int

    @classmethod
    def of(cls, ids: torch.Tensor, capacity: int | None = None) -> FreeList:
        """Free ids (host int64, 1-D) of a pool of `capacity` ids (default: as many as `ids`)."""
        capacity = ids.shape[0] if capacity is None else max(capacity, ids.shape[0])
        buffer = torch.empty(max(2 * capacity, 1), dtype=torch.int64)
        buffer[: ids.shape[0]] = ids
        return cls(buffer, 0, ids.shape[0])

    @property
    def ids(self) -> torch.Tensor:
        """The free ids, in hand-out order: a view, `[len(self)]`."""
        return self.buffer[self.head : self.tail]

    def __len__(self) -> int:
        return self.tail - self.head

    def take(self, count: int) -> tuple[torch.Tensor, FreeList]:
        """The first `count` ids (a view; `count <= len(self)`), and the list without them."""
        head = self.head + count
        return self.buffer[self.head : head], FreeList(self.buffer, head, self.tail)

    def give(self, ids: torch.Tensor) -> FreeList:
        """The list with `ids` (a host integer tensor, 1-D) appended. Writes only past `tail`."""
        count = ids.shape[0]
        tail = self.tail + count
        if tail <= self.buffer.shape[0]:
            self.buffer[self.tail : tail] = ids
            return FreeList(self.buffer, self.head, tail)
        return FreeList.of(torch.cat((self.ids, ids)), self.buffer.shape[0] // 2)

    def __repr__(self) -> str:
        return f"FreeList({len(self)} free)"
