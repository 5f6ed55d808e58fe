"""Building one mixed forward: the chunks a budget admits, then their rows and the running ones.

`mix` checks its inputs (see `_mix.py`); `_fill` takes requests in order
while the budget lasts, and `_build` allocates their slots and KV and the
running rows' one token each, publishes what the chunks compute, builds
every mirror with one host-to-device copy and writes the table last.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import NamedTuple, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate._chunked import Chunked
from batchstate._column_rows import join_pending
from batchstate._columns import C
from batchstate._dedup import ExtendRows, publish_computed
from batchstate._errors import OutOfKVTokens, OutOfReqSlots
from batchstate._hybrid_reuse import publish_tails, resume_rows, usable_prefix
from batchstate._mirrored import NO_INTS, DeviceOnly, HostArray, Mirrored, frozen, host_int64
from batchstate._mixed import Mixed, MixStep
from batchstate._pool_allocation import take_slots, take_tokens
from batchstate._pool_prefixes import lock_matched_prefixes
from batchstate._pools import Pools
from batchstate._rows import Req, Rows, build_rows, pack_ints
from batchstate._sampled import Sampled
from batchstate._sharing import prefix_cells

# The running rows' input tokens: host ints, or the last forward's tokens left on the device.
Tokens: TypeAlias = Sequence[int] | Sampled


class _Chunks(NamedTuple):
    # The admitted prefix of `admit`: requests, whether each is new, prefix and extend lengths.
    reqs: tuple[Req, ...]
    slots: list[int]  # 0 for a new request (a slot comes from the pools)
    prefix_lens: list[int]  # a chunk's held tokens, or a new request's cached prefix
    extend_lens: list[int]
    prefix_pages: list[HostArray]  # each new request's cached prefix pages, in order


def _fill(
    admit: Sequence[Req | Chunked[C]], budget: int, pools: Pools, caps: Mapping[int, int]
) -> _Chunks:
    reqs: list[Req] = []
    slots, prefix_lens, extend_lens = [], [], []
    prefix_pages: list[HostArray] = []
    left = budget
    cache = pools.cache
    for item in admit:
        if not left:
            break
        if isinstance(item, Chunked):
            req, slot, cached = item.req, item.slot, item.cached
        else:
            req, slot = item, 0
            # A cap keeps whole pages (a page is read from the cache or not at all) and, on
            # hybrid pools, an anchor: a prefix is never read where its tail is not kept.
            cap = caps.get(req.rid)
            cached, pages = (
                usable_prefix(pools, req.input_ids, cap) if cache.enabled else (0, NO_INTS)
            )
            prefix_pages.append(pages)
        take = min(len(req.input_ids) - cached, left)
        left -= take
        reqs.append(req)
        slots.append(slot)
        prefix_lens.append(cached)
        extend_lens.append(take)
    return _Chunks(tuple(reqs), slots, prefix_lens, extend_lens, prefix_pages)


def _build(
    rows: Rows[C], chunks: _Chunks, pools: Pools, tokens: Tokens, extend_columns: Sequence[C]
) -> MixStep[C] | OutOfReqSlots | OutOfKVTokens:
    allocated = _allocate(rows, chunks, pools)
    if isinstance(allocated, OutOfReqSlots | OutOfKVTokens):
        return attrs.evolve(allocated, fits=_fits(rows, chunks, pools))
    new_slots, slots, prefix, extend_lens, seq_lens, locs, after = allocated
    new_ids = [
        req.input_ids for req, slot in zip(chunks.reqs, chunks.slots, strict=True) if not slot
    ]
    matched = [
        length for length, slot in zip(chunks.prefix_lens, chunks.slots, strict=True) if not slot
    ]
    prefix_pages = chunks.prefix_pages
    num_extend = len(chunks.reqs)
    extend_slots = slots[:num_extend].tolist()
    num_tokens = locs.shape[0]
    token_rows = np.repeat(np.arange(slots.shape[0]), extend_lens)
    first = np.cumsum(extend_lens) - extend_lens
    positions = prefix[token_rows] + np.arange(num_tokens) - first[token_rows]
    token_slots = slots[token_rows]
    cells: tuple[HostArray, HostArray, npt.NDArray[np.int32]] = (
        token_slots,
        positions,
        locs.astype(np.int32),
    )  # the table write's
    if num_extend:
        # Each chunk's end: its whole pages go into the cache and its lock moves to them,
        # or, where the cache holds them already, its cells move onto the cache's copy.
        ends = seq_lens[:num_extend].tolist()
        after, cells = publish_computed(
            after,
            [
                (slot, ids[:length])
                for slot, ids, length in zip(new_slots, new_ids, matched, strict=True)
            ],
            ExtendRows(
                extend_slots,
                chunk_tokens := [
                    req.input_ids[:end] for req, end in zip(chunks.reqs, ends, strict=True)
                ],
                chunks.prefix_lens,
                first[:num_extend].tolist(),
            ),
            cells,
            retire=True,
        )
        # Hybrid pools: an anchor at each chunk's last page boundary, where there is room.
        after = publish_tails(after, extend_slots, chunk_tokens, chunks.prefix_lens)
    if any(matched):  # new rows read a cached prefix: their cells there are the cache's pages
        cells = prefix_cells(
            list(zip(new_slots, prefix_pages, strict=True)), pools.page_size, cells
        )
    extend_ids = _prompt_ids(chunks)
    on_device = isinstance(tokens, Sampled)
    input_ids = (
        extend_ids
        if on_device
        else np.concatenate((extend_ids, np.asarray(tokens, dtype=np.int64)))
    )
    # The table's position cells are the forward's positions, uploaded once, unless cells
    # were added (cached prefixes read, earlier chunks' cells moved onto the cache's pages).
    shared = cells[1] is positions
    seq_lens_sum = rows.seq_lens_sum + len(rows) + sum(chunks.prefix_lens) + sum(chunks.extend_lens)
    built, (ids_side, locs_side, positions_side, *cell_sides) = build_rows(
        rows.device,
        chunks.reqs + rows.reqs,
        pack_ints(
            seq_lens,
            slots,
            np.concatenate((host_int64([req.rid for req in chunks.reqs]), rows.rids)),
            rows.gens if not num_extend else after.slot_gens[slots],
        ),
        rows.req_pool_indices if not num_extend else None,
        seq_lens_sum,
        int(seq_lens.max()) if seq_lens.shape[0] else 0,
        join_pending([*extend_columns, rows.columns]),  # the running rows' columns last
        (input_ids, locs, positions, cells[0], cells[2])
        if shared
        else (input_ids, locs, positions, *cells),
    )
    if shared:
        cell_sides.insert(1, positions_side)
    if isinstance(tokens, Sampled):
        # The host does not know these tokens: append them on the device.
        sampled = tokens.tokens.device
        ids_side = torch.cat((ids_side, sampled)) if num_extend else sampled
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write(
        Mirrored._pair(frozen(cells[0]), cell_sides[0]),
        Mirrored._pair(frozen(cells[1]), cell_sides[1]),
        Mirrored._pair(frozen(cells[2]), cell_sides[2]),
    )
    partial = tuple(
        row
        for row, (req, length) in enumerate(zip(chunks.reqs, seq_lens.tolist(), strict=False))
        if length < len(req.input_ids)
    )
    mixed = Mixed._trusted(
        built,
        DeviceOnly(ids_side),
        DeviceOnly(positions_side),
        DeviceOnly(locs_side),
        frozen(prefix),
        frozen(extend_lens),
        num_extend,
        sum(chunks.extend_lens),
        partial,
    )
    return MixStep(mixed, after._commit())


_Allocated: TypeAlias = tuple[
    list[int], HostArray, HostArray, HostArray, HostArray, HostArray, Pools
]


def _allocate(
    rows: Rows[C], chunks: _Chunks, pools: Pools
) -> _Allocated | OutOfReqSlots | OutOfKVTokens:
    # The slots and KV of the chunks and of the running rows' one token each, in new
    # pools not yet committed (nothing written): new slots, every row's slot, prefix,
    # extend and sequence lengths, the KV locations, the pools after.
    num_new = chunks.slots.count(0)
    new_slots: list[int] = []
    if num_new:
        if num_new > pools.num_free_slots:
            return OutOfReqSlots(num_new, pools.num_free_slots)
        new_ids = [
            req.input_ids for req, slot in zip(chunks.reqs, chunks.slots, strict=True) if not slot
        ]
        matched = [
            length
            for length, slot in zip(chunks.prefix_lens, chunks.slots, strict=True)
            if not slot
        ]
        pools = lock_matched_prefixes(pools, new_ids, matched)
        allocated = take_slots(pools, num_new)
        if isinstance(allocated, OutOfReqSlots):  # hybrid pools: fewer state slots than slots
            return allocated
        taken, pools = allocated
        new_slots = taken.tolist()
        pools = resume_rows(pools, new_slots, new_ids, matched)  # hybrid pools: from anchors
    next_new = iter(new_slots)
    extend_slots = [slot or next(next_new) for slot in chunks.slots]
    slots = np.concatenate((host_int64(extend_slots), rows.req_pool_indices.host))
    prefix = np.concatenate((host_int64(chunks.prefix_lens), rows.seq_lens.host))
    extend_lens = np.concatenate(
        (host_int64(chunks.extend_lens), np.ones(len(rows), dtype=np.int64))
    )
    seq_lens = prefix + extend_lens
    allocation = take_tokens(pools, slots, prefix, seq_lens)
    if isinstance(allocation, OutOfKVTokens):
        return allocation
    locs, after = allocation
    return new_slots, slots, prefix, extend_lens, seq_lens, locs, after


def _fits(rows: Rows[C], chunks: _Chunks, pools: Pools) -> int:
    # How many of the chunks, from the first, the pools take beside the running rows:
    # the allocation alone, tried on ever fewer (uncommitted, nothing written).
    with pools.memory.probing():
        for count in range(len(chunks.reqs) - 1, 0, -1):
            num_new = chunks.slots[:count].count(0)
            fewer = _Chunks(
                chunks.reqs[:count],
                chunks.slots[:count],
                chunks.prefix_lens[:count],
                chunks.extend_lens[:count],
                chunks.prefix_pages[:num_new],
            )
            if not isinstance(_allocate(rows, fewer, pools), OutOfReqSlots | OutOfKVTokens):
                return count
    return 0


def _prompt_ids(chunks: _Chunks) -> HostArray:
    ids = array(
        "q",
        chain.from_iterable(
            req.input_ids[prefix : prefix + length]
            for req, prefix, length in zip(
                chunks.reqs, chunks.prefix_lens, chunks.extend_lens, strict=True
            )
        ),
    )
    return np.frombuffer(ids, dtype=np.int64) if ids else np.empty(0, dtype=np.int64)
