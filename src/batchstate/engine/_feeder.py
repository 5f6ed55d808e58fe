"""Each forward's inputs, padded to a captured CUDA-graph size when the run captures any."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from batchstate import (
    SGLANG_FILLS,
    Decoding,
    Extended,
    ForwardInputs,
    Mixed,
    Padded,
    Pools,
    bucket,
    forward_inputs,
    pad,
)

__all__ = ["Feeder"]


@final
class Feeder:
    """Builds a forward's `ForwardInputs` and, with `graph_sizes`, pads them; counts both.

    With sizes, every forward is padded to the smallest size that holds its
    tokens (rows, for decode), with SGLang's fills: on the CPU too, the same
    shapes a CUDA graph would replay, without a capture. A forward larger
    than every size runs unpadded, as an engine runs such a batch eagerly.

    Raises:
        PaddingError: `graph_sizes` not strictly increasing positive ints.
    """

    def __init__(self, graph_sizes: Sequence[int] = ()) -> None:
        self.sizes = tuple(graph_sizes)
        if self.sizes:
            bucket(self.sizes, 1)  # refuses bad sizes up front
        self.forwards = 0
        self.padded_forwards = 0
        self.eager_forwards = 0  # larger than every size: run unpadded
        self.padded_rows = 0
        self.padded_tokens = 0
        # Data-parallel ranks: the size the next forward pads to (the bucket of the largest
        # rank's forward), so every rank brings as many to the shared layers; 0: every rank
        # runs eagerly. None (one process): each forward pads to its own bucket.
        self.floor: int | None = None

    def inputs(
        self, batch: Extended[Any] | Decoding[Any] | Mixed[Any], pools: Pools
    ) -> ForwardInputs | Padded:
        """`batch`'s forward inputs: padded when a captured size holds them."""
        inputs = forward_inputs(batch, pools.table, pools.page_size)
        self.forwards += 1
        if not self.sizes:
            return inputs
        floor = self.floor
        padded = (
            None
            if floor == 0
            else pad(inputs, self.sizes, SGLANG_FILLS, at_least=floor or 0).value_or(None)
        )
        if padded is None:
            self.eager_forwards += 1
            return inputs
        self.padded_forwards += 1
        self.padded_rows += padded.padded_rows
        self.padded_tokens += padded.padded_tokens
        return padded
