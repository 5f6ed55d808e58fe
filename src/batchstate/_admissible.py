"""How many of the requests an admission was offered the pools would take: for its failure.

`extend` and `prebuilt` admit all of their inputs or none; when the pools
run short, the failure says how many, from the first, would have fitted, so
that a scheduler can offer exactly those (`mix` counts its own, with its
chunks and the running rows, in `_mix_forward`). Allocation alone, on
pools never committed: nothing is written.
"""

from __future__ import annotations

from collections.abc import Sequence

from batchstate._chunked import Chunked
from batchstate._columns import C
from batchstate._errors import OutOfKVTokens, OutOfReqSlots
from batchstate._hybrid_reuse import resume_rows
from batchstate._mirrored import host_int64
from batchstate._pool_allocation import take_slots, take_tokens
from batchstate._pool_prefixes import lock_cached_prefixes
from batchstate._pools import Pools
from batchstate._rows import Req

__all__ = ["extend_fits"]


def extend_fits(inputs: Sequence[Req | Chunked[C]], pools: Pools, *, match: bool) -> int:
    """The most of `inputs`, from the first, whose slots and KV the pools have (0: none).

    `match`: new requests read their cached prefixes first (`extend`), or not
    (`prebuilt`). Fewer inputs never need more, so the first count that fits,
    counting down, is the most.
    """
    with pools.memory.probing():
        for count in range(len(inputs) - 1, 0, -1):
            if _allocates(inputs[:count], pools, match=match):
                return count
    return 0


def _allocates(inputs: Sequence[Req | Chunked[C]], pools: Pools, *, match: bool) -> bool:
    # As `extend` allocates: slots for the new requests (their cached prefixes locked
    # first), then every row's KV from its prefix to its prompt's end.
    new_ids = [item.input_ids for item in inputs if isinstance(item, Req)]
    if len(new_ids) > pools.num_free_slots:
        return False
    locked, matched, _ = (
        lock_cached_prefixes(pools, new_ids) if match else (pools, [0] * len(new_ids), [])
    )
    taken = take_slots(locked, len(new_ids))
    if isinstance(taken, OutOfReqSlots):
        return False
    new_slots, with_slots = taken
    if match and any(matched):  # hybrid pools: window starts at the anchors' tails
        with_slots = resume_rows(with_slots, new_slots.tolist(), new_ids, matched)
    next_slot, next_match = iter(new_slots.tolist()), iter(matched)
    slots: list[int] = []
    prefix: list[int] = []
    seq_lens: list[int] = []
    for item in inputs:
        if isinstance(item, Req):
            slots.append(next(next_slot))
            prefix.append(next(next_match))
            seq_lens.append(len(item.input_ids))
        else:
            slots.append(item.slot)
            prefix.append(item.cached)
            seq_lens.append(len(item.req.input_ids))
    lengths = host_int64(seq_lens)
    # `prebuilt` (no match) takes window pages for each window's tail only, as it admits.
    reads_from = None if match else lengths
    allocation = take_tokens(with_slots, host_int64(slots), host_int64(prefix), lengths, reads_from)
    return not isinstance(allocation, OutOfKVTokens)
