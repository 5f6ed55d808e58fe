"""A driven `ScheduleBatch`: SGLang's batch whose mirrored fields are reads of its
batchstate record.

Stock SGLang assigns `req_pool_indices`, `req_pool_indices_cpu`, `seq_lens`,
`seq_lens_cpu`, `seq_lens_sum`, `orig_seq_lens`, `out_cache_loc` and the extend
lengths in each lifecycle method, a device tensor and its CPU mirror apart. A driven
batch has no such attributes: `RecordFields` (mixed into SGLang's class at run time,
before `ScheduleBatch` in the method order) defines each as a property over the
batch's `Binding`, and assigning one raises `DrivenFieldError`. So no method, SGLang's
or a patch of it, can forget a mirror, leave rows of an emptied batch behind, or
recompute a sum from the device: there is nothing to write.

A `Binding` names the record: the forward's (`Mixed`, from `prepare_for_extend`
until the batch is next reshaped), a frozen snapshot (the copy the overlap scheduler
keeps for result processing: records are immutable, so the copy shares it), or the
record the drive holds under the batch's label.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from batchstate import Decoding, Filtered, Idle, Mixed
from batchstate.errors import Error

__all__ = ["FIELDS", "Binding", "DrivenFieldError", "Record", "RecordFields"]

Record = Idle | Filtered | Decoding | Mixed
"""What a driven batch reads its fields from."""


class DrivenFieldError(Error, AttributeError):
    """A driven batch's field was assigned: it is read from the batch's record."""


class Binding:
    """Where a driven batch's record is: `snapshot`, else `forward`, else `records[label]`
    (`empty` when the label holds none). `owner` is the drive the batch belongs to."""

    __slots__ = ("_read", "_read_from", "empty", "forward", "label", "owner", "records", "snapshot")

    def __init__(  # one slot each
        self,
        owner: object,
        records: Mapping[str, Record],
        empty: Record,
        label: str,
        snapshot: Record | None = None,
    ) -> None:
        self.owner = owner
        self.records = records
        self.empty = empty
        self.label = label
        self.forward: Mixed | None = None  # the extend's forward, until the next reshape
        self.snapshot = snapshot  # a copy's: this step's record, frozen
        self._read_from: Record | None = None
        self._read: dict[str, object] = {}

    def record(self) -> Record:
        """The record the batch's fields read now."""
        if self.snapshot is not None:
            return self.snapshot
        if self.forward is not None:
            return self.forward
        return self.records.get(self.label, self.empty)

    def frozen(self) -> Binding:
        """A binding to the record read now, for good: a copy of the batch (the overlap
        scheduler's snapshot for result processing). It shares the fields read from that
        record so far, which the copy would compute again otherwise."""
        record = self.record()
        frozen = Binding(self.owner, self.records, self.empty, self.label, record)
        if record is self._read_from:
            # One record, one dict: either binding only adds its reads; a new record gets a new one.
            frozen._read_from, frozen._read = record, self._read
        return frozen

    def read(self, name: str, compute: Callable[[Record], object]) -> object:
        """Field `name` of the record, computed once per record: records are frozen, and
        SGLang reads every field of a batch at each forward (its overlap snapshot)."""
        record = self.snapshot
        if record is None:
            record = self.forward
            if record is None:
                record = self.records.get(self.label, self.empty)
        if record is not self._read_from:
            self._read_from, self._read = record, {}
        known = self._read
        if name not in known:
            known[name] = compute(record)
        return known[name]


def _rows_field(name: str, read: Callable[[Record], object], doc: str) -> property:
    def get(batch: RecordFields) -> object:
        return batch.batchstate_binding.read(name, read)

    return property(get, _refuse(name), doc=doc)


def _host(values: np.ndarray) -> torch.Tensor:
    # A CPU tensor of its own (the record's host array stays read-only): one copy.
    return torch.from_numpy(values.astype(np.int64, copy=True))


def _out_cache_loc(record: Record) -> torch.Tensor | None:
    return record.out_cache_loc.device if isinstance(record, Decoding | Mixed) else None


def _mixed_list(name: str) -> Callable[[Record], list[int] | None]:
    def read(record: Record) -> list[int] | None:
        if not isinstance(record, Mixed):
            return None
        values: list[int] = getattr(record, name).tolist()
        return values

    return read


def _extend_num_tokens(record: Record) -> int | None:
    return record.num_tokens if isinstance(record, Mixed) else None


def _orig_seq_lens(batch: RecordFields) -> object:
    return batch.batchstate_binding.read("orig_seq_lens", lambda r: _at_least_prompts(batch, r))


def _at_least_prompts(batch: RecordFields, record: Record) -> torch.Tensor:
    # Each row's length, at least its prompt's: only an extend's chunk is shorter than its
    # prompt, so between extends it is the lengths themselves (one cast on the device);
    # an extend's comes from the host mirror and the prompts (one upload). No device read.
    rows = record.rows
    if not isinstance(record, Mixed):
        return rows.seq_lens.device.to(torch.int32)
    lens = rows.seq_lens.host
    reqs: list[object] = getattr(batch, "reqs", [])
    if len(reqs) == len(lens):
        prompts = np.fromiter(
            (len(getattr(r, "origin_input_ids", ())) for r in reqs), np.int64, len(lens)
        )
        lens = np.maximum(lens, prompts)
    return torch.tensor(lens, dtype=torch.int32).to(rows.seq_lens.device.device)


def _refuse(name: str) -> Callable[[RecordFields, object], None]:
    def refuse(batch: RecordFields, value: object) -> None:
        del batch, value
        raise DrivenFieldError(
            f"ScheduleBatch.{name} is read from the batch's batchstate record under drive "
            "mode: nothing assigns it"
        )

    return refuse


class RecordFields:
    """SGLang's mirrored `ScheduleBatch` fields as reads of `self.batchstate_binding.record()`.

    Mixed into SGLang's `ScheduleBatch` at run time (see `driven_batch_class`); each
    field is a property whose setter raises `DrivenFieldError`.
    """

    batchstate_binding: Binding

    req_pool_indices = _rows_field(
        "req_pool_indices",
        lambda r: r.rows.req_pool_indices.device,
        "int64 `[batch]` on the device: row -> request slot.",
    )
    req_pool_indices_cpu = _rows_field(
        "req_pool_indices_cpu",
        lambda r: _host(r.rows.req_pool_indices.host),
        "`req_pool_indices` on the CPU, from the same value's host mirror.",
    )
    seq_lens = _rows_field(
        "seq_lens",
        lambda r: r.rows.seq_lens.device,
        "int64 `[batch]` on the device: row -> tokens in the KV cache after the forward.",
    )
    seq_lens_cpu = _rows_field(
        "seq_lens_cpu",
        lambda r: _host(r.rows.seq_lens.host),
        "`seq_lens` on the CPU, from the same value's host mirror.",
    )
    seq_lens_sum = _rows_field(
        "seq_lens_sum",
        lambda r: r.rows.seq_lens_sum,
        "The sum of `seq_lens`, kept on the host by every transition.",
    )
    orig_seq_lens = property(
        _orig_seq_lens,
        _refuse("orig_seq_lens"),
        doc="int32 `[batch]`: each row's length, at least its prompt's.",
    )
    out_cache_loc = _rows_field(
        "out_cache_loc",
        _out_cache_loc,
        "int64, one per token the forward computes: its KV location (None between forwards).",
    )
    prefix_lens = _rows_field(
        "prefix_lens",
        _mixed_list("prefix_lens"),
        "Per row, the tokens in the KV cache before an extend's forward (None otherwise).",
    )
    extend_lens = _rows_field(
        "extend_lens",
        _mixed_list("extend_lens"),
        "Per row, the tokens an extend's forward computes (None otherwise).",
    )
    extend_num_tokens = _rows_field(
        "extend_num_tokens",
        _extend_num_tokens,
        "The tokens an extend's forward computes (None otherwise).",
    )


FIELDS: tuple[str, ...] = tuple(
    name for name, value in vars(RecordFields).items() if isinstance(value, property)
)
"""The `ScheduleBatch` fields a driven batch reads from its record."""
