"""Speculative decoding: drafts reserved up front by `verify`, one device read in `sync`."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure, Success

from batchstate import (
    TRANSITIONS,
    ContextTooLong,
    Decoding,
    DraftError,
    Filtered,
    NotOwned,
    OutOfKVTokens,
    PhaseError,
    Pools,
    StalePools,
    Verifying,
    check_batch,
    check_pools,
    decode,
    sync,
    verify,
)
from batchstate.audit import device_reads
from batchstate.base.mirrored import HostArray, host_int64
from tests.builders import make_extended, make_test_pools
from tests.strategies import assert_unchanged, snapshot

META = torch.device("meta")


def _make_decoding(
    page_size: int,
    lengths: Sequence[int] = (3, 16, 9),
    max_context_len: int = 64,
    num_kv_tokens: int = 512,
) -> tuple[Decoding, Pools]:
    pools = make_test_pools(page_size, max_context_len=max_context_len, num_kv_tokens=num_kv_tokens)
    extended, pools = make_extended(pools, lengths)
    return decode(extended, pools).unwrap()


def _pages_for(num_tokens: HostArray, page_size: int) -> int:
    return int(((num_tokens + page_size - 1) // page_size).sum())


@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_reserves_every_draft_and_lays_out_the_forward(page_size: int) -> None:
    """Each slot owns its drafts' KV, and out_cache_loc lists the decode token then the drafts."""
    decoding, pools = _make_decoding(page_size)
    committed = decoding.rows.seq_lens.host.copy()
    drafts = [2, 0, 5]
    verifying, after = verify(decoding, drafts, pools).unwrap()
    slots = decoding.rows.req_pool_indices.host
    assert after.slot_tokens[slots].tolist() == (committed + host_int64(drafts)).tolist()
    assert verifying.seq_lens.device.tolist() == (committed + host_int64(drafts)).tolist()
    expected = [
        after.table.host[slot, position].item()
        for slot, c, d in zip(slots.tolist(), committed.tolist(), drafts, strict=True)
        for position in range(c - 1, c + d)
    ]
    assert verifying.out_cache_loc.device.tolist() == expected
    assert decoding.out_cache_loc.device.tolist() == [expected[0], expected[3], expected[4]]
    check_pools(after, compare_device=True)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "accepted",
    [
        [0, 0, 0],  # every draft rejected: the pools own what they did before verify
        [2, 0, 5],  # every draft accepted: nothing to free
        [1, 0, 3],  # a partial tail per row
    ],
)
def test_sync_keeps_accepted_and_frees_the_rest(page_size: int, accepted: list[int]) -> None:
    """After sync each row is `c + accepted` long, and only whole unused pages go back."""
    decoding, pools = _make_decoding(page_size)
    committed = decoding.rows.seq_lens.host.copy()
    verifying, reserved = verify(decoding, [2, 0, 5], pools).unwrap()
    synced, after = sync(verifying, torch.tensor(accepted), reserved)
    assert isinstance(synced, Filtered)
    new_lens = committed + host_int64(accepted)
    assert synced.rows.seq_lens.host.tolist() == new_lens.tolist()
    assert synced.rows.seq_lens_sum == int(new_lens.sum())
    check_batch(synced, compare_device=True)
    check_pools(after, [synced], compare_device=True)
    used_pages = _pages_for(new_lens, page_size) - _pages_for(committed, page_size)
    assert after.free_pages.shape[0] == pools.free_pages.shape[0] - used_pages
    if accepted == [0, 0, 0]:
        assert np.array_equal(after.slot_tokens, pools.slot_tokens)
        assert sorted(after.free_pages.tolist()) == sorted(pools.free_pages.tolist())


@pytest.mark.parametrize("page_size", [1, 4, 16])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_verify_then_sync_loses_nothing(page_size: int, data: st.DataObject) -> None:
    """For any lengths, drafts and accepted counts, free + owned = capacity and lengths add up."""
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    decoding, pools = _make_decoding(page_size, lengths)
    drafts = data.draw(st.lists(st.integers(0, 7), min_size=len(lengths), max_size=len(lengths)))
    accepted = [data.draw(st.integers(0, draft)) for draft in drafts]
    verifying, reserved = verify(decoding, drafts, pools).unwrap()
    check_pools(reserved)
    synced, after = sync(verifying, torch.tensor(accepted), reserved)
    assert synced.rows.seq_lens.host.tolist() == [
        length + 1 + count for length, count in zip(lengths, accepted, strict=True)
    ]
    check_batch(synced, compare_device=True)
    check_pools(after, [synced], compare_device=True)
    step, after = decode(synced, after).unwrap()  # the loop goes on
    check_pools(after, [step], compare_device=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_failures_change_nothing(page_size: int) -> None:
    """Too long a context or too little KV is a Failure, and the pools given are unchanged."""
    decoding, pools = _make_decoding(page_size, max_context_len=32, num_kv_tokens=80)
    # Row 1: 17 + 15 = 32 fits, 16 would not. On a copy: pools are linear, and a
    # successful verify would make `pools` stale.
    fits = verify(decoding, [0, 15, 0], copy.deepcopy(pools))
    assert isinstance(fits, Success)
    before = snapshot(pools)
    too_long = verify(decoding, [0, 16, 0], pools)
    assert too_long == Failure(ContextTooLong(1, 33, 32))
    assert_unchanged(before, pools)
    out_of_kv = verify(decoding, [22, 15, 22], pools)
    assert isinstance(out_of_kv, Failure)
    assert isinstance(out_of_kv.failure(), OutOfKVTokens)
    assert_unchanged(before, pools)


@pytest.mark.parametrize(
    "drafts",
    [
        [1, 2],  # one draft length short
        [1, -1, 0],  # a negative draft
        [1, True, 0],  # a bool is not a count
        torch.tensor([1.0, 2.0, 0.0]),  # floats
        torch.zeros(3, dtype=torch.int64, device=META),  # on a device: reading it would sync
    ],
)
def test_verify_rejects_bad_draft_lens(drafts: list[int] | torch.Tensor) -> None:
    """Draft lengths that are not one non-negative host integer per row raise DraftError."""
    decoding, pools = _make_decoding(1)
    with pytest.raises(DraftError):
        verify(decoding, drafts, pools)


def test_verify_takes_only_decoding() -> None:
    """A batch that has no decode token to verify raises PhaseError."""
    decoding, pools = _make_decoding(1)
    verifying, reserved = verify(decoding, [1, 1, 1], pools).unwrap()
    synced, pools = sync(verifying, torch.tensor([0, 0, 0]), reserved)
    with pytest.raises(PhaseError, match="verify takes Decoding, got Filtered"):
        verify(synced, [0, 0, 0], pools)  # type: ignore[arg-type]  # the check for callers without mypy


@pytest.mark.parametrize(
    ("accepted", "match"),
    [
        (torch.tensor([3, 0, 0]), "row 0 accepted 3 of 2 drafts"),  # more than drafted
        (torch.tensor([0, 0, -1]), "row 2 accepted -1 of 5 drafts"),  # negative
        (torch.tensor([0, 0]), "expected int32 or int64 \\[3\\]"),  # a row short
        (torch.zeros(3, dtype=torch.int16), "expected int32 or int64"),  # the wrong dtype
        (torch.zeros(3, dtype=torch.int64, device=META), "on cpu, got"),  # another device
    ],
)
def test_sync_rejects_bad_accepted_counts(accepted: torch.Tensor, match: str) -> None:
    """Counts no verify kernel could produce raise DraftError; the pools stay as they were."""
    decoding, pools = _make_decoding(16)
    verifying, reserved = verify(decoding, [2, 0, 5], pools).unwrap()
    before = snapshot(reserved)
    with pytest.raises(DraftError, match=match):
        sync(verifying, accepted, reserved)
    assert_unchanged(before, reserved)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("lengths", "drafts"),
    [((3, 2), [5, 5]), ((3, 16, 9), [2, 0, 1]), ((3, 16, 9), [0, 0, 1])],
    ids=["fewer_tokens_than_drafts", "more_tokens_than_drafts", "one_row_with_a_draft"],
)
def test_sync_rejects_pools_from_before_verify(
    page_size: int, lengths: tuple[int, ...], drafts: list[int]
) -> None:
    """Pools not threaded through verify are stale, whatever their slots hold; no change."""
    decoding, pools = _make_decoding(page_size, lengths)
    verifying, _ = verify(decoding, drafts, pools).unwrap()
    accepted = torch.zeros(len(lengths), dtype=torch.int64)
    before = snapshot((verifying, accepted, pools))
    with pytest.raises(StalePools, match="pass the newest pools"):
        sync(verifying, accepted, pools)
    assert_unchanged(before, (verifying, accepted, pools), "a refused sync")


def test_sync_refuses_stale_pools_before_it_reads_the_device() -> None:
    """Pools from before verify are refused from host values alone: on meta, no read is made."""
    decoding, pools = _meta_decoding(16)
    verifying, _ = verify(decoding, [2, 0, 1], pools).unwrap()
    accepted = torch.zeros(3, dtype=torch.int64, device=META)
    with device_reads(forbid=True) as log, pytest.raises(StalePools, match="stale"):
        sync(verifying, accepted, pools)
    assert log.count == 0


def test_sync_refuses_the_pools_from_before_a_verify_with_no_drafts() -> None:
    """With no drafts verify reserves nothing, but its pools are the newest: linear still."""
    decoding, pools = _make_decoding(16)
    verifying, reserved = verify(decoding, [0, 0, 0], pools).unwrap()
    accepted = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(StalePools):
        sync(verifying, accepted, pools)
    synced, after = sync(verifying, accepted, reserved)
    assert synced.rows.seq_lens.host.tolist() == [4, 17, 10]
    assert after.slot_tokens.tolist() == pools.slot_tokens.tolist()


def test_verifying_has_no_host_lengths() -> None:
    """The window's lengths are device-only: no host seq_lens, no rows, no seq_lens_sum."""
    decoding, pools = _make_decoding(1)
    verifying, _ = verify(decoding, [1, 1, 1], pools).unwrap()
    assert not hasattr(verifying, "rows")
    assert not hasattr(verifying.seq_lens, "host")
    assert not hasattr(verifying, "seq_lens_sum")
    assert repr(verifying) == "Verifying(num_reqs=3, num_drafts=3, device=cpu)"


@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_on_meta_reads_nothing_and_sync_reads_once(page_size: int) -> None:
    """On meta under a forbidding audit, verify completes; sync makes one read, permitted."""
    decoding_meta, pools_meta = _meta_decoding(page_size)
    with device_reads(forbid=True) as log:
        verifying, reserved = verify(decoding_meta, [2, 0, 5], pools_meta).unwrap()
        accepted = torch.zeros(3, dtype=torch.int64, device=META)
        with pytest.raises(NotImplementedError, match="meta"):  # no data: the read reached torch
            sync(verifying, accepted, reserved)
    (read,) = log.report().reads
    assert read.op == "aten._to_copy.default"
    assert read.device == "meta"
    assert read.location.startswith("batchstate/speculative/verification.py:")
    assert read.location.endswith(" in sync")
    assert read.permitted == "speculative sync: accepted draft counts"
    assert log.report().forbidden == ()


def _meta_decoding(page_size: int) -> tuple[Decoding, Pools]:
    pools = make_test_pools(page_size, device=META)
    extended, pools = make_extended(pools, (3, 16, 9), device=META)
    return decode(extended, pools).unwrap()


def test_speculative_rows_of_the_table() -> None:
    """The table's verify and sync rows name the phases the functions really take and return."""
    decoding, pools = _make_decoding(16)
    verifying, reserved = verify(decoding, [1, 2, 3], pools).unwrap()
    synced, _ = sync(verifying, torch.tensor([1, 1, 1]), reserved)
    rows = {row.function: row for row in TRANSITIONS if row.function in (verify, sync)}
    assert (rows[verify].source, rows[verify].target) == (type(decoding), Verifying)
    assert (rows[sync].source, rows[sync].target) == (Verifying, type(synced))
    assert type(verifying) is Verifying
    assert rows[verify].failures == (OutOfKVTokens, ContextTooLong)


@pytest.mark.parametrize("page_size", [1, 16])
def test_shrink_frees_only_whole_pages_past_the_new_length(page_size: int) -> None:
    """Pools.shrink keeps a page with any kept token, frees the rest, and checks its inputs."""
    decoding, pools = _make_decoding(page_size, (32,))
    slots = decoding.rows.req_pool_indices.host  # one slot owning 33 tokens
    for bad in (0, 34):
        with pytest.raises(ValueError, match="cannot shrink"):
            pools.shrink(slots, host_int64([bad]))
    assert pools.shrink(host_int64([5]), host_int64([1])) == Failure(NotOwned((5,)))
    same = pools.shrink(host_int64([]), host_int64([])).unwrap()
    assert np.array_equal(same.slot_tokens, pools.slot_tokens)
    shrunk = same.shrink(slots, host_int64([17])).unwrap()
    assert shrunk.slot_tokens[slots].tolist() == [17]
    freed = (33 - 17) if page_size == 1 else 1  # pages 0-2 held 33 tokens; 17 need pages 0-1
    assert shrunk.free_pages.shape[0] == pools.free_pages.shape[0] + freed
    check_pools(shrunk)
