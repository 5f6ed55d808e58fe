"""Counting device-to-host reads around the engine's decode-path bookkeeping."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from batchstate.audit import device_reads

__all__ = ["ReadCounter", "read_counter"]

# `with counter() as box:` counts reads in the block; `box[0]` holds the count after it.
ReadCounter = Callable[[], AbstractContextManager[list[int]]]


def read_counter() -> ReadCounter:
    """A counter on `batchstate.audit.device_reads`: reads of non-CPU data, counted, not forbidden.

    On `cpu` every tensor is host data, so the count is 0 by definition; on
    `meta` a read has no data and raises; on `cuda` this is the real count.

    >>> counter = read_counter()
    >>> with counter() as reads:
    ...     pass
    >>> reads
    [0]
    """
    return _counted


@contextmanager
def _counted() -> Iterator[list[int]]:
    box = [0]
    with device_reads() as log:
        yield box
    box[0] = log.report().count
