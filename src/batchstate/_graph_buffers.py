"""A captured CUDA graph's input buffers: allocated once per bucket, written every step.

A graph replays the device addresses it was captured with, so an engine
keeps, per captured bucket, one set of input buffers and writes each
step's forward into them. `GraphBuffers` is that set; `fill` writes a
`ForwardInputs` into it and returns the `Padded` forward the replay reads
(its device sides are views of the buffers) and `unpad` takes.

    block  (uint8, one host-to-device copy)   req_pool_indices, positions, sample_index
                                              (int64); qo_indptr, cu_seqlens_k, kv_indptr,
                                              seq_lens, prefix_lens, extend_lens,
                                              kv_last_page_len (int32)
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
from typing import Final, Self, final

import attrs
import torch
from returns.result import Failure, Result, Success

from batchstate._expect import expect_instance
from batchstate._forward_inputs import ForwardInputs
from batchstate._mirrored import DeviceOnly, describe
from batchstate._padded_layout import field_lengths, padded_layout, with_padding
from batchstate._padding import SGLANG_FILLS, Padded, _check_fills

__all__ = ["DoesNotFit", "GraphBuffers", "GraphBuffersError", "fill"]

# Each field's bytes per entry, in `PADDED_FIELDS` order: int64 first, every view aligned.
_WIDTHS: Final = (8, 8, 8, 4, 4, 4, 4, 4, 4, 4)


class GraphBuffersError(ValueError):
    """A bucket that cannot be allocated, or inputs of another device or page size."""


@final
@attrs.frozen
class DoesNotFit:
    """A forward larger than the bucket in one of its sizes: nothing was written."""

    what: str  # "rows", "tokens", "pages per row" or "kv pages"
    needed: int
    capacity: int

    def __str__(self) -> str:
        return f"{self.needed} {self.what} exceed the bucket's {self.capacity}"


@final
@attrs.frozen(eq=False, repr=False)
class GraphBuffers:
    """One captured bucket's input buffers on the device, allocated once.

    Build it with `allocate` (or `for_decode`, `for_verify`) before capture;
    capture the graph reading `fill`'s first result, then `fill` before each
    replay. The buffers are written in place, like the token table: a
    `Padded` from an earlier `fill` shows the newer values on the device
    once that newer fill has run, as the replay it fed did before it.

    Args:
        device: where the buffers live.
        page_size: KV tokens per page.
        rows: rows the graph was captured with (the batch size).
        tokens: query tokens it was captured with (rows, for decode).
        max_pages: page-table columns: the most pages one row reads.
        kv_capacity: `kv_indices` entries: the most pages all rows read.
        fills: padded rows' and tokens' values (`FILL_FIELDS`).
        block: the mirrored fields' bytes, one tensor.
        fields: views of `block`, in `PADDED_FIELDS` order.
        kv_indices: int32 `[kv_capacity]`.
        page_table: int32 `[rows, max_pages]`.
        out_cache_loc: int64 `[tokens]`.
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
    kv_indices: torch.Tensor
    page_table: torch.Tensor
    out_cache_loc: torch.Tensor

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
            fills: as `pad`'s; None: `SGLANG_FILLS`.

        Raises:
            GraphBuffersError: a size below its minimum, or not an int.
            PaddingError: bad `fills`.
        """
        fills = dict(SGLANG_FILLS if fills is None else fills)
        _check_fills(fills)
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
        lengths = field_lengths(rows, tokens)
        block = torch.zeros(
            sum(n * w for n, w in zip(lengths, _WIDTHS, strict=True)),
            dtype=torch.uint8,
            device=device,
        )
        views, start = [], 0
        for length, width in zip(lengths, _WIDTHS, strict=True):
            dtype = torch.int64 if width == 8 else torch.int32
            views.append(block[start : start + length * width].view(dtype))
            start += length * width
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
            torch.zeros(capacity, dtype=torch.int32, device=device),
            torch.zeros(rows, max_pages, dtype=torch.int32, device=device),
            torch.zeros(tokens, dtype=torch.int64, device=device),
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


def fill(buffers: GraphBuffers, inputs: ForwardInputs) -> Result[Padded, DoesNotFit]:
    """Write `inputs`, padded to the bucket, into `buffers`: one upload, no allocation.

    The host pads every offset, length and position by the bucket's fill
    table and packs them into one host-to-device copy into `buffers.block`;
    the device copies the forward's page gathers and KV locations into the
    fixed page table, `kv_indices` and `out_cache_loc`, and fills the
    padded rows' and tokens' cells. No device tensor is allocated and none
    is read. Returns the `Padded` forward whose device sides are the
    buffers (what the captured graph reads), or `Failure(DoesNotFit)`,
    with the buffers unchanged.

    Raises:
        TypeError: `buffers` or `inputs` is not of its type.
        GraphBuffersError: `inputs` live on another device or use another page size.

    >>> from batchstate import Req, decode, extend, forward_inputs, idle, make_pools
    >>> pools = make_pools(4, 32, 64, torch.device("cpu"))
    >>> batch, pools = extend(idle("cpu"), [Req(0, (1, 2)), Req(1, (3,))], pools).unwrap()
    >>> batch, pools = decode(batch, pools).unwrap()
    >>> buffers = GraphBuffers.for_decode(torch.device("cpu"), 1, batch_size=4, max_pages=8)
    >>> padded = fill(buffers, forward_inputs(batch, pools.table, 1)).unwrap()
    >>> padded.inputs.seq_lens.device.tolist(), padded.inputs.page_table.device.shape
    ([3, 2, 1, 1], torch.Size([4, 8]))
    """
    expect_instance(buffers, GraphBuffers, "fill: buffers")
    expect_instance(inputs, ForwardInputs, "fill: inputs")
    if inputs.device != buffers.device or inputs.page_size != buffers.page_size:
        raise GraphBuffersError(
            f"inputs on {inputs.device} with page size {inputs.page_size}; the buffers on"
            f" {buffers.device} with page size {buffers.page_size}"
        )
    fills = buffers.fills
    query, kv = fills["extend_lens"], fills["seq_lens"]
    pad_pages = -(-kv // buffers.page_size)
    new_rows = buffers.rows - inputs.num_rows
    checks = (
        ("rows", inputs.num_rows, buffers.rows),
        ("tokens", inputs.num_tokens + max(new_rows, 0) * query, buffers.tokens),
        ("pages per row", inputs.page_table.device.shape[1], buffers.max_pages),
        ("kv pages", inputs.num_pages + max(new_rows, 0) * pad_pages, buffers.kv_capacity),
    )
    for what, needed, capacity in checks:
        if needed > capacity:
            return Failure(DoesNotFit(what, needed, capacity))
    layout = padded_layout(inputs, buffers.rows, buffers.tokens, fills)
    staged = layout.staged
    if buffers.device.type == "cuda":
        staged = staged.pin_memory()  # torch's caching host allocator: reused once copied
    buffers.block.copy_(staged, non_blocking=True)  # NOTE: the one upload
    _copy_device_fields(buffers, inputs, new_rows * pad_pages)
    num_pages = inputs.num_pages + new_rows * pad_pages
    padded = with_padding(
        inputs,
        layout,
        buffers.fields,
        DeviceOnly(buffers.kv_indices[:num_pages]),
        DeviceOnly(buffers.page_table),
        DeviceOnly(buffers.out_cache_loc),
    )
    return Success(Padded(padded, inputs.num_rows, inputs.num_tokens, dict(fills)))


def _copy_device_fields(buffers: GraphBuffers, inputs: ForwardInputs, new_pages: int) -> None:
    # Device-to-device copies into fixed addresses, then the padded cells' fills. Only the
    # batch's columns of the page table are written: FA3 reads a row's pages and no more.
    page_fill, rows, width = buffers.fills["kv_indices"], inputs.num_rows, inputs.page_table
    pad_pages = -(-buffers.fills["seq_lens"] // buffers.page_size)
    if rows and width.device.shape[1]:
        buffers.page_table[:rows, : width.device.shape[1]].copy_(width.device)
    if rows < buffers.rows and pad_pages:
        buffers.page_table[rows:, :pad_pages].fill_(page_fill)
    if inputs.num_pages:
        buffers.kv_indices[: inputs.num_pages].copy_(inputs.kv_indices.device)
    if new_pages:
        buffers.kv_indices[inputs.num_pages : inputs.num_pages + new_pages].fill_(page_fill)
    if inputs.num_tokens:
        buffers.out_cache_loc[: inputs.num_tokens].copy_(inputs.out_cache_loc.device)
    if inputs.num_tokens < buffers.tokens:
        buffers.out_cache_loc[inputs.num_tokens :].fill_(buffers.fills["out_cache_loc"])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
