"""The host side of a padded forward: rows and tokens added by a fill table, no device work.

`pad` and `fill` (a captured graph's buffers) pad the same way and differ
only in where the device sides go: `pad` uploads fresh tensors, `fill`
writes fixed buffers. Both start here: a forward of `num_rows` rows and
`num_tokens` tokens grown to `rows` rows, each added row carrying the
fills' query and KV tokens, and to `tokens` tokens, the ones past every
row belonging to none (`qo_indptr` ends before them).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Final, final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate._forward_inputs import ForwardInputs
from batchstate._mirrored import DeviceOnly, HostArray, Mirrored, Scalar

__all__ = ["PADDED_FIELDS", "PaddedLayout", "field_lengths", "padded_layout", "with_padding"]

# The mirrored fields a padded forward recomputes, in the order of `PaddedLayout.hosts`:
# three int64 arrays, then seven int32 ones.
PADDED_FIELDS: Final = (
    "req_pool_indices",
    "positions",
    "sample_index",
    "qo_indptr",
    "cu_seqlens_k",
    "kv_indptr",
    "seq_lens",
    "prefix_lens",
    "extend_lens",
    "kv_last_page_len",
)


@final
@attrs.frozen(eq=False)
class PaddedLayout:
    """A padded forward's host arrays, views of one packed byte array, and what added rows hold.

    `packed` holds `hosts` back to back in `PADDED_FIELDS` order (the int64
    arrays first, so every view is aligned): one host-to-device copy moves them all.
    """

    packed: npt.NDArray[np.uint8]  # read-only
    staged: torch.Tensor  # `packed` as a CPU tensor, made while it was writable: the copy's source
    wide: tuple[HostArray, ...]  # read-only views of `packed`: the int64 fields
    narrow: tuple[npt.NDArray[np.int32], ...]  # and the int32 ones
    new_rows: int  # rows added
    query: int  # query tokens per added row
    kv: int  # KV tokens per added row
    pages: int  # KV pages per added row
    rows: int  # rows in all
    tokens: int  # tokens in all

    @property
    def hosts(self) -> tuple[npt.NDArray[np.int64] | npt.NDArray[np.int32], ...]:
        """Every field's host array, in `PADDED_FIELDS` order."""
        return (*self.wide, *self.narrow)


def field_lengths(rows: int, tokens: int) -> tuple[int, ...]:
    """Each padded field's length, in `PADDED_FIELDS` order, for `rows` rows and `tokens` tokens."""
    return (rows, tokens, rows, rows + 1, rows + 1, rows + 1, rows, rows, rows, rows)


def padded_layout(
    inputs: ForwardInputs, rows: int, tokens: int, fills: Mapping[str, int]
) -> PaddedLayout:
    """`inputs`' host arrays grown to `rows` rows and `tokens` tokens (both at least theirs).

    Each added row queries `fills["extend_lens"]` tokens over `fills["seq_lens"]`
    KV tokens; the caller checks that `tokens` holds them. Every array is
    written in place into one packed buffer: no array per field.
    """
    num_rows, num_tokens = inputs.num_rows, inputs.num_tokens
    new_rows = rows - num_rows
    query, kv = (fills["extend_lens"], fills["seq_lens"]) if new_rows else (0, 0)
    pages = -(-kv // inputs.page_size)
    last = kv - (pages - 1) * inputs.page_size if pages else 0
    lengths = field_lengths(rows, tokens)
    wide = 8 * sum(lengths[:3])
    packed = np.empty(wide + 4 * sum(lengths[3:]), dtype=np.uint8)
    wide_part, narrow_part = packed[:wide].view(np.int64), packed[wide:].view(np.int32)
    wide_hosts = _split(wide_part, lengths[:3])
    narrow_hosts = _split(narrow_part, lengths[3:])
    slots, positions, sample = wide_hosts
    qo, cu_k, kv_ptr, seq, prefix, extend, last_len = narrow_hosts
    steps = np.arange(1, new_rows + 1)
    tails = ((qo, inputs.qo_indptr, query), (cu_k, inputs.cu_seqlens_k, kv))
    for offsets, source, step in (*tails, (kv_ptr, inputs.kv_indptr, pages)):
        # CSR offsets, continued by `new_rows` rows of `step` each.
        offsets[: num_rows + 1] = source.host
        offsets[num_rows + 1 :] = int(source.host[-1]) + step * steps
    for per_row, real, value in (
        (slots, inputs.req_pool_indices, fills["req_pool_indices"]),
        (sample, inputs.sample_index, 0),
        (seq, inputs.seq_lens, kv),
        (prefix, inputs.prefix_lens, kv - query),
        (extend, inputs.extend_lens, query),
        (last_len, inputs.kv_last_page_len, last),
    ):
        per_row[:num_rows] = real.host
        per_row[num_rows:] = value
    np.maximum(qo[num_rows + 1 :] - 1, 0, out=sample[num_rows:])
    positions[:num_tokens] = inputs.positions.host
    positions[num_tokens:] = fills["positions"]
    layout_hosts: tuple[npt.NDArray[np.generic], ...] = (*wide_hosts, *narrow_hosts)
    staged = torch.from_numpy(packed)  # NOTE: before the freeze, which torch warns about
    packed.setflags(write=False)
    for host in layout_hosts:
        host.setflags(write=False)
    return PaddedLayout(
        packed, staged, wide_hosts, narrow_hosts, new_rows, query, kv, pages, rows, tokens
    )


def _split(array: npt.NDArray[Scalar], lengths: Sequence[int]) -> tuple[npt.NDArray[Scalar], ...]:
    # Consecutive views of `array`, one per length.
    bounds = np.cumsum((0, *lengths)).tolist()
    return tuple(array[start:stop] for start, stop in itertools.pairwise(bounds))


def with_padding(  # noqa: PLR0917  # the three device fields, in ForwardInputs' order
    inputs: ForwardInputs,
    layout: PaddedLayout,
    sides: Sequence[torch.Tensor],
    kv_indices: DeviceOnly,
    page_table: DeviceOnly,
    out_cache_loc: DeviceOnly,
) -> ForwardInputs:
    """The padded record: `inputs` with `layout`'s counts, its host arrays mirrored by
    `sides` (device tensors in `PADDED_FIELDS` order) and the three device fields."""
    added = layout.new_rows
    slots, positions, sample = (
        Mirrored._pair(host, side) for host, side in zip(layout.wide, sides[:3], strict=True)
    )
    qo, cu_k, kv_ptr, seq, prefix, extend, last_len = (
        Mirrored._pair(host, side) for host, side in zip(layout.narrow, sides[3:], strict=True)
    )
    return ForwardInputs(
        device=inputs.device,
        page_size=inputs.page_size,
        table_pages=inputs.table_pages,
        table_rows=inputs.table_rows,
        kv_cache_size=inputs.kv_cache_size,
        num_rows=layout.rows,
        num_tokens=layout.tokens,
        seq_lens_sum=inputs.seq_lens_sum + added * layout.kv,
        max_q_len=max(inputs.max_q_len, layout.query if added else 0),
        max_kv_len=max(inputs.max_kv_len, layout.kv if added else 0),
        num_pages=inputs.num_pages + added * layout.pages,
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
        kv_indices=kv_indices,
        page_table=page_table,
        out_cache_loc=out_cache_loc,
    )
