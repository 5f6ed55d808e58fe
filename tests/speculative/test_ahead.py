"""Speculative decoding under overlap: verify_ahead, read_verified, exact_window."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from returns.result import Failure

from batchstate import (
    ContextTooLong,
    Decoding,
    DraftError,
    OutOfKVTokens,
    Pools,
    Req,
    UpperBound,
    Verifying,
    check_pools,
    decode,
    exact_window,
    extend,
    find_leaks,
    forward_inputs,
    idle,
    make_pools,
    read_verified,
    sync,
    verify,
    verify_ahead,
)
from batchstate.audit import device_reads
from batchstate.backends import fa3_ahead_args, fa3_args
from batchstate.base.mirrored import HostArray

CPU = torch.device("cpu")
META = torch.device("meta")


def _decoding(
    device: torch.device, page_size: int, lengths: tuple[int, ...] = (3, 16, 9)
) -> tuple[Decoding, Pools]:
    pools = make_pools(8, 128, 2048, device, page_size)
    reqs = [Req(rid, tuple(range(1, length + 1))) for rid, length in enumerate(lengths)]
    extended, pools = extend(idle(device), reqs, pools).unwrap()
    return decode(extended, pools).unwrap()


def _window(
    page_size: int, drafts: list[int], lengths: tuple[int, ...] = (3, 16, 9)
) -> tuple[Verifying, Pools]:
    decoding, pools = _decoding(CPU, page_size, lengths)
    return verify(decoding, drafts, pools).unwrap()


def _accepts(step: int, drafts: HostArray) -> HostArray:
    # A scripted verifier: each row accepts a count that changes with the step.
    counts: HostArray = (np.arange(drafts.shape[0]) + step) % (drafts + 1)
    return counts


@pytest.mark.parametrize("page_size", [1, 16])
def test_overlap_matches_the_synced_path_step_for_step(page_size: int) -> None:
    """Twelve steps opened ahead from device counts give each row the lengths, positions and
    KV cells the synced path gives, and settle to windows the pools hold with nothing leaked."""
    ahead_window, ahead_pools = _window(page_size, [2, 0, 3])
    synced_window, synced_pools = _window(page_size, [2, 0, 3])
    for step in range(12):
        drafts_next = np.array([(step + row) % 4 for row in range(3)])
        counts = _accepts(step, ahead_window.draft_lens)
        device_counts = torch.tensor(counts, dtype=torch.int32)  # SGLang's accept_length dtype
        opened, ahead_pools = verify_ahead(
            ahead_window, device_counts, drafts_next, ahead_pools
        ).unwrap()
        # The verify forward N+1 would run here; its tokens: the accepted drafts and one more.
        tokens = torch.arange(3 * 4, dtype=torch.int64).reshape(3, 4) + 100 * step
        verified = read_verified(device_counts, tokens)
        assert verified.counts.tolist() == counts.tolist()
        assert verified.accepted_tokens(0) == tokens[0, : counts[0] + 1].tolist()
        bound = opened.seq_lens.bound.copy()
        ahead_window, ahead_pools = exact_window(opened, verified.counts, ahead_pools)
        # The synced path: read the counts, decode the next token, open the window.
        running, synced_pools = sync(synced_window, torch.tensor(counts), synced_pools)
        stepped, synced_pools = decode(running, synced_pools).unwrap()
        synced_window, synced_pools = verify(stepped, drafts_next, synced_pools).unwrap()
        slots = ahead_window.req_pool_indices.host
        held = ahead_pools.slot_tokens[slots]
        assert held.tolist() == synced_pools.slot_tokens[slots].tolist()
        assert (held <= bound).all()
        assert opened.seq_lens.device.tolist() == held.tolist()  # exact on the device
        # What the device computed ahead is what the host settles to: cell for cell.
        assert opened.out_cache_loc.device.tolist() == ahead_window.out_cache_loc.host.tolist()
        assert (
            ahead_window.out_cache_loc.device.tolist() == ahead_window.out_cache_loc.host.tolist()
        )
        first = held - ahead_window.draft_lens - 1  # each row's first token's position
        starts = opened.qo_indptr.host[:-1]
        assert opened.positions.device[starts.tolist()].tolist() == first.tolist()
        leaks = find_leaks(ahead_pools, [ahead_window])
        assert not leaks.unheld and not leaks.held_twice, leaks
    final, ahead_pools = sync(ahead_window, np.zeros(3, dtype=np.int64), ahead_pools)
    check_pools(ahead_pools, [final], compare_device=True)
    _, synced_pools = sync(synced_window, np.zeros(3, dtype=np.int64), synced_pools)
    assert ahead_pools.num_free_tokens == synced_pools.num_free_tokens


@pytest.mark.parametrize("page_size", [1, 16])
def test_on_meta_opening_and_settling_read_nothing(page_size: int) -> None:
    """On meta under a forbidding audit, verify_ahead and exact_window complete; read_verified
    makes one read, permitted, at its own line."""
    decoding, pools = _decoding(META, page_size)
    counts = torch.zeros(3, dtype=torch.int32, device=META)
    with device_reads(forbid=True) as log:
        window, pools = verify(decoding, [2, 0, 5], pools).unwrap()
        for _ in range(3):
            opened, pools = verify_ahead(window, counts, [1, 2, 3], pools).unwrap()
            assert isinstance(opened.seq_lens, UpperBound)
            assert opened.positions.device.shape == (opened.num_tokens,)
            window, pools = exact_window(opened, window.draft_lens // 2, pools)
        assert log.report().count == 0
        tokens = torch.zeros(3, 4, dtype=torch.int64, device=META)
        with pytest.raises(NotImplementedError, match="meta"):  # no data: the read reached torch
            read_verified(counts, tokens)
    (read,) = log.report().reads
    assert read.location.startswith("batchstate/speculative/verified.py:")
    assert read.permitted == "speculative verify: accepted tokens and counts"
    assert isinstance(window, Verifying)


def test_sync_takes_int32_counts() -> None:
    """SGLang's accept_length is int32: sync reads it as it is."""
    window, pools = _window(16, [2, 1, 0])
    running, pools = sync(window, torch.tensor([2, 1, 0], dtype=torch.int32), pools)
    assert running.rows.seq_lens.host.tolist() == [6, 18, 10]


def test_the_bound_past_the_context_or_the_pool_is_a_failure_and_changes_nothing() -> None:
    """The bound is what is reserved: too long or too large fails, pools unchanged."""
    window, pools = _window(1, [2, 3], (3, 120))
    counts = torch.zeros(2, dtype=torch.int64)
    free_before = pools.num_free_tokens
    result = verify_ahead(window, counts, [1, 4], pools)  # 121 + 3 drafts + 1 + 4 = 129
    assert result == Failure(ContextTooLong(1, 129, 128))
    tight = make_pools(4, 128, 32, CPU, 1)  # 32 KV tokens in all
    extended, tight = extend(idle(CPU), [Req(0, (1, 2, 3)), Req(1, (4, 5, 6, 7))], tight).unwrap()
    decoding, tight = decode(extended, tight).unwrap()
    small, tight = verify(decoding, [1, 1], tight).unwrap()  # 11 tokens held
    assert isinstance(verify_ahead(small, counts, [10, 10], tight).failure(), OutOfKVTokens)
    opened, pools = verify_ahead(window, counts, [1, 2], pools).unwrap()  # the same pools
    assert pools.num_free_tokens == free_before - 2 - 3
    assert opened.seq_lens.bound.tolist() == [4 + 2 + 2, 121 + 3 + 3]


def test_refusals() -> None:
    """Counts of the wrong kind, pools that do not hold the window: DraftError."""
    window, pools = _window(16, [2, 1, 0])
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(3), np.zeros(3, dtype=np.int64)):
        with pytest.raises(DraftError, match="num_accepted"):
            verify_ahead(window, bad, [1, 1, 1], pools)  # type: ignore[arg-type]  # on purpose
    opened, after = verify_ahead(
        window, torch.zeros(3, dtype=torch.int64), [1, 1, 1], pools
    ).unwrap()
    with pytest.raises(DraftError, match="accepted 2 of 1"):
        exact_window(opened, np.array([0, 2, 0]), after)
    with pytest.raises(DraftError, match="numpy integer"):
        exact_window(opened, torch.zeros(3, dtype=torch.int64), after)  # type: ignore[arg-type]  # on purpose
    _, elsewhere = _window(16, [2, 1, 0])  # another lineage: the same slots, not the bound
    with pytest.raises(DraftError, match="do not hold"):
        exact_window(opened, np.zeros(3, dtype=np.int64), elsewhere)


@pytest.mark.parametrize("page_size", [1, 16])
def test_fa3_takes_the_bound_and_agrees_with_the_settled_window(page_size: int) -> None:
    """FA3's arguments from the bound: the settled window's lengths on the device, a page
    table as wide as the longest bound whose columns each row reads are the settled ones."""
    window, pools = _window(page_size, [2, 0, 3])
    counts = torch.tensor([1, 0, 2], dtype=torch.int32)
    opened, pools = verify_ahead(window, counts, [1, 2, 0], pools).unwrap()
    ahead_args = fa3_ahead_args(opened, pools.table, page_size)
    settled, pools = exact_window(opened, counts.numpy(), pools)
    exact = fa3_args(forward_inputs(settled, pools.table, page_size, slot_tokens=pools.slot_tokens))
    assert ahead_args["cache_seqlens"].tolist() == exact["cache_seqlens"].tolist()
    assert ahead_args["cu_seqlens_q"].tolist() == exact["cu_seqlens_q"].tolist()
    assert ahead_args["max_seqlen_q"] == exact["max_seqlen_q"]
    width = -(-opened.seq_lens.max_bound // page_size)
    assert ahead_args["page_table"].shape == (3, width)
    for row, length in enumerate(exact["cache_seqlens"].tolist()):
        pages = -(-length // page_size)
        ahead_pages = ahead_args["page_table"][row, :pages].tolist()
        assert ahead_pages == exact["page_table"][row, :pages].tolist()
