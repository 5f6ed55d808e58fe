"""What a forward consumes: `forward_inputs`, attention metadata from host mirrors, no device read.

The phase records say what each row is; attention kernels take more: each
token's position, the ragged query and key layouts as CSR offsets, and the KV
pages each row reads. Here every value is computed on the host from the
record's mirrors and uploaded in one copy; only the page gathers from the
request-to-token table run on the device. The module starts with the checks
of `forward_inputs`' extra arguments (the table, page size and, for a verify
window, per-slot lengths come from the pools, not the record, so a caller
could hand over the wrong ones; each is refused with `ForwardInputsError`).
"""

from __future__ import annotations

from typing import TypeAlias, final, overload

import attrs
import numpy as np
import torch

from batchstate.base.errors import ForwardInputsError, PhaseError
from batchstate.base.expect import expect_instance
from batchstate.base.mirrored import DeviceOnly, HostArray, Mirrored, frozen, upload
from batchstate.columns.columns import C
from batchstate.memory.token_table import TokenTable
from batchstate.pools.lineage import GENERATION_BITS
from batchstate.records.mixed import Mixed
from batchstate.records.phases import Decoding, Extended, Idle
from batchstate.records.verifying import Verifying, holds_window

__all__ = [
    "ForwardInputs",
    "ForwardInputsError",
    "ForwardPhase",
    "expect_table_of",
    "forward_inputs",
    "row_layout",
    "window_seq_lens",
]


def expect_table_of(
    batch: ForwardPhase[C] | Verifying[C], table: TokenTable, page_size: int
) -> None:
    """Raise `ForwardInputsError` unless `table` and `page_size` are the pools' of `batch`.

    A record's generations were issued by its pools' lineage, which counts
    from the base the table carries: two reductions over the host gens.
    """
    given: object = page_size  # callers without mypy may pass anything
    if not isinstance(given, int) or isinstance(given, bool) or page_size < 1:
        raise ForwardInputsError(f"page_size must be an int >= 1, got {page_size!r}")
    if page_size != table.page_size:
        raise ForwardInputsError(
            f"page_size={page_size}, but the table's pools have pages of {table.page_size}:"
            f" pass pools.page_size"
        )
    gens = batch.gens if isinstance(batch, Verifying) else batch.rows.gens
    if gens.shape[0]:
        lineage = table.first_gen >> GENERATION_BITS
        if int(np.minimum.reduce(gens)) >> GENERATION_BITS != lineage or (
            int(np.maximum.reduce(gens)) >> GENERATION_BITS != lineage
        ):
            raise ForwardInputsError(
                "the table is another pools' than the record's: pass the table of the pools"
                " the record was built with (pools.table)"
            )


def window_seq_lens(
    batch: Verifying[C], table: TokenTable, slot_tokens: HostArray | None
) -> HostArray:
    """Each window row's KV length (its slot's tokens, drafts included), checked against `table`."""
    if slot_tokens is None:
        raise PhaseError("forward_inputs of a Verifying window takes slot_tokens=pools.slot_tokens")
    given: object = slot_tokens  # callers without mypy may pass anything
    if not isinstance(given, np.ndarray) or slot_tokens.ndim != 1 or slot_tokens.dtype != np.int64:
        raise ForwardInputsError("slot_tokens must be the pools' int64 tokens per slot")
    slots = batch.req_pool_indices.host
    if slots.shape[0] and int(slots.max()) >= slot_tokens.shape[0]:
        raise ForwardInputsError("slot_tokens must be the pools' int64 tokens per slot")
    seq = slot_tokens[slots]
    if not holds_window(table, seq, batch):
        raise ForwardInputsError(
            "slot_tokens do not hold this window's drafts: pass pools.slot_tokens of the pools"
            " verify returned (or their successors), read after verify"
        )
    return seq


# What a forward consumes: attention metadata derived from host mirrors, with no device read.
#
# The phase records say what each row is; attention kernels take more: each
# token's position, the ragged query and key layouts as CSR offsets, and the
# KV pages each row reads. Engines often derive these from device tensors
# (a `.item()` for a sum, a `.max()` for a kernel's launch bound, a host copy
# of an index pointer inside a kernel's planning step). Here every value is
# computed on the host from the record's mirrors and uploaded in one copy;
# only the page gathers from the request-to-token table run on the device.
#
#     row i:  queries  tokens [qo_indptr[i], qo_indptr[i + 1]), positions
#                      [prefix_lens[i], seq_lens[i])
#             keys     KV positions [0, seq_lens[i]), in pages
#                      kv_indices[kv_indptr[i]:kv_indptr[i + 1]], the last
#                      holding kv_last_page_len[i] tokens


# The records whose forward these inputs feed (Verifying: the verify forward).
ForwardPhase: TypeAlias = Idle[C] | Extended[C] | Decoding[C] | Mixed[C]


@final
@attrs.frozen(eq=False, repr=False)
class ForwardInputs:
    """Everything the common attention backends take for one forward, host and device.

    Build it with `forward_inputs`. Per-row fields have `num_rows` entries,
    per-token fields `num_tokens`, the CSR offsets `num_rows + 1`. Fields a
    backend plans with on the host are `Mirrored`; the page gathers from the
    request-to-token table exist only on the device. A padded record
    (`pad`) has the same fields, with padded rows and tokens at the end.

    Args:
        device: where the device sides live.
        page_size: KV tokens per page.
        table_pages: pages in a full row of the token table (a static
            page-table width, for CUDA graphs).
        table_rows: rows of the token table: request slots, padding row 0
            included (a fill's slot must be one).
        kv_cache_size: KV locations the pools hand out, padding page 0
            included (a fill's location or page must be one).
        num_rows: rows (requests) in the forward.
        num_tokens: query tokens in the forward (`input_ids`' length).
        seq_lens_sum: KV tokens every row attends over, summed.
        max_q_len: the longest row's query tokens (a kernel's launch bound).
        max_kv_len: the longest row's KV tokens.
        num_pages: KV pages every row reads, summed (`kv_indices`' length).
        req_pool_indices: int64 `[num_rows]`, each row's request slot.
        seq_lens: int32 `[num_rows]`, KV tokens each row attends over
            (FA3's `cache_seqlens`).
        prefix_lens: int32 `[num_rows]`, KV tokens before this forward.
        extend_lens: int32 `[num_rows]`, query tokens of each row.
        positions: int64 `[num_tokens]`, each token's position in its request.
        qo_indptr: int32 `[num_rows + 1]`, query offsets (`cu_seqlens_q`).
        cu_seqlens_k: int32 `[num_rows + 1]`, KV token offsets.
        kv_indptr: int32 `[num_rows + 1]`, page offsets into `kv_indices`.
        kv_last_page_len: int32 `[num_rows]`, tokens in each row's last page
            (0 for a row with no KV).
        sample_index: int64 `[num_rows]`, each row's last query token, where
            its logits are taken (0 for a padded row with no query).
        kv_indices: device int32 `[num_pages]`, every row's pages, back to back.
        page_table: device int32 `[num_rows, pages]`, row -> its pages (FA3's
            `page_table`); columns past a row's pages are never read.
        out_cache_loc: device int64 `[num_tokens]`, where each token's KV goes.
    """

    device: torch.device
    page_size: int
    table_pages: int
    table_rows: int
    kv_cache_size: int
    num_rows: int
    num_tokens: int
    seq_lens_sum: int
    max_q_len: int
    max_kv_len: int
    num_pages: int
    req_pool_indices: Mirrored
    seq_lens: Mirrored[np.int32]
    prefix_lens: Mirrored[np.int32]
    extend_lens: Mirrored[np.int32]
    positions: Mirrored
    qo_indptr: Mirrored[np.int32]
    cu_seqlens_k: Mirrored[np.int32]
    kv_indptr: Mirrored[np.int32]
    kv_last_page_len: Mirrored[np.int32]
    sample_index: Mirrored
    kv_indices: DeviceOnly
    page_table: DeviceOnly
    out_cache_loc: DeviceOnly

    @property
    def is_decode(self) -> bool:
        """One query token per row at most: padding then adds rows, not only tokens."""
        return self.max_q_len <= 1

    def __repr__(self) -> str:
        return (
            f"ForwardInputs(num_rows={self.num_rows}, num_tokens={self.num_tokens},"
            f" num_pages={self.num_pages}, page_size={self.page_size}, device={self.device})"
        )


@overload
def forward_inputs(batch: ForwardPhase[C], table: TokenTable, page_size: int) -> ForwardInputs: ...


@overload
def forward_inputs(
    batch: Verifying[C], table: TokenTable, page_size: int, *, slot_tokens: HostArray
) -> ForwardInputs: ...


def forward_inputs(
    batch: ForwardPhase[C] | Verifying[C],
    table: TokenTable,
    page_size: int,
    *,
    slot_tokens: HostArray | None = None,
) -> ForwardInputs:
    """The attention inputs of `batch`'s forward, from host data, in one upload.

    Reads nothing from the device. The host computes every offset, length
    and position and uploads them together; the device gathers each row's
    page ids from `table` (two gathers, and a division when `page_size` > 1).

    What a kernel may assume, the forward's contract (docs/design.md): when
    this forward starts, every cell below row `i`'s `prefix_lens[i]` holds KV
    an earlier forward wrote; the forward writes exactly `out_cache_loc`,
    each location once; and no location it writes is a cell below any row's
    `prefix_lens`. So the prefix (the first `prefix_lens[i]` keys of row
    `i`'s pages) may be read before or after the write: a ragged kernel
    attends over the step's own keys and values and over the paged prefix,
    then writes; a paged one writes, then reads every key through the
    pages. That holds for extend, mixed and decode forwards and for a
    verify window (its prefix ends before the decode token); on hybrid
    pools, window cells below the prefix are an earlier forward's or the
    anchors' copies' (`hybrid_inputs`), made before any layer runs.
    `check_forward` checks it for a record about to run.

    Args:
        batch: the record whose forward runs (`Idle` gives zero rows).
        table: the request-to-token table `batch` was built against (`pools.table`).
        page_size: KV tokens per page (`pools.page_size`).
        slot_tokens: for a `Verifying` window only, the tokens each slot
            owns (`pools.slot_tokens`): the window's lengths, decode token
            and drafts included, which the window itself keeps on the device.

    Raises:
        PhaseError: `batch` runs no forward, or a `Verifying` came without `slot_tokens`.
        BatchConflict: `table` lives on another device than `batch`.
        ForwardInputsError: `page_size` is not the pools' of `table`, `table`
            is another pools' than `batch`'s, or `slot_tokens` do not hold
            the window (read before `verify`, or another pools').

    >>> from batchstate import Req, extend, idle, make_pools
    >>> pools = make_pools(4, 32, 64, torch.device("cpu"), page_size=4)
    >>> batch, pools = extend(idle("cpu"), [Req(0, (1, 2, 3, 4, 5)), Req(1, (6,))], pools).unwrap()
    >>> inputs = forward_inputs(batch, pools.table, pools.page_size)
    >>> inputs.qo_indptr.host.tolist(), inputs.kv_indptr.host.tolist()
    ([0, 5, 6], [0, 2, 3])
    >>> inputs.kv_last_page_len.host.tolist(), inputs.max_q_len
    ([1, 1], 5)
    """
    expect_instance(table, TokenTable, "forward_inputs: table")
    slots, prefix, extend, seq, locs = row_layout(batch, table, slot_tokens)
    device = slots.device.device
    table.expect_on(device)
    expect_table_of(batch, table, page_size)
    return _build(table, page_size, slots, prefix, extend, seq, locs)


def row_layout(
    batch: ForwardPhase[C] | Verifying[C], table: TokenTable, slot_tokens: HostArray | None
) -> tuple[Mirrored, HostArray, HostArray, HostArray, torch.Tensor]:
    """Each row's slot, prefix, query and KV lengths (host), and the tokens' KV locations."""
    if isinstance(batch, Verifying):
        return _window_layout(batch, table, slot_tokens)
    if not isinstance(batch, Idle | Extended | Decoding | Mixed):
        raise PhaseError(
            "forward_inputs takes Idle, Extended, Decoding, Mixed or Verifying,"
            f" got {type(batch).__name__}"
        )
    rows = batch.rows
    seq = rows.seq_lens.host
    if isinstance(batch, Idle):
        empty = seq[:0]
        return rows.req_pool_indices, empty, empty, empty, rows.seq_lens.device[:0]
    if isinstance(batch, Decoding):
        extend = np.empty_like(seq)  # then a fill: np.ones_like's wrapper costs more
        extend.fill(1)
        return rows.req_pool_indices, seq - 1, extend, seq, batch.out_cache_loc.device
    prefix, extend = batch.prefix_lens, batch.extend_lens
    return rows.req_pool_indices, prefix, extend, seq, batch.out_cache_loc.device


def _window_layout(
    batch: Verifying[C], table: TokenTable, slot_tokens: HostArray | None
) -> tuple[Mirrored, HostArray, HostArray, HostArray, torch.Tensor]:
    # Row i queries its decode token and its drafts, positions [c - 1, c + d), and attends
    # over every token its slot owns, c + d: what verify reserved.
    seq = window_seq_lens(batch, table, slot_tokens)
    extend = batch.draft_lens + 1
    return batch.req_pool_indices, seq - extend, extend, seq, batch.out_cache_loc.device


def _build(  # noqa: PLR0917  # one row's layout, in the order _layout returns it
    table: TokenTable,
    page_size: int,
    slots: Mirrored,
    prefix: HostArray,
    extend: HostArray,
    seq: HostArray,
    locs: torch.Tensor,
) -> ForwardInputs:
    num_rows = seq.shape[0]
    qo_indptr = _offsets(extend)
    cu_seqlens_k = _offsets(seq)
    pages = -(-seq // page_size)
    kv_indptr = _offsets(pages)
    last_page_len = seq - (pages - 1) * page_size
    last_page_len[pages == 0] = 0
    num_tokens, num_pages = int(qo_indptr[-1]), int(kv_indptr[-1])
    token_rows = np.repeat(np.arange(num_rows), extend)
    within = np.arange(num_tokens) - qo_indptr[:-1][token_rows]
    positions = prefix[token_rows] + within
    max_pages = int(pages.max()) if num_rows else 0
    # Each page's cell in the gathered [num_rows, max_pages] page table, flattened.
    page_rows = np.repeat(np.arange(num_rows), pages)
    flat = page_rows * max_pages + np.arange(num_pages) - kv_indptr[:-1][page_rows]
    page_starts = np.arange(max_pages, dtype=np.int64) * page_size
    hosts = (
        positions,
        np.maximum(qo_indptr[1:] - 1, 0),
        flat,
        page_starts,
        *(
            array.astype(np.int32)
            for array in (qo_indptr, cu_seqlens_k, kv_indptr, seq, prefix, extend, last_page_len)
        ),
    )
    device = slots.device.device
    sides = upload(hosts, device)
    frozen_hosts = [frozen(host) for host in hosts]
    pairs = [Mirrored.trusted(host, side) for host, side in zip(frozen_hosts, sides, strict=True)]
    flat_side, starts_side = sides[2], sides[3]
    # NOTE: the only device work: gather each row's page-start cells, then its pages in order.
    page_table = table.device[slots.device[:, None], starts_side[None, :]]
    if page_size > 1:
        page_table = torch.div(page_table, page_size, rounding_mode="floor")
    kv_indices = page_table.reshape(-1).index_select(0, flat_side)
    return ForwardInputs(
        device=device,
        page_size=page_size,
        table_pages=-(-table.max_context_len // page_size),
        table_rows=int(table.host.shape[0]),
        kv_cache_size=table.kv_cache_size,
        num_rows=num_rows,
        num_tokens=num_tokens,
        seq_lens_sum=int(seq.sum()),
        max_q_len=int(extend.max()) if num_rows else 0,
        max_kv_len=int(seq.max()) if num_rows else 0,
        num_pages=num_pages,
        req_pool_indices=slots,
        seq_lens=pairs[7],
        prefix_lens=pairs[8],
        extend_lens=pairs[9],
        positions=pairs[0],
        qo_indptr=pairs[4],
        cu_seqlens_k=pairs[5],
        kv_indptr=pairs[6],
        kv_last_page_len=pairs[10],
        sample_index=pairs[1],
        kv_indices=DeviceOnly(kv_indices),
        page_table=DeviceOnly(page_table),
        out_cache_loc=DeviceOnly(locs),
    )


def _offsets(lens: HostArray) -> HostArray:
    # CSR offsets: [0, lens[0], lens[0] + lens[1], ...], int64 on the host.
    offsets = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return offsets
