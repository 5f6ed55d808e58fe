"""A captured CUDA graph's input buffers: allocated once per bucket, written every step.

A graph replays the device addresses it was captured with, so an engine
keeps, per captured bucket, one set of input buffers and writes each
step's forward into them. `GraphBuffers` is that set; `fill` writes a
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
from typing import Final, Self, final

import attrs
import torch

from batchstate._fill_tables import SGLANG_FILLS, check_fills
from batchstate._mirrored import describe
from batchstate._padded_layout import (
    FieldPairs,
    HostLayout,
    field_lengths,
    field_pairs,
    fields_bytes,
)

__all__ = ["DoesNotFit", "GraphBuffers", "GraphBuffersError"]

# Each field's bytes per entry, in `PADDED_FIELDS` order: int64 first, every view aligned.
_WIDTHS: Final = (8, 8, 8, 4, 4, 4, 4, 4, 4, 4)
_CELLS: Final = (1 << 31) - 1  # page-table cells an int32 index reaches


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

    Build it with `allocate` (or `for_decode`, `for_extend`, `for_verify`) before capture;
    capture the graph reading `fill`'s first result, then `fill` before each
    replay. The buffers are written in place, like the token table: a
    `Padded` from an earlier `fill` shows the newer values once that newer
    fill has run, on the host at once and on the device once its copy has,
    as the replay it fed did before it.

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
        cells: int32 `[kv_capacity]`, a view of `block`'s tail: where each
            `kv_indices` entry is gathered from in `page_table`, flattened.
        kv_indices: int32 `[kv_capacity]`.
        page_table: int32 `[rows, max_pages]`.
        out_cache_loc: int64 `[tokens]`.
        staging: the host bytes `fill` lays a step out in, then copies into
            `block` (pinned on CUDA).
        host: writable views of `staging`, for `fill` alone.
        pairs: each mirrored field: a read-only view of `staging` and its
            view of `block`, in `PADDED_FIELDS` order.
        flat_page_table: `page_table` viewed as one row, where `cells` index.
        copies: on CUDA, the event of the last copy out of `staging`, which
            the next `fill` waits on before it writes `staging` again.
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
            fills: as `pad`'s; None: `SGLANG_FILLS`.

        Raises:
            GraphBuffersError: a size below its minimum, or not an int.
            PaddingError: bad `fills`.
        """
        fills = dict(SGLANG_FILLS if fills is None else fills)
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
