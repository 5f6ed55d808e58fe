"""Requests and the per-row columns every phase shares."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Final, Self, final

import attrs
import torch

from batchstate._errors import RecordShapeError
from batchstate._mirrored import DeviceOnly, Mirrored, host_int64

__all__ = ["Req", "Rows"]

# Up to this many rows, picking them one by one beats `operator.itemgetter`.
_MAX_ONE_BY_ONE: Final = 8


@final
@attrs.frozen
class Req:
    """A request, as the scheduler sees it: an id and the tokens so far.

    Args:
        rid: unique among live requests; batches check it on merge.
        input_ids: the prompt, plus any tokens generated before a retraction.
    """

    rid: int
    input_ids: tuple[int, ...]


@final
@attrs.frozen(eq=False)
class Rows:
    """The per-row columns of a batch: one row per request, in order.

    Every column has `num_reqs` rows on each of its sides; filter and merge
    act on all of them through `take` and `cat`, so a new column is added
    here and nowhere else.
    """

    device: torch.device
    reqs: tuple[Req, ...]
    rids: torch.Tensor  # host int64 [num_reqs], row -> reqs[row].rid
    req_pool_indices: Mirrored  # int64 [num_reqs], row -> request slot
    seq_lens: Mirrored  # int64 [num_reqs], row -> KV tokens after this step
    orig_seq_lens: DeviceOnly  # int32 [num_reqs], equals seq_lens (before truncation tricks)
    seq_lens_sum: int  # host only: equals seq_lens.host.sum()
    max_seq_len: int  # host only: equals seq_lens.host.max(), 0 when empty

    def __attrs_post_init__(self) -> None:
        check_columns(self)

    @classmethod
    def empty(cls, device: torch.device) -> Self:
        """Zero rows on every column, device and host."""
        return cls(
            device,
            (),
            torch.empty(0, dtype=torch.int64),
            Mirrored.empty(torch.int64, device),
            Mirrored.empty(torch.int64, device),
            DeviceOnly.empty(torch.int32, device),
            0,
            0,
        )

    @classmethod
    def from_host(
        cls,
        device: torch.device,
        reqs: Sequence[Req],
        slots: Sequence[int],
        seq_lens: Sequence[int],
    ) -> Self:
        """Build every column and its mirror from host lists, copying each once."""
        seq_lens_host = host_int64(seq_lens)
        seq_lens_pair = Mirrored.from_host(seq_lens_host, device)
        return cls(
            device,
            tuple(reqs),
            host_int64([req.rid for req in reqs]),
            Mirrored.from_ints(slots, torch.int64, device),
            seq_lens_pair,
            DeviceOnly(seq_lens_pair.device.to(torch.int32)),
            sum(seq_lens),
            max(seq_lens, default=0),
        )

    @classmethod
    def _trusted(  # noqa: PLR0917  # the attrs __init__ it stands in for is positional too
        cls,
        device: torch.device,
        reqs: tuple[Req, ...],
        rids: torch.Tensor,
        req_pool_indices: Mirrored,
        seq_lens: Mirrored,
        orig_seq_lens: DeviceOnly,
        seq_lens_sum: int,
        max_seq_len: int,
    ) -> Rows:
        # NOTE: skips `__attrs_post_init__`'s checks (~5 µs): only for columns
        # that a transition derived from checked ones, row for row. The table
        # tests check every such result.
        rows = object.__new__(cls)
        put = object.__setattr__  # what attrs' frozen __init__ does, unrolled
        put(rows, "device", device)
        put(rows, "reqs", reqs)
        put(rows, "rids", rids)
        put(rows, "req_pool_indices", req_pool_indices)
        put(rows, "seq_lens", seq_lens)
        put(rows, "orig_seq_lens", orig_seq_lens)
        put(rows, "seq_lens_sum", seq_lens_sum)
        put(rows, "max_seq_len", max_seq_len)
        return rows

    def __len__(self) -> int:
        return len(self.reqs)

    def take(self, index: Mirrored) -> Rows:
        """The rows at `index` (strictly increasing positions), on both sides."""
        if len(index) == len(self.reqs):
            return self  # strictly increasing and in range: every row, in order
        seq_lens = self.seq_lens.take(index)
        lengths = seq_lens.host
        return Rows._trusted(
            self.device,
            _take_tuple(self.reqs, index.host),
            self.rids.index_select(0, index.host),
            self.req_pool_indices.take(index),
            seq_lens,
            self.orig_seq_lens.take(index),
            int(lengths.sum()),
            int(lengths.max()) if len(index) else 0,
        )

    def without(self, kept: Mirrored, dropped: Sequence[int], dropped_lens: Sequence[int]) -> Rows:
        """The rows at `kept`, given the few rows it drops and their lengths (the host knows them).

        The same as `take(kept)`, with the host values derived from the
        dropped rows instead of summed over the kept ones, and `reqs` copied
        as slices between the dropped positions.
        """
        reqs: tuple[Req, ...] = ()
        start = 0
        for stop in dropped:
            reqs += self.reqs[start:stop]
            start = stop + 1
        reqs += self.reqs[start:]
        seq_lens = self.seq_lens.take(kept)
        longest = self.max_seq_len
        if max(dropped_lens, default=0) >= longest:
            longest = int(seq_lens.host.max()) if reqs else 0  # the longest row may have left
        return Rows._trusted(
            self.device,
            reqs,
            self.rids.index_select(0, kept.host),
            self.req_pool_indices.take(kept),
            seq_lens,
            self.orig_seq_lens.take(kept),
            self.seq_lens_sum - sum(dropped_lens),
            longest,
        )

    def cat(self, other: Rows) -> Rows:
        """These rows followed by `other`'s."""
        return Rows._trusted(
            self.device,
            self.reqs + other.reqs,
            torch.cat((self.rids, other.rids)),
            self.req_pool_indices.cat(other.req_pool_indices),
            self.seq_lens.cat(other.seq_lens),
            self.orig_seq_lens.cat(other.orig_seq_lens),
            self.seq_lens_sum + other.seq_lens_sum,
            max(self.max_seq_len, other.max_seq_len),
        )

    def grow(self, num_tokens: int) -> Rows:
        """Every row `num_tokens` longer."""
        return Rows._trusted(
            self.device,
            self.reqs,
            self.rids,
            self.req_pool_indices,
            self.seq_lens.add(num_tokens),
            self.orig_seq_lens.add(num_tokens),
            self.seq_lens_sum + num_tokens * len(self.reqs),
            self.max_seq_len + num_tokens if self.reqs else 0,
        )

    def __repr__(self) -> str:
        return (
            f"Rows(num_reqs={len(self.reqs)}, seq_lens_sum={self.seq_lens_sum},"
            f" max_seq_len={self.max_seq_len}, device={self.device})"
        )


def _take_tuple(items: tuple[Req, ...], index: torch.Tensor) -> tuple[Req, ...]:
    # `index` is strictly increasing; read it to the host once.
    positions = index.tolist()
    if len(positions) <= _MAX_ONE_BY_ONE:
        return tuple(items[position] for position in positions)
    return tuple(operator.itemgetter(*positions)(items))


def check_columns(rows: Rows) -> None:
    """Raise `RecordShapeError` unless every column has `len(reqs)` rows, its dtype and device."""
    num_reqs = len(rows.reqs)
    columns: tuple[tuple[str, torch.Tensor, torch.dtype, torch.device], ...] = (
        ("rids", rows.rids, torch.int64, _CPU),
        ("req_pool_indices.host", rows.req_pool_indices.host, torch.int64, _CPU),
        ("req_pool_indices.device", rows.req_pool_indices.device, torch.int64, rows.device),
        ("seq_lens.host", rows.seq_lens.host, torch.int64, _CPU),
        ("seq_lens.device", rows.seq_lens.device, torch.int64, rows.device),
        ("orig_seq_lens", rows.orig_seq_lens.device, torch.int32, rows.device),
    )
    for name, tensor, dtype, device in columns:
        if tensor.shape != (num_reqs,) or tensor.dtype != dtype or tensor.device != device:
            raise RecordShapeError(
                f"Rows.{name}: expected {dtype} [{num_reqs}] on {device},"
                f" got {tensor.dtype} {list(tensor.shape)} on {tensor.device}"
            )


_CPU: Final = torch.device("cpu")
