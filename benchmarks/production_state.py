"""What the production step's implementations end in, as host data (compared in the smoke test)."""

from __future__ import annotations

from typing import NamedTuple

from benchmarks.sampling_values import SamplingRow

__all__ = ["ProductionOutcome"]


class ProductionOutcome(NamedTuple):
    """The state after a decode: running rows, the held chunk, free memory and the cache."""

    rids: list[int]
    slots: list[int]  # host mirror
    slots_device: list[int]
    seq_lens: list[int]  # host mirror
    seq_lens_device: list[int]
    input_ids: list[int]  # the decode's input tokens, on the device: the last forward's
    token_rows: list[list[int]]  # table[slot, :seq_len] per row: KV locations
    held: tuple[int, int, int]  # the held chunk: rid, slot, tokens it holds
    free_slots: list[int]  # in hand-out order
    free_pages: list[int]  # in hand-out order
    cache: dict[tuple[int, ...], tuple[int, int]]  # every cached page: prefix -> (page, locks)
    num_evicted: int  # pages evicted from the cache so far
    hits: int  # new requests that read a cached prefix
    sampling: list[SamplingRow]  # each running row's parameters, device side; none without columns
