"""Device-resident sampled tokens: the next step's inputs, before the host has seen them.

An overlap scheduler builds step N+1 while step N still runs: N+1's input
tokens are N's sampled tokens, which exist only on the device. `Sampled`
holds them with the host-known request ids of their rows, so they can follow
rows through a split or a merge (`gather_sampled`, a device gather by a host index)
and feed `decode_sampled` or `mix` without a read. The host learns them
later through `read_sampled`, one named read that an audit permits.
"""

from __future__ import annotations

from typing import Final, final

import attrs
import numpy as np
import torch

from batchstate.audit import permitted_reads
from batchstate.base.errors import BatchConflict, PhaseError, RecordShapeError
from batchstate.base.expect import expect_instance
from batchstate.base.intersection import overlap
from batchstate.base.mirrored import DeviceOnly, HostArray, describe, frozen, same, upload
from batchstate.base.read_only import read_only_copies
from batchstate.base.setters import new_record, put_field
from batchstate.columns.columns import C
from batchstate.records.phases import Filtered
from batchstate.records.rows import Rows, check_host

__all__ = ["Sampled", "gather_sampled", "join_sampled", "read_sampled"]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class Sampled:
    """One sampled token per row of a forward, on the device only.

    Build it with `Sampled.of(forward.rows, tokens)` right after the
    forward's sampler; nothing here reads `tokens`.
    """

    rids: HostArray  # read-only int64 [num_rows], row -> request id
    tokens: DeviceOnly  # int64 [num_rows], row -> its sampled token

    def __attrs_post_init__(self) -> None:
        # One rid per token: `gather_sampled` gathers by position in `rids`.
        tokens = self.tokens.device
        if tokens.dim() != 1 or tokens.dtype != torch.int64:
            raise RecordShapeError(
                f"Sampled.tokens: expected int64 [num_rows], got {tokens.dtype}"
                f" {list(tokens.shape)}"
            )
        check_host("Sampled.rids", self.rids, np.int64, tokens.shape[0])
        # `gather_sampled` and `join_sampled` find a token by its rid: one rid, one token.
        ordered = np.sort(self.rids)
        if (ordered[1:] == ordered[:-1]).any():
            twice = sorted({int(rid) for rid in ordered[1:][ordered[1:] == ordered[:-1]]})
            raise BatchConflict(f"Sampled.rids: requests {twice} appear more than once")

    @classmethod
    def of(cls, rows: Rows[C], tokens: torch.Tensor) -> Sampled:
        """The tokens a sampler produced for `rows` (int64 `[num_rows]` on the rows' device).

        Raises:
            RecordShapeError: `tokens` has another shape, dtype or device.
        """
        if not isinstance(tokens, torch.Tensor):
            raise RecordShapeError(f"Sampled: expected a torch tensor, got {type(tokens).__name__}")
        if (
            tokens.shape != (len(rows),)
            or tokens.dtype != torch.int64
            or tokens.device != rows.device
        ):
            raise RecordShapeError(
                f"Sampled: expected int64 [{len(rows)}] on {rows.device}, got {tokens.dtype}"
                f" {list(tokens.shape)} on {tokens.device}"
            )
        return cls.trusted(rows.rids, tokens)  # a batch's rids: checked, distinct

    def __len__(self) -> int:
        return int(self.rids.shape[0])

    @classmethod
    def trusted(cls, rids: HostArray, tokens: torch.Tensor) -> Sampled:
        # NOTE: skips the checks (~3 µs): only for tokens checked against their rows or a
        # checked `Sampled`'s, gathered or joined, with their distinct rids. Unrolled init.
        sampled = new_record(cls)
        put_field(sampled, "rids", rids)
        put_field(sampled, "tokens", DeviceOnly(tokens))
        return sampled

    def __repr__(self) -> str:
        tokens = describe("DeviceOnly", self.tokens.device)
        return f"Sampled(rids={self.rids.tolist()}, tokens={tokens})"


def gather_sampled(sampled: Sampled, batch: Filtered[C]) -> Sampled:
    """`sampled`'s tokens for `batch`'s rows, in `batch`'s order: a device gather, no read.

    The index is computed on the host from request ids; rows already in
    order cost nothing.

    Raises:
        PhaseError: `batch` is not `Filtered`.
        BatchConflict: a row of `batch` has no token in `sampled`, or the
            tokens live on another device than `batch`.
    """
    expect_instance(sampled, Sampled, "gather_sampled: sampled")
    if not isinstance(batch, Filtered):
        raise PhaseError(f"gather_sampled takes Filtered, got {type(batch).__name__}")
    tokens = sampled.tokens.device
    if tokens.device != batch.rows.device:  # before the in-order shortcut, which keeps them
        raise BatchConflict(f"sampled tokens on {tokens.device}, the batch on {batch.rows.device}")
    wanted = batch.rows.rids
    if same(sampled.rids, wanted):
        return sampled
    index = _positions(sampled.rids, wanted)
    (device_index,) = upload((index,), batch.rows.device)
    return Sampled.trusted(wanted, tokens.index_select(0, device_index))


def join_sampled(first: Sampled, second: Sampled) -> Sampled:
    """The tokens of two forwards' rows together, `first`'s then `second`'s: one device `cat`.

    For batches that are merged before their next step (the running rows
    and the rows a prefill step just admitted); `gather_sampled` then orders them
    as the merged batch's rows. Reads nothing.

    Raises:
        BatchConflict: a request has a token in both, or they live on
            different devices.
    """
    expect_instance(first, Sampled, "join_sampled: first")
    expect_instance(second, Sampled, "join_sampled: second")
    if not len(first):
        return second
    if not len(second):
        return first
    left, right = first.tokens.device, second.tokens.device
    if left.device != right.device:
        raise BatchConflict(f"sampled tokens on {left.device} and on {right.device}")
    # Each side's rids are distinct (the rows' they came from); the sides must not share one.
    small, large = sorted((first.rids, second.rids), key=len)
    both = overlap(small, large)  # one row joining, the usual case: one compare
    if both.shape[0]:
        raise BatchConflict(f"requests {sorted(both.tolist())} have sampled tokens in both")
    rids = frozen(np.concatenate((first.rids, second.rids)))
    return Sampled.trusted(rids, torch.cat((left, right)))


def read_sampled(sampled: Sampled) -> HostArray:
    """Copy the tokens to the host: the one named read of a step that keeps tokens on the device.

    It waits for the forward that sampled them. It runs inside
    `permitted_reads`, so an audit counts it and does not forbid it.
    Returns a read-only int64 array `[num_rows]`, in `sampled.rids` order.
    """
    expect_instance(sampled, Sampled, "read_sampled: sampled")
    with permitted_reads("sampled tokens: finish checks"):
        host = sampled.tokens.device.to("cpu").numpy()  # NOTE: the one read; it waits
    return frozen(host.astype(np.int64, copy=True))


def _positions(have: HostArray, wanted: HostArray) -> HostArray:
    kept = _kept_in_order(have, wanted)
    return kept if kept is not None else _searched(have, wanted)


def _kept_in_order(have: HostArray, wanted: HostArray) -> HostArray | None:
    # Where each wanted rid sits in `have` when `wanted` is `have` with a few rows left
    # out, in order (what a split keeps): one compare per row left out, O(rows) each.
    # None when it is not.
    skip = have.shape[0] - wanted.shape[0]
    if not 0 <= skip <= _MAX_LEFT_OUT:
        return None
    starts: list[int] = []  # wanted positions from which one more row of `have` is skipped
    start = 0
    while True:
        shift = len(starts)
        rest = have[start + shift : start + shift + wanted.shape[0] - start]
        differ = np.flatnonzero(rest != wanted[start:])
        if not differ.shape[0]:
            break
        if shift == skip:
            return None
        start += int(differ[0])
        starts.append(start)
    positions = np.arange(wanted.shape[0], dtype=np.int64)
    return positions + np.searchsorted(np.array(starts, dtype=np.int64), positions, side="right")


def _searched(have: HostArray, wanted: HostArray) -> HostArray:
    # Where each wanted rid sits in `have`, in any order: a sorted search on the host.
    order = np.argsort(have, kind="stable")
    at = np.searchsorted(have, wanted, sorter=order).clip(0, max(have.shape[0] - 1, 0))
    index = order[at] if have.shape[0] else np.zeros(wanted.shape[0], dtype=np.int64)
    missing = (have[index] != wanted) if have.shape[0] else np.ones(wanted.shape[0], bool)
    if missing.any():
        raise BatchConflict(f"no sampled token for requests {wanted[missing].tolist()}")
    return index.astype(np.int64)


_MAX_LEFT_OUT: Final = 8  # rows a split may leave out for the in-order search
