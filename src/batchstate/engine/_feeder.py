"""Each forward's inputs, filled into a captured CUDA-graph bucket when the run captures any."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

import torch
from returns.result import Success

from batchstate import (
    Decoding,
    Extended,
    ForwardInputs,
    HybridInputs,
    Mixed,
    Padded,
    Pools,
    captured_size,
    forward_inputs,
)
from batchstate.engine._buckets import Buckets, forward_shape

__all__ = ["Feeder"]


@final
class Feeder:
    """Builds a forward's `ForwardInputs` or, with `graph_sizes`, fills a bucket's; counts both.

    With sizes, every forward is padded to the smallest size that holds its
    tokens (rows, for decode), with SGLang's fills: on the CPU too, the same
    shapes a CUDA graph would replay, without a capture. It is written by
    `fill_buffers` into its bucket's `GraphBuffers` (`buckets`), allocated on the
    bucket's first forward and reused by every later one, as a replayed
    graph reads the buffers it was captured with. A forward larger than
    every size runs unpadded, on fresh inputs, as an engine runs such a
    batch eagerly.

    Raises:
        PaddingError: `graph_sizes` not strictly increasing positive ints.
    """

    def __init__(self, graph_sizes: Sequence[int] = ()) -> None:
        self.sizes = tuple(graph_sizes)
        if self.sizes:
            captured_size(self.sizes, 1)  # refuses bad sizes up front
        self.forwards = 0
        self.padded_forwards = 0
        self.eager_forwards = 0  # larger than every size: run unpadded
        self.padded_rows = 0
        self.padded_tokens = 0
        # Data-parallel ranks: the size the next forward pads to (the bucket of the largest
        # rank's forward), so every rank brings as many to the shared layers; 0: every rank
        # runs eagerly. None (one process): each forward pads to its own bucket.
        self.floor: int | None = None
        self.buckets = Buckets()  # each bucket's buffers, allocated on its first forward

    def inputs(
        self, batch: Extended[Any] | Decoding[Any] | Mixed[Any], pools: Pools
    ) -> ForwardInputs | Padded:
        """`batch`'s forward inputs: its bucket's buffers when a captured size holds them."""
        self.forwards += 1
        if not self.sizes:
            return forward_inputs(batch, pools.table, pools.page_size)
        floor = self.floor
        size = captured_size(self.sizes, max(forward_shape(batch)[1], floor or 0))
        if floor == 0 or not isinstance(size, Success):
            self.eager_forwards += 1
            return forward_inputs(batch, pools.table, pools.page_size)
        padded = self.buckets.fill(batch, pools, size.unwrap())
        self.padded_forwards += 1
        self.padded_rows += padded.padded_rows
        self.padded_tokens += padded.padded_tokens
        return padded

    def hybrid_inputs(self, padded: Padded, pools: Pools) -> HybridInputs:
        """A padded forward's window and state inputs, in its bucket's `HybridBuffers`."""
        return self.buckets.hybrid_inputs(padded, pools)

    def pad_ids(self, padded: Padded, input_ids: torch.Tensor) -> torch.Tensor:
        """A padded forward's input ids, in its bucket's ids buffer (padded with 0)."""
        return self.buckets.pad_ids(padded, input_ids)
