"""The fields SGLang's model runner and result processing read off a `ScheduleBatch`,
read from one batchstate record.

SGLang keeps each of them as an attribute its lifecycle methods assign, a device
tensor and its CPU mirror apart, so a method can forget one (a decode batch built
without `req_pool_indices_cpu`), leave one stale (rows of an empty `filter_batch`
that a later merge re-adds) or recompute one from the device (`seq_lens_sum` summed
with a device sync). `BatchFields` stores none of them: it holds the record, and
each field is computed from it on read. A `Mirrored` is a device tensor and its host
mirror as one value, so the CPU fields come from the mirror and the device fields
from the tensor of the same value, and the host fields never read the device.
"""

from __future__ import annotations

import attrs
import torch

from batchstate import Decoding, Filtered, Idle, Mixed
from batchstate.errors import PhaseError

__all__ = ["BatchFields", "Driven"]

Driven = Idle | Filtered | Decoding | Mixed
"""A record a driven batch holds: no rows, rows between forwards, or a forward's."""


@attrs.frozen
class BatchFields:
    """SGLang's batch fields, each computed from `record` on read; nothing to assign.

    Raises `PhaseError` when `record` is not a record a driven batch holds.
    """

    record: Driven

    def __attrs_post_init__(self) -> None:
        record: object = self.record  # for callers without mypy
        if not isinstance(record, Idle | Filtered | Decoding | Mixed):
            raise PhaseError(
                "BatchFields: record must be Idle, Filtered, Decoding or Mixed, "
                f"got {type(record).__name__}"
            )

    @property
    def batch_size(self) -> int:
        """Rows (requests) in the batch."""
        return len(self.record.rows.reqs)

    @property
    def req_pool_indices(self) -> torch.Tensor:
        """int64 `[batch]` on the batch's device: row -> request slot."""
        return self.record.rows.req_pool_indices.device

    @property
    def req_pool_indices_cpu(self) -> torch.Tensor:
        """`req_pool_indices` on the CPU, from the same value's host mirror."""
        return torch.tensor(self.record.rows.req_pool_indices.host, dtype=torch.int64)

    @property
    def seq_lens(self) -> torch.Tensor:
        """int64 `[batch]` on the batch's device: row -> tokens in the KV cache after
        this step."""
        return self.record.rows.seq_lens.device

    @property
    def seq_lens_cpu(self) -> torch.Tensor:
        """`seq_lens` on the CPU, from the same value's host mirror."""
        return torch.tensor(self.record.rows.seq_lens.host, dtype=torch.int64)

    @property
    def seq_lens_sum(self) -> int:
        """The sum of `seq_lens`, kept on the host by every transition: no device read."""
        return self.record.rows.seq_lens_sum

    @property
    def out_cache_loc(self) -> torch.Tensor:
        """int64, one per token the forward computes: the KV location it writes."""
        record = self.record
        if isinstance(record, Decoding | Mixed):
            return record.out_cache_loc.device
        raise PhaseError(f"out_cache_loc: a {type(record).__name__} record runs no forward")

    @property
    def input_ids(self) -> torch.Tensor:
        """int64 `[extend_num_tokens]`: the tokens an extend (or mixed) forward computes.

        A decode's input is each row's last sampled token, which the previous forward
        produced on the device (SGLang's future map under overlap): not batch state.
        """
        record = self.record
        if isinstance(record, Mixed):
            return record.input_ids.device
        raise PhaseError(f"input_ids: a {type(record).__name__} record computes no prompt")

    @property
    def positions(self) -> torch.Tensor:
        """int64 `[extend_num_tokens]`: each computed token's position in its request."""
        record = self.record
        if isinstance(record, Mixed):
            return record.positions.device
        raise PhaseError(f"positions: a {type(record).__name__} record computes no prompt")

    @property
    def prefix_lens(self) -> list[int]:
        """Per row, the tokens in the KV cache before this forward (host)."""
        lens: list[int] = self._mixed("prefix_lens").prefix_lens.tolist()
        return lens

    @property
    def extend_lens(self) -> list[int]:
        """Per row, the tokens this forward computes (host)."""
        lens: list[int] = self._mixed("extend_lens").extend_lens.tolist()
        return lens

    @property
    def extend_num_tokens(self) -> int:
        """The tokens this forward computes (host)."""
        return self._mixed("extend_num_tokens").num_tokens

    def _mixed(self, field: str) -> Mixed:
        record = self.record
        if isinstance(record, Mixed):
            return record
        raise PhaseError(f"{field}: a {type(record).__name__} record computes no prompt")
