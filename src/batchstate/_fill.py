"""A step's forward written straight from its record into a captured bucket's buffers.

`forward_inputs` builds fresh tensors; a captured graph reads fixed ones.
`fill` goes from the record (and the pools' table) to the bucket's
buffers without building the fresh ones: the host lays every mirrored
field out, padded, in one packed array, with each page's cell in the
bucket's page table; one copy uploads it into the bucket's block, and
the device gathers the rows' pages from the table into the page table,
then the ragged `kv_indices` from the page table, by those cells.
"""

from __future__ import annotations

from typing import overload

import numpy as np
import torch
from returns.result import Failure, Result, Success

from batchstate._columns import C
from batchstate._expect import expect_instance
from batchstate._fill_tables import check_fill_ranges
from batchstate._forward_checks import expect_table_of
from batchstate._forward_inputs import ForwardPhase, row_layout
from batchstate._graph_buffers import DoesNotFit, GraphBuffers, GraphBuffersError
from batchstate._mirrored import DeviceOnly, HostArray
from batchstate._padded_layout import TableShape, page_counts, with_padding, write_layout
from batchstate._padding import Padded
from batchstate._token_table import TokenTable
from batchstate._verifying import Verifying

__all__ = ["fill"]


@overload
def fill(
    buffers: GraphBuffers, batch: ForwardPhase[C], table: TokenTable
) -> Result[Padded, DoesNotFit]: ...


@overload
def fill(
    buffers: GraphBuffers, batch: Verifying[C], table: TokenTable, *, slot_tokens: HostArray
) -> Result[Padded, DoesNotFit]: ...


def fill(
    buffers: GraphBuffers,
    batch: ForwardPhase[C] | Verifying[C],
    table: TokenTable,
    *,
    slot_tokens: HostArray | None = None,
) -> Result[Padded, DoesNotFit]:
    """Write `batch`'s forward, padded to the bucket, into `buffers`: one upload, no allocation.

    What `pad(forward_inputs(batch, table, ...))` computes, written into the
    bucket's fixed buffers instead of fresh tensors, and without building
    the unpadded inputs first. The host computes every offset, length and
    position from the record's mirrors, padded by the bucket's fills, and
    packs them into one host-to-device copy into `buffers.block`; the
    device gathers the rows' pages from `table` into the page table's left
    columns and the ragged `kv_indices` from there, and copies the KV
    locations. No device tensor is allocated and none is read.

    Args:
        buffers: the bucket's buffers (a decode, extend or verify bucket).
        batch: the record whose forward runs: `Idle`, `Extended`, `Decoding`,
            `Mixed` or a `Verifying` window.
        table: the request-to-token table `batch` was built against (`pools.table`).
        slot_tokens: for a `Verifying` window only: `pools.slot_tokens`.

    Returns:
        The `Padded` forward whose device sides are views of the buffers
        (what the captured graph reads, and what `unpad` takes), or
        `Failure(DoesNotFit)` with the buffers unchanged.

    Raises:
        TypeError: `buffers` or `table` is not of its type.
        PhaseError: `batch` runs no forward, or a `Verifying` came without `slot_tokens`.
        BatchConflict: `table` lives on another device than `batch`.
        GraphBuffersError: `batch` lives on another device than the buffers, or
            the table's page size is not theirs.
        ForwardInputsError: `table` is another pools' than `batch`'s, or
            `slot_tokens` do not hold the window.
        PaddingError: the bucket's fills point outside `table` or its KV
            cache (a slot, position, location or page no pools hand out).

    >>> from batchstate import Req, decode, extend, idle, make_pools
    >>> pools = make_pools(4, 32, 64, torch.device("cpu"))
    >>> batch, pools = extend(idle("cpu"), [Req(0, (1, 2)), Req(1, (3,))], pools).unwrap()
    >>> batch, pools = decode(batch, pools).unwrap()
    >>> buffers = GraphBuffers.for_decode(torch.device("cpu"), 1, batch_size=4, max_pages=8)
    >>> padded = fill(buffers, batch, pools.table).unwrap()
    >>> padded.inputs.seq_lens.device.tolist(), padded.inputs.page_table.device.shape
    ([3, 2, 1, 1], torch.Size([4, 8]))
    """
    expect_instance(buffers, GraphBuffers, "fill: buffers")
    expect_instance(table, TokenTable, "fill: table")
    slots, prefix, extend, seq, locs = row_layout(batch, table, slot_tokens)
    device, page_size = slots.device.device, table.page_size
    table.expect_on(device)
    if device != buffers.device or page_size != buffers.page_size:
        raise GraphBuffersError(
            f"a record on {device} with pages of {page_size}; the buffers on"
            f" {buffers.device} with pages of {buffers.page_size}"
        )
    expect_table_of(batch, table, page_size)
    shape = TableShape(
        device,
        page_size,
        -(-table.max_context_len // page_size),
        int(table.host.shape[0]),
        table.kv_cache_size,
    )
    fills, n = buffers.fills, seq.shape[0]
    check_fill_ranges(shape, fills)
    pages = page_counts(seq, page_size)
    widest = int(np.maximum.reduce(pages)) if n else 0
    new_rows = max(buffers.rows - n, 0)
    pad_pages = -(-fills["seq_lens"] // page_size)
    tokens = int(np.add.reduce(extend))
    for what, needed, capacity in (
        ("rows", n, buffers.rows),
        ("tokens", tokens + new_rows * fills["extend_lens"], buffers.tokens),
        ("pages per row", widest, buffers.max_pages),
        ("kv pages", int(np.add.reduce(pages)) + new_rows * pad_pages, buffers.kv_capacity),
    ):
        if needed > capacity:
            return Failure(DoesNotFit(what, needed, capacity))
    if buffers.copies:  # CUDA: the last step's copy out of the staging bytes, long done
        buffers.copies.pop().synchronize()
    sizes = write_layout(
        buffers.host,
        slots.host,
        prefix,
        extend,
        seq,
        pages,
        tokens,
        page_size,
        fills,
        columns=buffers.max_pages,
    )
    used = buffers.staging.shape[0] - 4 * (buffers.kv_capacity - sizes.num_pages)
    # NOTE: the one upload: every mirrored field and each page's cell, at fixed addresses.
    buffers.block[:used].copy_(buffers.staging[:used], non_blocking=True)
    if device.type == "cuda":
        buffers.copies.append(torch.cuda.Event())  # type: ignore[no-untyped-call]  # torch's
        buffers.copies[0].record()
    kv_indices = _write_device_fields(buffers, table, locs, n, widest, sizes.num_pages)
    padded = with_padding(
        shape,
        buffers.rows,
        buffers.tokens,
        sizes,
        buffers.pairs,
        (
            DeviceOnly(kv_indices),
            DeviceOnly(buffers.page_table),
            DeviceOnly(buffers.out_cache_loc),
        ),
    )
    return Success(Padded(padded, n, tokens, dict(fills)))


def _write_device_fields(  # noqa: PLR0917  # the bucket, the table, then what the host knows
    buffers: GraphBuffers,
    table: TokenTable,
    locs: torch.Tensor,
    rows: int,
    widest: int,
    num_pages: int,
) -> torch.Tensor:
    # Device work into fixed addresses, every index from the block just uploaded; returns
    # the used part of `kv_indices`. Only the batch's columns of the page table are written:
    # FA3 reads a row's pages and no more. Each slice is a torch call, so there are few.
    fills, page_size, page_table = buffers.fills, buffers.page_size, buffers.page_table
    if rows and widest:
        # Row i's page j starts at token j * page_size of its slot's row of the table.
        starts = table.device[:, : widest * page_size : page_size]
        written = page_table[:rows, :widest]
        # aten's `index` with `out=`, not `index_select`: over the table's strided columns
        # it runs 3-4x faster on the CPU at 1,024 rows (benchmarks/graph_buffers.py).
        torch.ops.aten.index.Tensor_out(starts, [buffers.fields[0][:rows]], out=written)
        if page_size > 1:
            written.div_(page_size, rounding_mode="floor")
    pad_pages = -(-fills["seq_lens"] // page_size)
    if rows < buffers.rows and pad_pages:
        page_table[rows:, :pad_pages].fill_(fills["kv_indices"])
    kv_indices = buffers.kv_indices[:num_pages]
    if num_pages:  # the ragged pages, padded rows' included, from the page table just written
        cells = buffers.cells[:num_pages]
        torch.index_select(buffers.flat_page_table, 0, cells, out=kv_indices)
    tokens = locs.shape[0]
    if tokens:
        buffers.out_cache_loc[:tokens].copy_(locs)
    if tokens < buffers.tokens:
        buffers.out_cache_loc[tokens:].fill_(fills["out_cache_loc"])
    return kv_indices
