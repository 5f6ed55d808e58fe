"""Padding a forward to a captured (CUDA-graph) size: fill tables, the padded layout, `pad`.

In this module, top to bottom: the fill tables (the values padded rows and
tokens carry, SGLang's and vLLM's); the host side of a padded forward, shared
with `fill`'s buffers; and `pad`, `unpad`, `unpad_tokens`, `bucket` and
`Padded`. Captured sizes are checked without torch in `captured.sizes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Final, Self, TypeAlias, cast, final

import attrs
import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F  # noqa: N812  # torch's own idiom
from returns.result import Failure, Result, Success

from batchstate.base.errors import TooLargeToPad
from batchstate.base.expect import expect_instance
from batchstate.base.mirrored import DeviceOnly, Mirrored, upload
from batchstate.captured.sizes import PaddingError, check_sizes, is_int
from batchstate.forward.inputs import ForwardInputs

if TYPE_CHECKING:
    from batchstate.forward.inputs import ForwardInputs

__all__ = [
    "PADDED_FIELDS",
    "PAD_FIELDS",
    "SGLANG_PAD_VALUES",
    "VLLM_PAD_VALUES",
    "FieldPairs",
    "HostLayout",
    "LayoutSizes",
    "Padded",
    "PaddedOutput",
    "TableShape",
    "TooLargeToPad",
    "captured_size",
    "check_fill_ranges",
    "check_fills",
    "field_lengths",
    "field_pairs",
    "fields_bytes",
    "pad",
    "page_counts",
    "unpad",
    "unpad_tokens",
    "with_padding",
    "write_layout",
]


# Fill tables: the values padded rows and tokens carry, and their checks.
#
# `pad` and `fill_buffers` add rows and tokens to a forward; each needs a slot, a
# length, a position, a KV location and a page that every kernel can run on
# without touching real data. A fill table names them; SGLang's and vLLM's
# are below.


# What a fill table sets, for padded rows and tokens (every other field follows from these).
PAD_FIELDS: Final = (
    "req_pool_indices",  # a padded row's slot: 0, the table's padding row
    "seq_lens",  # KV tokens a padded row attends over
    "extend_lens",  # query tokens of a padded row: 1 or 0
    "positions",  # a padded token's position
    "out_cache_loc",  # where a padded token's KV is written
    "kv_indices",  # the page a padded row's KV lies in
)

# SGLang's CUDA-graph runner: every padded row reads and writes the padding location 0
# (slot 0, page 0), one KV token and one query token, position 0. What FlashInfer's and
# FA3's kernels need: no row of zero length, and every location inside the cache.
SGLANG_PAD_VALUES: Final[Mapping[str, int]] = {
    "req_pool_indices": 0,
    "seq_lens": 1,
    "extend_lens": 1,
    "positions": 0,
    "out_cache_loc": 0,
    "kv_indices": 0,
}
# vLLM's: padded rows have no query and no KV (`query_start_loc` repeats its last value)
# and a slot mapping of -1, which its KV-write kernel skips. Only for kernels that take
# empty rows and skip negative locations.
VLLM_PAD_VALUES: Final[Mapping[str, int]] = {
    "req_pool_indices": 0,
    "seq_lens": 0,
    "extend_lens": 0,
    "positions": 0,
    "out_cache_loc": -1,
    "kv_indices": 0,
}


def check_fill_ranges(inputs: ForwardInputs | TableShape, fills: Mapping[str, int]) -> None:
    """Raise `PaddingError` if a fill points outside the table or the KV cache `inputs` read.

    Such a fill would make a padded row read or write memory no pools hand
    out (or past the cache's end).
    """
    context = inputs.table_pages * inputs.page_size
    pages = inputs.kv_cache_size // inputs.page_size
    limits = {
        "req_pool_indices": (0, inputs.table_rows - 1),
        "seq_lens": (0, context),
        "positions": (0, context - 1),
        "out_cache_loc": (-1, inputs.kv_cache_size - 1),  # -1: a location kernels skip
        "kv_indices": (0, pages - 1),
    }
    for name, (low, high) in limits.items():
        if not low <= fills[name] <= high:
            raise PaddingError(
                f"fills: {name}={fills[name]} points outside the table or the KV cache:"
                f" expected {low}..{high}"
            )


def check_fills(fills: Mapping[str, int]) -> None:
    """Raise `PaddingError` unless `fills` sets every name in `PAD_FIELDS` to a usable int."""
    if not isinstance(fills, Mapping):
        raise PaddingError(f"fills must map each of {', '.join(PAD_FIELDS)} to an int")
    missing = [name for name in PAD_FIELDS if name not in fills]
    unknown = sorted(str(name) for name in fills if name not in PAD_FIELDS)
    if missing or unknown:
        raise PaddingError(f"fills: missing {missing}, unknown {unknown}")
    bad = [name for name in PAD_FIELDS if not is_int(fills[name])]
    if bad:
        raise PaddingError(f"fills must be ints: {bad}")
    if fills["extend_lens"] not in (0, 1) or fills["seq_lens"] < fills["extend_lens"]:
        raise PaddingError(
            "fills: extend_lens must be 0 or 1 and seq_lens at least extend_lens, got"
            f" {fills['extend_lens']} and {fills['seq_lens']}"
        )


# The host side of a padded forward: rows and tokens added by a fill table, no device work.
#
# `pad` and `fill_buffers` (a captured graph's buffers) pad the same way and differ
# only in where the arrays live: `pad` lays them out in a fresh array and
# uploads fresh tensors, `fill_buffers` in the bucket's host staging array, written
# every step, and copies it into the bucket's block. Both start here, from
# each real row's slot, prefix, query and KV lengths: a forward of `n` rows
# grown to `rows` rows, each added row carrying the fills' query and KV
# tokens, and to `tokens` tokens, the ones past every row belonging to none
# (`qo_indptr` ends before them). Every field is written in place into one
# packed byte array, so that one host-to-device copy moves them all:
#
#     int64   req_pool_indices [rows] | positions [tokens] | sample_index [rows]
#     int32   qo_indptr | cu_seqlens_k | kv_indptr [rows + 1 each]
#             extend_lens | seq_lens | kv_last_page_len | prefix_lens [rows each]
#             cells [the rest]: each kv_indices entry's cell in a page table


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
    pairs = tuple(Mirrored.trusted(host, side) for host, side in zip(hosts, sides, strict=True))
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


# Padding a forward to a captured CUDA-graph size, and the one way back to real rows.
#
# A CUDA graph replays the shapes it was captured with, so an engine pads
# every forward to the next captured size: batch sizes for decode, token
# counts for prefill. Padded rows and tokens need values that every kernel
# can run on without touching real data (a padded row's slot, length,
# position and KV location), and the padded rows' outputs must never be
# sampled. Here the values come from a declared fill table, and a padded
# forward's output is a `PaddedOutput`, which no sampler takes: `unpad` is
# the only way from it to a tensor, and it keeps the real rows only.
#
#     decode (one token per row):  rows  [ real rows | padded rows ]  each padded
#                                  row: `extend_lens` fill query tokens, `seq_lens` fill KV
#     prefill:                     tokens [ real tokens | padded tokens ]  in no row:
#                                  `qo_indptr` ends at the real tokens


@final
@attrs.frozen(eq=False, repr=False)
class Padded:
    """A forward padded to a captured size: `inputs` has the padded shapes.

    Real rows come first, unchanged, then padded rows; real tokens first,
    then padded ones. Run the forward with `run`, and reach the real rows'
    outputs with `unpad`.
    """

    inputs: ForwardInputs  # padded: num_rows and num_tokens are the captured size's
    num_real_rows: int
    num_real_tokens: int
    fills: Mapping[str, int]

    @property
    def padded_rows(self) -> int:
        """Rows added: 0 for a prefill, padded by tokens."""
        return self.inputs.num_rows - self.num_real_rows

    @property
    def padded_tokens(self) -> int:
        """Tokens added."""
        return self.inputs.num_tokens - self.num_real_tokens

    def pad_tokens(self, tensor: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """A device tensor `[num_real_tokens, ...]` (input ids, say), padded with `fill`."""
        return _pad_first(tensor, self.num_real_tokens, self.inputs.num_tokens, fill)

    def pad_rows(self, tensor: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """A device tensor `[num_real_rows, ...]` (a sampling column, say), padded with `fill`."""
        return _pad_first(tensor, self.num_real_rows, self.inputs.num_rows, fill)

    def run(self, forward: Callable[[ForwardInputs], torch.Tensor]) -> PaddedOutput:
        """Run `forward` on the padded inputs: its `[num_tokens, ...]` output, wrapped."""
        return self.wrap(forward(self.inputs))

    def wrap(self, output: torch.Tensor) -> PaddedOutput:
        """Wrap a per-token output of this padded forward (a CUDA graph's output buffer)."""
        if output.shape[:1] != (self.inputs.num_tokens,):
            raise PaddingError(
                f"a padded forward's output has {self.inputs.num_tokens} tokens,"
                f" got shape {list(output.shape)}"
            )
        return PaddedOutput(self, output)

    def __repr__(self) -> str:
        return (
            f"Padded(rows={self.num_real_rows}+{self.padded_rows},"
            f" tokens={self.num_real_tokens}+{self.padded_tokens})"
        )


@final
@attrs.frozen(eq=False, repr=False)
class PaddedOutput:
    """A padded forward's per-token output: no sampler takes it; `unpad` it first.

    Its tensor is typed `object`, so mypy rejects handing the output, or the
    attribute that holds the tensor, to code that takes a tensor: only
    `unpad` and `unpad_tokens` give one back (short of a `cast` or an
    `isinstance` check, which say on purpose what they do).
    """

    padded: Padded
    _tensor: object  # a torch.Tensor, typed so that it reaches no sampler but through unpad

    def __repr__(self) -> str:
        return f"PaddedOutput(shape={tuple(_tensor_of(self).shape)}, {self.padded!r})"


def _tensor_of(output: PaddedOutput) -> torch.Tensor:
    # `wrap` stores a tensor: the one place that says so to mypy.
    return cast("torch.Tensor", output._tensor)


def unpad(output: PaddedOutput) -> torch.Tensor:
    """Each real row's last token's output, `[num_real_rows, ...]`: what sampling takes.

    A slice for a decode forward; one device gather by the uploaded
    `sample_index` otherwise.
    """
    expect_instance(output, PaddedOutput, "unpad: output")
    padded, tensor = output.padded, _tensor_of(output)  # the one reader
    inputs = padded.inputs
    if inputs.is_decode and padded.num_real_tokens == padded.num_real_rows:
        return tensor[: padded.num_real_rows]
    return tensor.index_select(0, inputs.sample_index.device[: padded.num_real_rows])


def unpad_tokens(output: PaddedOutput) -> torch.Tensor:
    """The real tokens' outputs, `[num_real_tokens, ...]` (a view)."""
    expect_instance(output, PaddedOutput, "unpad_tokens: output")
    return _tensor_of(output)[: output.padded.num_real_tokens]  # as above


def captured_size(sizes: Sequence[int], count: int) -> Result[int, TooLargeToPad]:
    """The smallest captured size >= `count`, or `Failure(TooLargeToPad)`.

    For data-parallel ranks, `count` is the largest rank's: the token counts
    they already exchange for their shared layers.

    Raises:
        PaddingError: `sizes` is empty, not strictly increasing, or holds a
            size below 1 or a non-int; `count` is not an int >= 0.
    """
    if not is_int(count) or count < 0:
        raise PaddingError(f"count must be an int >= 0, got {count!r}")
    check_sizes(sizes)
    for size in sizes:
        if size >= count:
            return Success(size)
    return Failure(TooLargeToPad(count, sizes[-1]))


def pad(
    inputs: ForwardInputs,
    sizes: Sequence[int],
    fills: Mapping[str, int] | None = None,
    *,
    at_least: int = 0,
) -> Result[Padded, TooLargeToPad]:
    """Pad `inputs` to the smallest captured size that holds it, in one upload.

    A decode forward (at most one query token per row) is padded by rows,
    each filled from `fills`; any other forward by tokens that belong to no
    row. `sizes` counts tokens, which for decode equal rows. Host work,
    one upload, and a device pad of `kv_indices`, `page_table` (widened to
    the table's full width, so its shape is static) and `out_cache_loc`;
    no read.

    The real rows keep the forward's contract of `inputs` (docs/design.md:
    no location the forward writes is a cell below a row's `prefix_lens`),
    so a kernel may read each prefix before or after the write. Padded
    rows sit at the padding slot 0 with a prefix of the `seq_lens` fill
    less the `extend_lens` fill (0 with `SGLANG_FILLS` and `VLLM_FILLS`);
    padded tokens write the `out_cache_loc` fill, the padding location 0
    (several may; no real row reads it) or -1 (a write vLLM skips).

    Args:
        inputs: an unpadded forward's inputs.
        sizes: the captured sizes, strictly increasing, each >= 1.
        fills: a value for every name in `PAD_FIELDS`; None: `SGLANG_PAD_VALUES`.
        at_least: pad to at least this count: the largest data-parallel rank's.

    Returns:
        `Success(Padded)`, or `Failure(TooLargeToPad)` when the count
        exceeds every size.

    Raises:
        PaddingError: bad `sizes` (see `captured_size`) or `fills`: a field
            missing or unknown, a non-int, `extend_lens` other than 0 or 1,
            or `seq_lens` below `extend_lens`; a fill outside the table or
            the KV cache (a slot, position, location or page no pools hand
            out; `out_cache_loc=-1` is allowed); `at_least` below 0.

    >>> from batchstate import Req, decode, extend, forward_inputs, idle, make_pools
    >>> pools = make_pools(4, 32, 64, torch.device("cpu"))
    >>> batch, pools = extend(idle("cpu"), [Req(0, (1, 2)), Req(1, (3,))], pools).unwrap()
    >>> batch, pools = decode(batch, pools).unwrap()
    >>> padded = pad(forward_inputs(batch, pools.table, pools.page_size), [1, 4, 8]).unwrap()
    >>> padded.inputs.num_rows, padded.inputs.seq_lens.host.tolist()
    (4, [3, 2, 1, 1])
    """
    expect_instance(inputs, ForwardInputs, "pad: inputs")
    fills = SGLANG_PAD_VALUES if fills is None else fills
    check_fills(fills)
    check_fill_ranges(inputs, fills)
    if not is_int(at_least) or at_least < 0:
        raise PaddingError(f"at_least must be an int >= 0, got {at_least!r}")
    count = max(inputs.num_tokens, at_least)
    chosen = captured_size(sizes, count)
    if not isinstance(chosen, Success):
        return Failure(chosen.failure())
    return Success(_pad_to(inputs, chosen.unwrap(), fills))


def _pad_to(inputs: ForwardInputs, size: int, fills: Mapping[str, int]) -> Padded:
    rows = size if inputs.is_decode else inputs.num_rows  # prefill: tokens in no row
    host = HostLayout.of(np.empty(fields_bytes(rows, size), dtype=np.uint8), rows, size)
    seq = inputs.seq_lens.host
    sizes = write_layout(
        host,
        inputs.req_pool_indices.host,
        inputs.prefix_lens.host,
        inputs.extend_lens.host,
        seq,
        page_counts(seq, inputs.page_size),
        inputs.num_tokens,
        inputs.page_size,
        fills,
    )
    host.packed.setflags(write=False)
    hosts = host.read_only()
    pairs = field_pairs(hosts, upload(hosts, inputs.device))
    page_table = inputs.page_table.device
    width = max(inputs.table_pages, page_table.shape[1])
    page_fill, added = fills["kv_indices"], sizes.new_rows
    padded_inputs = with_padding(
        inputs,
        rows,
        size,
        sizes,
        pairs,
        (
            DeviceOnly(
                F.pad(inputs.kv_indices.device, (0, added * sizes.pad_pages), value=page_fill)
            ),
            DeviceOnly(
                F.pad(page_table, (0, width - page_table.shape[1], 0, added), value=page_fill)
            ),
            DeviceOnly(
                F.pad(
                    inputs.out_cache_loc.device,
                    (0, size - inputs.num_tokens),
                    value=fills["out_cache_loc"],
                )
            ),
        ),
    )
    # the size holds the count, and a padded row adds at most one token
    assert size - inputs.num_tokens - added * fills["extend_lens"] >= 0
    return Padded(padded_inputs, inputs.num_rows, inputs.num_tokens, dict(fills))


def _pad_first(tensor: torch.Tensor, real: int, size: int, fill: int | float) -> torch.Tensor:
    if tensor.shape[:1] != (real,):
        raise PaddingError(
            f"expected {real} entries to pad to {size}, got shape {list(tensor.shape)}"
        )
    widths = (0, 0) * (tensor.dim() - 1) + (0, size - real)
    return F.pad(tensor, widths, value=fill)
