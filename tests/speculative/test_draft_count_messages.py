"""verify's draft lengths and sync's accepted counts: what is accepted, and each refusal in full."""

from __future__ import annotations

import copy
import re
from typing import Any, Final

import numpy as np
import pytest
import torch

from batchstate import Decoding, DraftError, Pools, decode, sync, verify
from tests.builders import make_extended, make_test_pools

META: Final = torch.device("meta")
INTEGERS: Final = "draft_lens must be integers"
EXPECTED: Final = "num_accepted: expected int32 or int64 [3] on cpu, got "


def _decoding() -> tuple[Decoding[Any], Pools]:
    extended, pools = make_extended(make_test_pools(), [3, 5, 7])
    return decode(extended, pools).unwrap()


def _refused(message: str) -> pytest.RaisesExc[DraftError]:
    return pytest.raises(DraftError, match=f"^{re.escape(message)}$")


@pytest.mark.parametrize(
    "drafts",
    [
        (2, 0, 1),
        np.array([2, 0, 1], dtype=np.uint8),
        torch.tensor([2, 0, 1], dtype=torch.int32),
    ],
)
def test_integer_drafts_of_any_kind_are_reserved(drafts: Any) -> None:
    decoding, pools = _decoding()
    verifying, reserved = verify(decoding, drafts, pools).unwrap()
    assert verifying.draft_lens.dtype == np.int64
    assert verifying.draft_lens.tolist() == [2, 0, 1]
    assert reserved.slot_tokens[1:4].tolist() == [6, 6, 9]


@pytest.mark.parametrize(
    ("drafts", "message"),
    [
        ([1, 2], "draft_lens: expected [3], got [2]"),
        (np.ones((1, 3), dtype=np.int64), "draft_lens: expected [3], got [1, 3]"),
        ([1, -1, 0], "draft_lens must be >= 0, got [1, -1, 0]"),
        ([1, 0, True], "draft_lens must be integers, got a bool"),
        ([1, 2.0, 0], INTEGERS + ": 'float' object cannot be interpreted as an integer"),
        ([0, 0, 2**70], "draft_lens must fit in int64: int too big to convert"),
        (np.array([1.0, 2.0, 0.0]), "draft_lens must be integers, got float64"),
        (torch.tensor([1.0, 2.0, 0.0]), "draft_lens must be integers, got torch.float32"),
        (torch.tensor([1, 0, 1], dtype=torch.complex64), INTEGERS + ", got torch.complex64"),
        (torch.tensor([True, False, True]), "draft_lens must be integers, got torch.bool"),
        (
            torch.zeros(3, dtype=torch.int64, device=META),
            "draft_lens must be on the CPU, got meta: reading it would sync",
        ),
    ],
)
def test_bad_drafts_are_named(drafts: Any, message: str) -> None:
    decoding, pools = _decoding()
    with _refused(message):
        verify(decoding, drafts, pools)


def test_every_draft_or_none_may_be_accepted() -> None:
    decoding, pools = _decoding()
    verifying, reserved = verify(decoding, [2, 0, 1], pools).unwrap()
    synced, after = sync(verifying, torch.tensor([2, 0, 0]), reserved)
    assert synced.rows.seq_lens.host.tolist() == [6, 6, 8]
    assert after.slot_tokens[1:4].tolist() == [6, 6, 8]


@pytest.mark.parametrize(
    ("accepted", "message"),
    [
        ([0, 0, 0], "num_accepted must be a torch tensor on cpu or a numpy array, got list"),
        (torch.tensor([0, 0]), EXPECTED + "torch.int64 [2] on cpu"),
        (torch.zeros(3, dtype=torch.int16), EXPECTED + "torch.int16 [3] on cpu"),
        (torch.zeros(3, dtype=torch.int64, device=META), EXPECTED + "torch.int64 [3] on meta"),
        (torch.tensor([3, 0, 0]), "row 0 accepted 3 of 2 drafts"),
        (torch.tensor([0, 1, 0]), "row 1 accepted 1 of 0 drafts"),
        (torch.tensor([0, 0, -1]), "row 2 accepted -1 of 1 drafts"),
    ],
)
def test_bad_accepted_counts_are_named(accepted: Any, message: str) -> None:
    decoding, pools = _decoding()
    verifying, reserved = verify(decoding, [2, 0, 1], pools).unwrap()
    with _refused(message):
        sync(verifying, accepted, reserved)


def test_pools_without_the_drafts_are_named() -> None:
    decoding, pools = _decoding()
    before = copy.deepcopy(pools)  # pools are linear: the pools from before are a copy
    verifying, _ = verify(decoding, [5, 5, 5], pools).unwrap()
    with _refused("the pools do not hold this batch's drafts: pass the pools verify returned"):
        sync(verifying, torch.tensor([0, 0, 0]), before)
