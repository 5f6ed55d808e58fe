"""A captured CUDA graph's input buffers: allocated once per bucket, written every step.

A graph replays the device addresses it was captured with, so an engine
keeps, per captured bucket, one set of input buffers and writes each
step's forward into them. `GraphBuffers` is that set; `fill_buffers` writes a
record's forward into it and returns the `Padded` forward the replay reads
(its device sides are views of the buffers) and `unpad` takes.

    block  (uint8, one host-to-device copy)   req_pool_indices, positions, sample_index
                                              (int64); qo_indptr, cu_seqlens_k, kv_indptr,
                                              extend_lens, seq_lens, kv_last_page_len,
                                              prefix_lens (int32); then cells
                                              (int32 [kv_capacity]): each kv_indices
                                              entry's cell in the page table
    page_table  int32 [rows, max_pages]       FA3: the batch's pages copied into the
                                              left columns; columns past a row's pages
                                              are never read
    kv_indices  int32 [kv_capacity]           FlashInfer: ragged pages, a prefix used
    out_cache_loc  int64 [tokens]             the KV write, padded tokens filled

Widths are what the bucket needs, fixed at allocation: `max_pages` pages
per row (the longest context the bucket serves), not the table's width.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Self, final, overload

import attrs
import numpy as np
import torch
from returns.result import Failure, Result, Success

from batchstate.base.errors import DoesNotFit, GraphBuffersError
from batchstate.base.expect import expect_instance
from batchstate.base.mirrored import DeviceOnly, HostArray, describe
from batchstate.captured.padding import (
    SGLANG_PAD_VALUES,
    FieldPairs,
    HostLayout,
    Padded,
    TableShape,
    check_fill_ranges,
    check_fills,
    field_lengths,
    field_pairs,
    fields_bytes,
    page_counts,
    with_padding,
    write_layout,
)
from batchstate.columns.columns import C
from batchstate.forward.inputs import ForwardPhase, expect_table_of, row_layout
from batchstate.memory.token_table import TokenTable
from batchstate.records.verifying import Verifying

__all__ = ["DoesNotFit", "GraphBuffers", "GraphBuffersError", "fill_buffers"]


# Each field's bytes per entry, in `PADDED_FIELDS` order: int64 first, every view aligned.
_WIDTHS: Final = (8, 8, 8, 4, 4, 4, 4, 4, 4, 4)
_CELLS: Final = (1 << 31) - 1  # page-table cells an int32 index reaches


@final
@attrs.frozen(eq=False, repr=False)
class GraphBuffers:
    """One captured bucket's input buffers on the device, allocated once.

    Build it with `allocate` (or `for_decode`, `for_extend`, `for_verify`) before capture;
    capture the graph reading `fill_buffers`'s first result, then `fill_buffers` before each
    replay. The buffers are written in place, like the token table: a
    `Padded` from an earlier `fill_buffers` shows the newer values once that newer
    fill has run, on the host at once and on the device once its copy has,
    as the replay it fed did before it.

    Args:
        device: where the buffers live.
        page_size: KV tokens per page.
        rows: rows the graph was captured with (the batch size).
        tokens: query tokens it was captured with (rows, for decode).
        max_pages: page-table columns: the most pages one row reads.
        kv_capacity: `kv_indices` entries: the most pages all rows read.
        fills: padded rows' and tokens' values (`PAD_FIELDS`).
        block: the mirrored fields' bytes, one tensor.
        fields: views of `block`, in `PADDED_FIELDS` order.
        cells: int32 `[kv_capacity]`, a view of `block`'s tail: where each
            `kv_indices` entry is gathered from in `page_table`, flattened.
        kv_indices: int32 `[kv_capacity]`.
        page_table: int32 `[rows, max_pages]`.
        out_cache_loc: int64 `[tokens]`.
        staging: the host bytes `fill_buffers` lays a step out in, then copies into
            `block` (pinned on CUDA).
        host: writable views of `staging`, for `fill_buffers` alone.
        pairs: each mirrored field: a read-only view of `staging` and its
            view of `block`, in `PADDED_FIELDS` order.
        flat_page_table: `page_table` viewed as one row, where `cells` index.
        copies: on CUDA, the event of the last copy out of `staging`, which
            the next `fill_buffers` waits on before it writes `staging` again.
    """

    device: torch.device
    page_size: int
    rows: int
    tokens: int
    max_pages: int
    kv_capacity: int
    fills: Mapping[str, int]
    block: torch.Tensor
    fields: tuple[torch.Tensor, ...]
    cells: torch.Tensor
    kv_indices: torch.Tensor
    page_table: torch.Tensor
    out_cache_loc: torch.Tensor
    staging: torch.Tensor
    host: HostLayout
    pairs: FieldPairs
    flat_page_table: torch.Tensor
    copies: list[torch.cuda.Event]

    @classmethod
    def allocate(  # a bucket's sizes, each by name
        cls,
        device: torch.device,
        page_size: int,
        *,
        rows: int,
        tokens: int,
        max_pages: int,
        kv_capacity: int | None = None,
        fills: Mapping[str, int] | None = None,
    ) -> Self:
        """Allocate the buffers of a bucket of `rows` rows and `tokens` tokens.

        Args:
            device: where the buffers live.
            page_size: KV tokens per page (`pools.page_size`).
            rows: the bucket's rows, >= 1.
            tokens: the bucket's query tokens, >= `rows` times the fills' `extend_lens`.
            max_pages: pages one row may read, >= the fills' pages.
            kv_capacity: pages all rows may read; None: `rows * max_pages`.
            fills: as `pad`'s; None: `SGLANG_PAD_VALUES`.

        Raises:
            GraphBuffersError: a size below its minimum, or not an int.
            PaddingError: bad `fills`.
        """
        fills = dict(SGLANG_PAD_VALUES if fills is None else fills)
        check_fills(fills)
        capacity = rows * max_pages if kv_capacity is None else kv_capacity
        sizes = {"page_size": page_size, "rows": rows, "tokens": tokens}
        sizes |= {"max_pages": max_pages, "kv_capacity": capacity}
        pad_pages = -(-fills["seq_lens"] // page_size) if _is_int(page_size) else 0
        minimum = {"page_size": 1, "rows": 1, "tokens": 1, "max_pages": max(pad_pages, 1)}
        for name, value in sizes.items():
            if not _is_int(value) or value < minimum.get(name, 0):
                raise GraphBuffersError(
                    f"{name} must be an int >= {minimum.get(name, 0)}, got {value!r}"
                )
        if tokens < rows * fills["extend_lens"]:
            raise GraphBuffersError(
                f"{tokens} tokens cannot hold {rows} padded rows of"
                f" {fills['extend_lens']} query token each"
            )
        if rows * max_pages > _CELLS:
            raise GraphBuffersError(
                f"a page table of {rows} x {max_pages} cells exceeds int32 cell indices"
            )
        lengths, size = field_lengths(rows, tokens), fields_bytes(rows, tokens)
        block = torch.zeros(size + 4 * capacity, dtype=torch.uint8, device=device)
        views, start = [], 0
        for length, width in zip(lengths, _WIDTHS, strict=True):
            dtype = torch.int64 if width == 8 else torch.int32
            views.append(block[start : start + length * width].view(dtype))
            start += length * width
        staging = torch.zeros(block.shape[0], dtype=torch.uint8, pin_memory=device.type == "cuda")
        host = HostLayout.of(staging.numpy(), rows, tokens)
        host.packed.setflags(write=False)  # `host`'s views stay writable; no new view is
        pairs = field_pairs(host.read_only(), views)
        page_table = torch.zeros(rows, max_pages, dtype=torch.int32, device=device)
        return cls(
            device,
            page_size,
            rows,
            tokens,
            max_pages,
            capacity,
            fills,
            block,
            tuple(views),
            block[size:].view(torch.int32),
            torch.zeros(capacity, dtype=torch.int32, device=device),
            page_table,
            torch.zeros(tokens, dtype=torch.int64, device=device),
            staging,
            host,
            pairs,
            page_table.view(-1),
            [],
        )

    @classmethod
    def for_decode(
        cls,
        device: torch.device,
        page_size: int,
        batch_size: int,
        max_pages: int,
        fills: Mapping[str, int] | None = None,
    ) -> Self:
        """A decode bucket: `batch_size` rows of one token each."""
        return cls.allocate(
            device, page_size, rows=batch_size, tokens=batch_size, max_pages=max_pages, fills=fills
        )

    @classmethod
    def for_extend(  # noqa: PLR0917  # an extend bucket's sizes
        cls,
        device: torch.device,
        page_size: int,
        rows: int,
        tokens: int,
        max_pages: int,
        fills: Mapping[str, int] | None = None,
    ) -> Self:
        """An extend (prefill) or mixed bucket: up to `rows` rows and `tokens` query tokens.

        A smaller forward gets padded rows of the fills' query tokens, then
        tokens in no row up to `tokens`: `unpad` gathers each real row's
        last token by the buffers' `sample_index`.
        """
        return cls.allocate(
            device, page_size, rows=rows, tokens=tokens, max_pages=max_pages, fills=fills
        )

    @classmethod
    def for_verify(  # noqa: PLR0917  # a verify bucket's sizes
        cls,
        device: torch.device,
        page_size: int,
        batch_size: int,
        max_drafts: int,
        max_pages: int,
        fills: Mapping[str, int] | None = None,
    ) -> Self:
        """A verify bucket, captured per batch size: each row's decode token and up to
        `max_drafts` drafts, `batch_size * (max_drafts + 1)` tokens."""
        if not _is_int(max_drafts) or max_drafts < 0:
            raise GraphBuffersError(f"max_drafts must be an int >= 0, got {max_drafts!r}")
        return cls.allocate(
            device,
            page_size,
            rows=batch_size,
            tokens=batch_size * (max_drafts + 1),
            max_pages=max_pages,
            fills=fills,
        )

    @property
    def nbytes(self) -> int:
        """Device bytes the buffers hold."""
        tensors = (self.block, self.kv_indices, self.page_table, self.out_cache_loc)
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    def __repr__(self) -> str:
        return (
            f"GraphBuffers(rows={self.rows}, tokens={self.tokens}, max_pages={self.max_pages},"
            f" kv_capacity={self.kv_capacity}, {describe('block', self.block)})"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# A step's forward written straight from its record into a captured bucket's buffers.
#
# `forward_inputs` builds fresh tensors; a captured graph reads fixed ones.
# `fill_buffers` goes from the record (and the pools' table) to the bucket's
# buffers without building the fresh ones: the host lays every mirrored
# field out, padded, in one packed array, with each page's cell in the
# bucket's page table; one copy uploads it into the bucket's block, and
# the device gathers the rows' pages from the table into the page table,
# then the ragged `kv_indices` from the page table, by those cells.


@overload
def fill_buffers(
    buffers: GraphBuffers, batch: ForwardPhase[C], table: TokenTable
) -> Result[Padded, DoesNotFit]: ...


@overload
def fill_buffers(
    buffers: GraphBuffers, batch: Verifying[C], table: TokenTable, *, slot_tokens: HostArray
) -> Result[Padded, DoesNotFit]: ...


def fill_buffers(
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

    The real rows keep the forward's contract as `forward_inputs` states it
    (docs/design.md): cells below each row's `prefix_lens` hold an earlier
    forward's KV, and none of them is a location `out_cache_loc` writes, so
    the captured kernel may read the prefix before or after its write.
    Padded rows sit at the padding slot 0 with a prefix of the `seq_lens`
    fill less the `extend_lens` fill (0 with `SGLANG_FILLS` and
    `VLLM_FILLS`), and padded tokens write the `out_cache_loc` fill: the
    padding location 0 (several may; no real row reads it) or -1 (skipped).

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
    >>> padded = fill_buffers(buffers, batch, pools.table).unwrap()
    >>> padded.inputs.seq_lens.device.tolist(), padded.inputs.page_table.device.shape
    ([3, 2, 1, 1], torch.Size([4, 8]))
    """
    expect_instance(buffers, GraphBuffers, "fill_buffers: buffers")
    expect_instance(table, TokenTable, "fill_buffers: table")
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
