"""Counting device-to-host reads around the engine's decode-path bookkeeping.

The counter itself belongs to `batchstate.audit` (a TorchDispatchMode that
counts reads of device data). Where that module is not installed, the
engine reports the count as "not measured" instead of guessing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Final, cast

__all__ = ["AUDIT_MODULE", "ReadCounter", "read_counter"]

AUDIT_MODULE: Final = "batchstate.audit"

# `with counter() as box:` counts reads in the block; `box[0]` holds the count after it.
ReadCounter = Callable[[], AbstractContextManager[list[int]]]


def read_counter() -> ReadCounter | None:
    """A counter built on `batchstate.audit.device_reads`, or None where that is missing."""
    try:
        audit = importlib.import_module(AUDIT_MODULE)
    except ModuleNotFoundError:
        return None
    device_reads = getattr(audit, "device_reads", None)
    if device_reads is None:
        return None
    factory = cast(Callable[[], AbstractContextManager[object]], device_reads)

    @contextmanager
    def counted() -> Iterator[list[int]]:
        box = [0]
        with factory() as reads:
            yield box
        box[0] = _count_of(reads)

    return counted


def _count_of(reads: object) -> int:
    # The audit's result: an int-like count, or a collection of read events.
    for name in ("count", "num_reads", "total"):
        value = getattr(reads, name, None)
        if isinstance(value, int):
            return value
    if isinstance(reads, int):
        return reads
    return len(cast(list[object], reads))
