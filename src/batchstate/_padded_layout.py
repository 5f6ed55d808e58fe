"""The host side of a padded forward: rows and tokens added by a fill table, no device work.

`pad` and `fill` (a captured graph's buffers) pad the same way and differ
only in where the arrays live: `pad` lays them out in a fresh array and
uploads fresh tensors, `fill` in the bucket's host staging array, written
every step, and copies it into the bucket's block. Both start here, from
each real row's slot, prefix, query and KV lengths: a forward of `n` rows
grown to `rows` rows, each added row carrying the fills' query and KV
tokens, and to `tokens` tokens, the ones past every row belonging to none
(`qo_indptr` ends before them). Every field is written in place into one
packed byte array, so that one host-to-device copy moves them all:

    int64   req_pool_indices [rows] | positions [tokens] | sample_index [rows]
    int32   qo_indptr | cu_seqlens_k | kv_indptr [rows + 1 each]
            extend_lens | seq_lens | kv_last_page_len | prefix_lens [rows each]
            cells [the rest]: each kv_indices entry's cell in a page table
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Self, TypeAlias, cast, final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate._forward_inputs import ForwardInputs
from batchstate._mirrored import DeviceOnly, Mirrored

__all__ = [
    "PADDED_FIELDS",
    "FieldPairs",
    "HostLayout",
    "LayoutSizes",
    "TableShape",
    "field_lengths",
    "field_pairs",
    "fields_bytes",
    "page_counts",
    "with_padding",
    "write_layout",
]

# The mirrored fields a padded forward holds, in `HostLayout.fields` order.
PADDED_FIELDS: Final = (
    "req_pool_indices",
    "positions",
    "sample_index",
    "qo_indptr",
    "cu_seqlens_k",
    "kv_indptr",
    "extend_lens",
    "seq_lens",
    "kv_last_page_len",
    "prefix_lens",
)

IntArray = npt.NDArray[np.integer]
_I32 = Mirrored[np.int32]
# The mirrored fields, paired, in `PADDED_FIELDS` order: three int64 ones, seven int32 ones.
FieldPairs: TypeAlias = tuple[
    Mirrored, Mirrored, Mirrored, _I32, _I32, _I32, _I32, _I32, _I32, _I32
]


def field_pairs(
    hosts: Sequence[npt.NDArray[np.generic]], sides: Sequence[torch.Tensor]
) -> FieldPairs:
    """Each field's read-only host array beside its device tensor, in `PADDED_FIELDS` order."""
    pairs = tuple(Mirrored._pair(host, side) for host, side in zip(hosts, sides, strict=True))
    return cast("FieldPairs", pairs)  # the order the layout writes them in


def field_lengths(rows: int, tokens: int) -> tuple[int, ...]:
    """Each padded field's length, in `PADDED_FIELDS` order, for `rows` rows and `tokens` tokens."""
    return (rows, tokens, rows, rows + 1, rows + 1, rows + 1, rows, rows, rows, rows)


def fields_bytes(rows: int, tokens: int) -> int:
    """Bytes the fields take before `cells`."""
    return 8 * (2 * rows + tokens) + 4 * (3 * (rows + 1) + 4 * rows)


def page_counts(seq: IntArray, page_size: int) -> IntArray:
    """KV pages each row of `seq` KV tokens reads."""
    return (seq + (page_size - 1)) // page_size if page_size > 1 else seq


@final
@attrs.frozen(eq=False)
class HostLayout:
    """Writable views of one packed byte array: the fields, grouped as `write_layout` fills them.

    `packed` holds the fields back to back (the int64 ones first, so every
    view is aligned), then `cells`.
    """

    packed: npt.NDArray[np.uint8]
    fields: tuple[npt.NDArray[np.int64] | npt.NDArray[np.int32], ...]  # `PADDED_FIELDS` order
    offsets: npt.NDArray[np.int32]  # [3, rows + 1]: qo_indptr, cu_seqlens_k, kv_indptr
    # [4, rows]: extend, seq and last page's lens (each row's pages, while the offsets are
    # summed from the first three), then prefix lens
    per_row: npt.NDArray[np.int32]
    cells: npt.NDArray[np.int32]
    rows: int
    tokens: int

    @classmethod
    def of(cls, packed: npt.NDArray[np.uint8], rows: int, tokens: int) -> Self:
        """Views of `packed`, at least `fields_bytes(rows, tokens)` long; the offsets' first
        column set to 0, which `write_layout` leaves as it is."""
        wide = 8 * (2 * rows + tokens)
        narrow = fields_bytes(rows, tokens)
        longs = packed[:wide].view(np.int64)
        ints = packed[wide:narrow].view(np.int32)
        offsets = ints[: 3 * (rows + 1)].reshape(3, rows + 1)
        per_row = ints[3 * (rows + 1) :].reshape(4, rows)
        offsets[:, 0] = 0
        fields = (
            longs[:rows],
            longs[rows : rows + tokens],
            longs[rows + tokens :],
            *offsets,
            *per_row,
        )
        return cls(packed, fields, offsets, per_row, packed[narrow:].view(np.int32), rows, tokens)

    def read_only(self) -> tuple[npt.NDArray[np.int64] | npt.NDArray[np.int32], ...]:
        """New views of the fields that refuse writes, for the records that hold them."""
        views = tuple(field.view() for field in self.fields)
        for view in views:
            view.setflags(write=False)
        return views


@final
@attrs.frozen
class LayoutSizes:
    """What `write_layout` laid out, counted."""

    real_rows: int
    real_tokens: int
    real_pages: int
    new_rows: int
    pad_pages: int  # KV pages per added row
    num_pages: int  # pages in all
    seq_lens_sum: int
    max_q_len: int
    max_kv_len: int


def write_layout(  # noqa: PLR0917  # the target, a forward's per-row arrays, their sums
    host: HostLayout,
    slots: IntArray,
    prefix: IntArray,
    extend: IntArray,
    seq: IntArray,
    pages: IntArray,
    real_tokens: int,
    page_size: int,
    fills: Mapping[str, int],
    *,
    columns: int = 0,
) -> LayoutSizes:
    """Lay these real rows out in `host`, grown to its rows and tokens by `fills`.

    `pages` is `page_counts(seq)`, `real_tokens` the sum of `extend`. Each
    added row queries `fills["extend_lens"]` tokens over `fills["seq_lens"]`
    KV tokens; the caller checks that `host` holds them. With `columns`,
    `cells` gets each page's cell in a page table of that width (a
    bucket's), added rows' pages included.
    """
    # ufunc calls (`np.add.accumulate`, not `np.cumsum`): numpy's Python wrappers cost as
    # much as the work on a batch's arrays.
    rows, n = host.rows, seq.shape[0]
    new_rows = rows - n
    query, kv = fills["extend_lens"], fills["seq_lens"]
    pad_pages = -(-kv // page_size)
    slots_v, positions, sample = host.fields[:3]
    per_row, offsets = host.per_row, host.offsets
    extend_v, seq_v, last_v, prefix_v = per_row
    slots_v[:n] = slots
    per_row[0, :n] = extend
    per_row[1, :n] = seq
    per_row[2, :n] = pages  # each row's pages, for now
    per_row[3, :n] = prefix
    if new_rows:
        slots_v[n:] = fills["req_pool_indices"]
        per_row[:, n:] = np.array([[query], [kv], [pad_pages], [kv - query]])
    np.add.accumulate(per_row[:3], axis=1, out=offsets[:, 1:])
    kv_ptr = offsets[2]
    num_pages = int(kv_ptr[-1])
    if columns:
        # Row r's j-th page sits at cell r * columns + j; kv_ptr[r] is j = 0's entry.
        starts = np.arange(0, rows * columns, columns, dtype=np.int32)
        np.subtract(starts, kv_ptr[:-1], out=starts)
        counter = np.arange(num_pages, dtype=np.int32)
        np.add(starts.repeat(last_v), counter, out=host.cells[:num_pages])
    # Tokens in a row's last page: its KV tokens less its other pages' (0 with no KV).
    if page_size == 1:
        np.minimum(seq_v, 1, out=last_v)
    else:
        np.subtract(last_v, 1, out=last_v)
        np.maximum(last_v, 0, out=last_v)
        np.multiply(last_v, page_size, out=last_v)
        np.subtract(seq_v, last_v, out=last_v)
    np.subtract(offsets[0, 1:], 1, out=sample)
    np.maximum(sample, 0, out=sample)
    max_q_len = int(np.maximum.reduce(extend_v)) if rows else 0
    if max_q_len <= 1 and real_tokens == n:  # decode: one query token a row, at its prefix
        positions[:n] = prefix
    else:
        starts = (prefix_v[:n] - offsets[0, :n]).repeat(extend_v[:n])
        np.add(starts, np.arange(real_tokens), out=positions[:real_tokens])
    positions[real_tokens:] = fills["positions"]
    return LayoutSizes(
        real_rows=n,
        real_tokens=real_tokens,
        real_pages=int(kv_ptr[n]),
        new_rows=new_rows,
        pad_pages=pad_pages,
        num_pages=num_pages,
        seq_lens_sum=int(offsets[1, -1]),
        max_q_len=max_q_len,
        max_kv_len=int(np.maximum.reduce(seq_v)) if rows else 0,
    )


@final
@attrs.frozen
class TableShape:
    """What a forward's record says of the table it reads: `ForwardInputs`' first fields."""

    device: torch.device
    page_size: int
    table_pages: int
    table_rows: int
    kv_cache_size: int


def with_padding(  # noqa: PLR0917  # the three device fields, in ForwardInputs' order
    like: ForwardInputs | TableShape,
    rows: int,
    tokens: int,
    sizes: LayoutSizes,
    pairs: FieldPairs,
    device_fields: tuple[DeviceOnly, DeviceOnly, DeviceOnly],
) -> ForwardInputs:
    """The padded record: `rows` rows, `tokens` tokens, `pairs` (in `PADDED_FIELDS`
    order), `kv_indices`, `page_table`, `out_cache_loc`, and `like`'s table shape."""
    slots, positions, sample, qo, cu_k, kv_ptr, extend, seq, last_len, prefix = pairs
    return ForwardInputs(
        device=like.device,
        page_size=like.page_size,
        table_pages=like.table_pages,
        table_rows=like.table_rows,
        kv_cache_size=like.kv_cache_size,
        num_rows=rows,
        num_tokens=tokens,
        seq_lens_sum=sizes.seq_lens_sum,
        max_q_len=sizes.max_q_len,
        max_kv_len=sizes.max_kv_len,
        num_pages=sizes.num_pages,
        req_pool_indices=slots,
        seq_lens=seq,
        prefix_lens=prefix,
        extend_lens=extend,
        positions=positions,
        qo_indptr=qo,
        cu_seqlens_k=cu_k,
        kv_indptr=kv_ptr,
        kv_last_page_len=last_len,
        sample_index=sample,
        kv_indices=device_fields[0],
        page_table=device_fields[1],
        out_cache_loc=device_fields[2],
    )
