"""Padding a forward to a captured CUDA-graph size, and the one way back to real rows.

A CUDA graph replays the shapes it was captured with, so an engine pads
every forward to the next captured size: batch sizes for decode, token
counts for prefill. Padded rows and tokens need values that every kernel
can run on without touching real data (a padded row's slot, length,
position and KV location), and the padded rows' outputs must never be
sampled. Here the values come from a declared fill table, and a padded
forward's output is a `PaddedOutput`, which no sampler takes: `unpad` is
the only way from it to a tensor, and it keeps the real rows only.

    decode (one token per row):  rows  [ real rows | padded rows ]  each padded
                                 row: `extend_lens` fill query tokens, `seq_lens` fill KV
    prefill:                     tokens [ real tokens | padded tokens ]  in no row:
                                 `qo_indptr` ends at the real tokens
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import final

import attrs
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812  # torch's own idiom
from returns.result import Failure, Result, Success

from batchstate._captured_sizes import PaddingError, check_sizes, is_int
from batchstate._expect import expect_instance
from batchstate._fill_tables import SGLANG_FILLS, check_fill_ranges, check_fills
from batchstate._forward_inputs import ForwardInputs
from batchstate._mirrored import DeviceOnly, upload
from batchstate._padded_layout import (
    HostLayout,
    field_pairs,
    fields_bytes,
    page_counts,
    with_padding,
    write_layout,
)

__all__ = [
    "Padded",
    "PaddedOutput",
    "PaddingError",
    "TooLargeToPad",
    "bucket",
    "pad",
    "unpad",
    "unpad_tokens",
]


@final
@attrs.frozen
class TooLargeToPad:
    """The forward (or the largest data-parallel rank's) is larger than every captured size."""

    count: int  # tokens to pad (rows, for decode)
    largest: int  # the largest captured size

    def __str__(self) -> str:
        return f"{self.count} tokens exceed the largest captured size, {self.largest}"


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
    """A padded forward's per-token output: no sampler takes it; `unpad` it first."""

    padded: Padded
    _tensor: torch.Tensor

    def __repr__(self) -> str:
        return f"PaddedOutput(shape={tuple(self._tensor.shape)}, {self.padded!r})"


def unpad(output: PaddedOutput) -> torch.Tensor:
    """Each real row's last token's output, `[num_real_rows, ...]`: what sampling takes.

    A slice for a decode forward; one device gather by the uploaded
    `sample_index` otherwise.
    """
    expect_instance(output, PaddedOutput, "unpad: output")
    padded, tensor = output.padded, output._tensor  # the one reader
    inputs = padded.inputs
    if inputs.is_decode and padded.num_real_tokens == padded.num_real_rows:
        return tensor[: padded.num_real_rows]
    return tensor.index_select(0, inputs.sample_index.device[: padded.num_real_rows])


def unpad_tokens(output: PaddedOutput) -> torch.Tensor:
    """The real tokens' outputs, `[num_real_tokens, ...]` (a view)."""
    expect_instance(output, PaddedOutput, "unpad_tokens: output")
    return output._tensor[: output.padded.num_real_tokens]  # as above


def bucket(sizes: Sequence[int], count: int) -> Result[int, TooLargeToPad]:
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

    Args:
        inputs: an unpadded forward's inputs.
        sizes: the captured sizes, strictly increasing, each >= 1.
        fills: a value for every name in `FILL_FIELDS`; None: `SGLANG_FILLS`.
        at_least: pad to at least this count: the largest data-parallel rank's.

    Returns:
        `Success(Padded)`, or `Failure(TooLargeToPad)` when the count
        exceeds every size.

    Raises:
        PaddingError: bad `sizes` (see `bucket`) or `fills`: a field
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
    fills = SGLANG_FILLS if fills is None else fills
    check_fills(fills)
    check_fill_ranges(inputs, fills)
    if not is_int(at_least) or at_least < 0:
        raise PaddingError(f"at_least must be an int >= 0, got {at_least!r}")
    count = max(inputs.num_tokens, at_least)
    chosen = bucket(sizes, count)
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
