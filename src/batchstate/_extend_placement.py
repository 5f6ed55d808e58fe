"""Laying admitted requests out as rows: KV locations, published pages, mirrors, the table write.

`extend` and `prebuilt` admit (see `_extend.py`); the functions here take
the KV, publish what the rows compute to the prefix cache, build every
mirror with one host-to-device copy and write the request-to-token table
last, so that a failure before it leaves the table as it was.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Generic, NamedTuple

import numpy as np

from batchstate._chunked import Chunked, columns_in_order
from batchstate._column_rows import join_pending
from batchstate._columns import C
from batchstate._dedup import ExtendRows, publish_computed
from batchstate._errors import OutOfKVTokens, OutOfReqSlots
from batchstate._extend_checks import _expect_unique, _first_problem
from batchstate._hybrid_reuse import publish_tails, resume_rows
from batchstate._mirrored import DeviceOnly, HostArray, Mirrored, frozen, host_int64
from batchstate._phases import Idle
from batchstate._pool_allocation import take_fresh, take_slots, take_tokens
from batchstate._pools import Pools
from batchstate._rows import Req, Rows, build_rows, pack_ints
from batchstate._sharing import prefix_cells

if TYPE_CHECKING:
    from batchstate._extend import ExtendError


class _Admitted(NamedTuple, Generic[C]):
    rows: Rows[C]
    input_ids: DeviceOnly  # int64 [num_tokens]
    out_cache_loc: DeviceOnly  # int64 [num_tokens]
    prefix_lens: HostArray  # read-only int64 [num_reqs]
    extend_lens: HostArray  # read-only int64 [num_reqs]
    num_computed: int  # extend_lens.sum(), the tokens the forward computes
    pools: Pools


class _Matched(NamedTuple):
    # The new requests' cached prefixes, locked: lengths and pages, in input order.
    lengths: list[int]
    pages: list[HostArray]


def _place_fresh(
    batch: Idle[C], reqs: Sequence[Req], pools: Pools, columns: C, *, transferred: bool
) -> _Admitted[C] | ExtendError:
    # A few new requests with the cache off, the common extend: every position from 0,
    # so rows take whole pages in order and the table is written one slice per row.
    rids = [req.rid for req in reqs]
    _expect_unique(rids, "rid")
    seq_lens = [len(req.input_ids) for req in reqs]
    longest = max(seq_lens)
    if min(seq_lens) == 0 or longest > pools.max_context_len:
        problem = _first_problem(reqs, [0] * len(reqs), pools.max_context_len)
        assert problem is not None
        return problem
    allocated = take_slots(pools, len(reqs))
    if isinstance(allocated, OutOfReqSlots):
        return allocated
    slots, with_slots = allocated
    allocation = take_fresh(with_slots, slots, seq_lens, transferred=transferred)
    if isinstance(allocation, OutOfKVTokens):
        return allocation
    locs, after = allocation
    locs32 = locs.astype(np.int32)
    total = sum(seq_lens)
    rows, (input_ids, out_cache_loc, table_locs) = build_rows(
        batch.device,
        tuple(reqs),
        pack_ints(host_int64(seq_lens), slots, host_int64(rids), with_slots.slot_gens[slots]),
        None,
        total,
        longest,
        columns,
        (_token_ids(reqs, (0,) * len(reqs)), locs, locs32),
    )
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write_rows(slots.tolist(), seq_lens, Mirrored._pair(frozen(locs32), table_locs))
    return _Admitted(
        rows,
        DeviceOnly(input_ids),
        DeviceOnly(out_cache_loc),
        _no_prefix(len(reqs)),
        rows.seq_lens.host,  # every token is computed: the rows' own read-only lengths
        total,
        after,
    )


def _place(  # noqa: PLR0917  # the admission's parts, in the order _admit has them
    batch: Idle[C],
    inputs: Sequence[Req | Chunked[C]],
    reqs: Sequence[Req],
    cached: Sequence[int],
    matched: _Matched,
    allocated: tuple[HostArray, Pools],
    columns: C,
    *,
    retire: bool,  # a forward computes the pages (not `prebuilt`): duplicates are retired
) -> _Admitted[C] | ExtendError:
    new_slots, pools = allocated
    new_slot_iter = iter(new_slots.tolist())
    slots = [item.slot if isinstance(item, Chunked) else next(new_slot_iter) for item in inputs]
    # Each row's prefix: what its chunk holds, or what it reads from the cache.
    matched_iter = iter(matched.lengths)
    prefix_lens = [
        held if isinstance(item, Chunked) else next(matched_iter)
        for item, held in zip(inputs, cached, strict=True)
    ]
    seq_lens = [len(req.input_ids) for req in reqs]
    new_rows = [row for row, item in enumerate(inputs) if not isinstance(item, Chunked)]
    slots_host = host_int64(slots)
    prefix_host = host_int64(prefix_lens)
    seq_lens_host = host_int64(seq_lens)
    if retire and any(matched.lengths):  # hybrid pools: new rows resume from anchors
        pools = resume_rows(
            pools,
            [slots[row] for row in new_rows],
            [reqs[row].input_ids for row in new_rows],
            matched.lengths,
        )
    # Rows no forward computes here (`prebuilt`) are first read by their next decode,
    # at `seq_len`: they take window pages for their window's tail only.
    reads_from = None if retire else seq_lens_host
    allocation = take_tokens(pools, slots_host, prefix_host, seq_lens_host, reads_from)
    if isinstance(allocation, OutOfKVTokens):
        return allocation
    locs, after = allocation
    extend_lens = seq_lens_host - prefix_host
    rows_of_tokens = np.repeat(np.arange(len(reqs)), extend_lens)
    first_token = np.cumsum(extend_lens) - extend_lens
    positions = prefix_host[rows_of_tokens] + np.arange(locs.shape[0]) - first_token[rows_of_tokens]
    token_slots = slots_host[rows_of_tokens]
    locs32 = locs.astype(np.int32)
    # Each row's whole pages go into the cache, or its cells move onto the cache's copy.
    after, (token_slots, positions, locs32) = publish_computed(
        after,
        [
            (slots[row], reqs[row].input_ids[:length])
            for row, length in zip(new_rows, matched.lengths, strict=True)
        ],
        ExtendRows(slots, [req.input_ids for req in reqs], prefix_lens, first_token.tolist()),
        (token_slots, positions, locs32),
        retire=retire,
    )
    if retire:  # hybrid pools: an anchor at each row's last page boundary, where there is room
        after = publish_tails(after, slots, [req.input_ids for req in reqs], prefix_lens)
    if any(matched.lengths):
        # Rows that read a cached prefix: their table cells there are the cache's pages.
        prefix_rows = [
            (slots[row], pages) for row, pages in zip(new_rows, matched.pages, strict=True)
        ]
        token_slots, positions, locs32 = prefix_cells(
            prefix_rows, pools.page_size, (token_slots, positions, locs32)
        )
    # One host-to-device copy for every column, the table write and the forward.
    rows, (input_ids, out_cache_loc, *cells) = build_rows(
        batch.device,
        tuple(reqs),
        pack_ints(
            seq_lens_host,
            slots_host,
            host_int64([req.rid for req in reqs]),
            pools.slot_gens[slots_host],  # the chunks' own, checked equal, and the new
        ),
        None,
        sum(seq_lens),
        max(seq_lens),
        join_pending(columns_in_order(inputs, columns) or [columns]),
        (_token_ids(reqs, prefix_lens), locs, token_slots, positions, locs32),
    )
    # NOTE: the table write comes last: a failure before it leaves the table as it was.
    after.table.write(
        Mirrored._pair(frozen(token_slots), cells[0]),
        Mirrored._pair(frozen(positions), cells[1]),
        Mirrored._pair(frozen(locs32), cells[2]),
    )
    return _Admitted(
        rows,
        DeviceOnly(input_ids),
        DeviceOnly(out_cache_loc),
        frozen(prefix_host),
        frozen(extend_lens),
        int(extend_lens.sum()),
        after,
    )


def _no_prefix(num_reqs: int) -> HostArray:
    # Read-only zeros: a fresh extend's prefix lengths. Each record gets its own: a
    # shared array written through `torch.as_tensor` would change every record's.
    return frozen(np.zeros(num_reqs, dtype=np.int64))


def _token_ids(reqs: Sequence[Req], prefix_lens: Sequence[int]) -> HostArray:
    # The input ids each row computes, back to back.
    if len(reqs) == 1 and not prefix_lens[0]:
        ids = array("q", reqs[0].input_ids)  # `array` converts ints at C speed
    else:
        ids = array(
            "q",
            chain.from_iterable(
                req.input_ids[prefix:] for req, prefix in zip(reqs, prefix_lens, strict=True)
            ),
        )
    return np.frombuffer(ids, dtype=np.int64)
