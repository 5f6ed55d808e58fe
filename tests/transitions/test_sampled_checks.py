"""Sampled tokens: what `Sampled.of` refuses, how `gather_sampled` finds rows by rid, what reads
return."""

from __future__ import annotations

import re
from typing import Any, Final

import numpy as np
import pytest
import torch

from batchstate import (
    BatchConflict,
    DeviceOnly,
    Filtered,
    PhaseError,
    RecordShapeError,
    Sampled,
    decode,
    gather_sampled,
    join_sampled,
    merge,
    read_sampled,
    split,
)
from tests.builders import make_test_pools
from tests.transitions.test_mixed import _running

META: Final = torch.device("meta")


def _three_rows() -> Filtered[Any]:
    running, _ = _running(make_test_pools(), (3, 4, 5))
    return running


def _exactly(kind: type[Exception], message: str) -> pytest.RaisesExc[Exception]:
    return pytest.raises(kind, match=f"^{re.escape(message)}$")


def test_of_refuses_a_value_that_is_not_a_tensor() -> None:
    with _exactly(RecordShapeError, "Sampled: expected a torch tensor, got list"):
        Sampled.of(_three_rows().rows, [7, 8, 9])  # type: ignore[arg-type]  # on purpose


@pytest.mark.parametrize(
    ("tokens", "got"),
    [
        (torch.zeros(2, dtype=torch.int64), "torch.int64 [2] on cpu"),
        (torch.zeros(3, 1, dtype=torch.int64), "torch.int64 [3, 1] on cpu"),
        (torch.zeros(3, dtype=torch.int32), "torch.int32 [3] on cpu"),
        (torch.zeros(3, dtype=torch.int64, device=META), "torch.int64 [3] on meta"),
    ],
)
def test_of_refuses_tokens_of_another_shape_dtype_or_device(tokens: torch.Tensor, got: str) -> None:
    with _exactly(RecordShapeError, f"Sampled: expected int64 [3] on cpu, got {got}"):
        Sampled.of(_three_rows().rows, tokens)


@pytest.mark.parametrize(
    ("rids", "tokens", "message"),
    [
        (
            np.array([0, 1], dtype=np.int64),
            torch.zeros(3, dtype=torch.int64),
            "Sampled.rids: expected a read-only int64 array [3], got a writable int64 array [2]",
        ),
        (
            [0, 1, 2],
            torch.zeros(3, dtype=torch.int64),
            "Sampled.rids: expected a read-only int64 array [3], got list",
        ),
        (
            None,
            torch.zeros(3, dtype=torch.float32),
            "Sampled.tokens: expected int64 [num_rows], got torch.float32 [3]",
        ),
        (
            None,
            torch.zeros(3, 1, dtype=torch.int64),
            "Sampled.tokens: expected int64 [num_rows], got torch.int64 [3, 1]",
        ),
    ],
    ids=["rids_too_short_and_writable", "rids_not_an_array", "float_tokens", "tokens_2d"],
)
def test_a_hand_built_sampled_needs_one_int64_rid_per_token(
    rids: Any, tokens: torch.Tensor, message: str
) -> None:
    """Built without `of`, the rids and tokens are still checked against each other."""
    rids = _three_rows().rows.rids if rids is None else rids
    with _exactly(RecordShapeError, message):
        Sampled(rids, DeviceOnly(tokens))


def test_length_and_repr_name_the_rows_not_the_tokens() -> None:
    sampled = Sampled.of(_three_rows().rows, torch.tensor([7, 8, 9]))
    assert len(sampled) == 3
    assert repr(sampled) == (
        "Sampled(rids=[0, 1, 2], tokens=DeviceOnly(shape=(3,), dtype=torch.int64, device=cpu))"
    )


def test_follow_takes_only_a_filtered_batch() -> None:
    running, pools = _running(make_test_pools(), (3, 4))
    sampled = Sampled.of(running.rows, torch.tensor([7, 8]))
    decoding, _ = decode(running, pools).unwrap()
    with _exactly(PhaseError, "gather_sampled takes Filtered, got Decoding"):
        gather_sampled(sampled, decoding)  # type: ignore[arg-type]  # on purpose


def test_follow_reorders_by_rid() -> None:
    """Rows merged back in another order: each gets its own token, by rid."""
    running = _three_rows()
    sampled = Sampled.of(running.rows, torch.tensor([7, 8, 9]))
    first, last = split(running, [2]).kept, split(running, [0, 1]).kept
    followed = gather_sampled(sampled, merge(first, last))
    assert followed.rids.tolist() == [2, 0, 1]
    assert read_sampled(followed).tolist() == [9, 7, 8]


@pytest.mark.parametrize("rid", [-1, 3, 10])
def test_follow_names_a_rid_below_between_or_above_the_sampled_ones(rid: int) -> None:
    pools = make_test_pools()
    low, pools = _running(pools, (3,), first_rid=0)
    high, pools = _running(pools, (4,), first_rid=5)
    stranger, _ = _running(pools, (5,), first_rid=rid)
    sampled = Sampled.of(merge(low, high).rows, torch.tensor([7, 8]))
    with _exactly(BatchConflict, f"no sampled token for requests [{rid}]"):
        gather_sampled(sampled, merge(merge(low, stranger), high))


def test_follow_from_no_tokens_names_every_row() -> None:
    running = _three_rows()
    nothing = Sampled.of(split(running, []).kept.rows, torch.zeros(0, dtype=torch.int64))
    with _exactly(BatchConflict, "no sampled token for requests [0, 1, 2]"):
        gather_sampled(nothing, running)


def test_read_sampled_returns_a_read_only_copy() -> None:
    """On the CPU the host array must not be the tokens' own memory: the next forward
    writes there."""
    tokens = torch.tensor([7, 8, 9])
    host = read_sampled(Sampled.of(_three_rows().rows, tokens))
    assert host.dtype == np.int64 and host.tolist() == [7, 8, 9]
    assert not host.flags.writeable
    assert not np.shares_memory(host, tokens.numpy())


def test_follow_from_one_token_names_a_larger_rid() -> None:
    pools = make_test_pools()
    one, pools = _running(pools, (3,), first_rid=0)
    other, _ = _running(pools, (4,), first_rid=5)
    with _exactly(BatchConflict, "no sampled token for requests [5]"):
        gather_sampled(Sampled.of(one.rows, torch.tensor([7])), other)


def test_a_hand_built_sampled_needs_distinct_rids() -> None:
    """`gather_sampled` and `join_sampled` find a token by its rid, so a rid may hold one token."""
    rids = np.array([4, 2, 4, 2, 9], dtype=np.int64)
    rids.setflags(write=False)
    with _exactly(BatchConflict, "Sampled.rids: requests [2, 4] appear more than once"):
        Sampled(rids, DeviceOnly(torch.zeros(5, dtype=torch.int64)))


def test_join_sampled_names_the_requests_both_sides_hold() -> None:
    running = _three_rows()
    tokens = torch.tensor([7, 8, 9])
    whole = Sampled.of(running.rows, tokens)
    kept, _ = split(running, [1])
    one = gather_sampled(whole, kept)
    with _exactly(
        BatchConflict, f"requests [{int(kept.rows.rids[0])}] have sampled tokens in both"
    ):
        join_sampled(whole, one)
    with _exactly(
        BatchConflict, f"requests [{int(kept.rows.rids[0])}] have sampled tokens in both"
    ):
        join_sampled(one, whole)
