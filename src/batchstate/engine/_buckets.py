"""The engine's captured-graph buckets: one `GraphBuffers` each, allocated on first use.

An engine replaying CUDA graphs writes every step's forward into the
buffers its graph was captured with. The feeder does the same: each
bucket's `GraphBuffers` is allocated the first time a forward lands in
it and written by `fill_buffers` every step after, so the model reads the same few
tensors at every step of a bucket.

A decode forward (one query token per row at most) is bucketed by rows,
as `pad` pads it: a `for_decode` bucket of `size` rows. Any other
forward is padded by tokens in no row, its rows unchanged, which a
bucket's fixed row count can match only exactly: its bucket is
`for_extend(rows, size)`, one per row count the run brings to a size.
Beside each, the bucket's input ids (int64 `[size]`), as a graph runner
keeps them, and on hybrid pools its `HybridBuffers`, which `fill_hybrid_buffers`
writes the window and state layers' inputs into. (`fill_buffers` pads an extend
bucket's missing rows with fill rows, which `pad` does not; keyed by
rows, the model reads exactly what `pad` gave it.)
"""

from __future__ import annotations

from typing import Any, final

import numpy as np
import torch

from batchstate import (
    Decoding,
    Extended,
    GraphBuffers,
    HybridBuffers,
    HybridInputs,
    Mixed,
    Padded,
    Pools,
    fill_buffers,
    fill_hybrid_buffers,
)
from batchstate.engine._config import EngineError

__all__ = ["Buckets", "forward_shape"]


def forward_shape(batch: Extended[Any] | Decoding[Any] | Mixed[Any]) -> tuple[int, int, bool]:
    """The forward's rows, its query tokens, and whether it is a decode (<= 1 token per row).

    From the record's host mirrors, as `forward_inputs` counts them.
    """
    rows = len(batch.rows)
    if isinstance(batch, Decoding):
        return rows, rows, True
    extend = batch.extend_lens
    return rows, int(np.add.reduce(extend)), not rows or int(np.maximum.reduce(extend)) <= 1


@final
class Buckets:
    """Each bucket's `GraphBuffers`, by `(rows, tokens)`, allocated once and filled every step."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, int], GraphBuffers] = {}
        self.input_ids: dict[tuple[int, int], torch.Tensor] = {}  # int64 [tokens] each
        self.hybrid: dict[tuple[int, int], HybridBuffers] = {}  # hybrid pools' buckets

    def fill(
        self, batch: Extended[Any] | Decoding[Any] | Mixed[Any], pools: Pools, size: int
    ) -> Padded:
        """`batch`'s forward written into the buffers of its bucket of `size` tokens.

        Raises:
            EngineError: the forward does not fit the bucket its size chose (a bug).
        """
        rows, _, decode = forward_shape(batch)
        key = (size, size) if decode else (rows, size)
        buffers = self.buffers.get(key)
        if buffers is None:
            buffers = self.buffers[key] = _allocate(batch, pools, key, decode=decode)
            self.input_ids[key] = buffers.out_cache_loc.new_zeros(key[1])
        filled = fill_buffers(buffers, batch, pools.table)
        padded = filled.value_or(None)
        if padded is None:
            raise EngineError(f"a forward does not fit its bucket {key}: {filled.failure()}")
        return padded

    def hybrid_inputs(self, padded: Padded, pools: Pools) -> HybridInputs:
        """`padded`'s window and state inputs, written into its bucket's `HybridBuffers`.

        Raises:
            EngineError: they do not fit the bucket (a bug).
        """
        inputs = padded.inputs
        key = (inputs.num_rows, inputs.num_tokens)
        buffers = self.hybrid.get(key)
        if buffers is None:
            capacity = self.buffers[key].kv_capacity  # every row's longest context, as there
            buffers = self.hybrid[key] = HybridBuffers.allocate(
                inputs.device, pools.memory_kinds, rows=key[0], tokens=key[1], window_pages=capacity
            )
        filled = fill_hybrid_buffers(buffers, inputs, pools)
        hybrid = filled.value_or(None)
        if hybrid is None:
            raise EngineError(f"a forward's hybrid inputs do not fit {key}: {filled.failure()}")
        return hybrid

    def pad_ids(self, padded: Padded, input_ids: torch.Tensor) -> torch.Tensor:
        """`padded`'s real input ids written into its bucket's ids buffer, padded with 0.

        What `padded.pad_tokens(input_ids)` makes, at the bucket's fixed address.
        """
        inputs, real = padded.inputs, padded.num_real_tokens
        ids = self.input_ids[inputs.num_rows, inputs.num_tokens]
        if input_ids.shape != (real,):
            raise EngineError(f"expected {real} input ids, got shape {list(input_ids.shape)}")
        ids[:real].copy_(input_ids)
        ids[real:].fill_(0)
        return ids


def _allocate(
    batch: Extended[Any] | Decoding[Any] | Mixed[Any],
    pools: Pools,
    key: tuple[int, int],
    *,
    decode: bool,
) -> GraphBuffers:
    # As wide as the longest context a request may reach: every later forward fits.
    device, page_size = batch.rows.seq_lens.device.device, pools.page_size
    max_pages = -(-pools.max_context_len // page_size)
    if decode:
        return GraphBuffers.for_decode(device, page_size, key[0], max_pages)
    return GraphBuffers.for_extend(device, page_size, *key, max_pages)
