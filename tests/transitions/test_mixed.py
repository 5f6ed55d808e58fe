"""Chunked prefill, mixed forwards, device-resident tokens: layout, hostile inputs, leaks, reads."""

from __future__ import annotations

from typing import Final

import numpy as np
import pytest
import torch
from returns.result import Failure

from batchstate import (
    BatchConflict,
    Chunked,
    EmptyExtend,
    Filtered,
    NoChunkBudget,
    NotHeld,
    NotOwned,
    PhaseError,
    Pools,
    Req,
    Sampled,
    StillRunning,
    check_leaks,
    check_pools,
    decode_sampled,
    find_leaks,
    finish_mixed,
    gather_sampled,
    idle,
    merge,
    mix,
    read_sampled,
    release,
    split,
)
from batchstate.audit import device_reads
from tests.builders import CPU, make_reqs, make_test_pools
from tests.strategies import assert_unchanged, snapshot

META: Final = torch.device("meta")


def _chunked(pools: Pools, length: int = 40, budget: int = 8) -> tuple[Chunked, Pools]:
    mixed, pools = mix(
        idle(pools.table.device.device), make_reqs([length], 90), budget, pools
    ).unwrap()
    _, (chunk,) = finish_mixed(mixed)
    return chunk, pools


def _running(
    pools: Pools, lengths: tuple[int, ...] = (5, 9), first_rid: int = 0
) -> tuple[Filtered, Pools]:
    admit = make_reqs(lengths, first_rid)
    mixed, pools = mix(idle(pools.table.device.device), admit, 1000, pools).unwrap()
    running, held = finish_mixed(mixed)
    assert held == ()
    return running, pools


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_layout_is_extend_rows_then_one_token_decode_rows(page_size: int) -> None:
    """Chunks first, decode rows after, each with its own positions, locations and lengths."""
    running, pools = _running(make_test_pools(page_size))
    chunk, pools = _chunked(pools)
    mixed, pools = mix(running, [chunk, *make_reqs([30], 50)], 40, pools, [11, 12]).unwrap()
    assert mixed.num_extend_rows == 2 and mixed.partial == (1,)
    assert mixed.extend_lens.tolist() == [32, 8, 1, 1]
    assert mixed.prefix_lens.tolist() == [8, 0, 5, 9]
    assert mixed.rows.seq_lens.host.tolist() == [40, 8, 6, 10]
    assert mixed.num_tokens == 42 and mixed.sample_index.tolist() == [31, 39, 40, 41]
    positions = mixed.positions.device.tolist()
    assert positions == [*range(8, 40), *range(8), 5, 9]
    ids = mixed.input_ids.device.tolist()
    assert ids[:32] == list(chunk.req.input_ids[8:]) and ids[-2:] == [11, 12]
    table = pools.table.host
    slots = mixed.rows.req_pool_indices.host.tolist()
    expected = [int(table[slots[0], p]) for p in range(8, 40)]
    expected += [int(table[slots[1], p]) for p in range(8)]
    expected += [int(table[slots[2], 5]), int(table[slots[3], 9])]
    assert mixed.out_cache_loc.device.tolist() == expected
    settled, held = finish_mixed(mixed)
    # The decode rows first, then the finished prompt; the cut one is held.
    assert settled.rows.rids.tolist() == [0, 1, 90]
    assert [(c.req.rid, c.cached) for c in held] == [(50, 8)]
    check_pools(pools, [settled], compare_device=True)
    check_leaks(pools, [settled, *held])


def test_a_dropped_chunk_is_a_leak_the_check_names() -> None:
    """Dropping a held chunk leaks its slot and KV; find_leaks says how much; release frees it."""
    pools = make_test_pools(16, max_context_len=512, num_kv_tokens=512)
    mixed, pools = mix(idle(CPU), make_reqs([500], 1), 432, pools).unwrap()
    running, (chunk,) = finish_mixed(mixed)
    leaks = find_leaks(pools, [running])  # the chunk handle dropped
    assert leaks.unheld == (chunk.slot,) and leaks.unheld_tokens == 432
    assert "432 KV tokens" in str(leaks)
    assert not find_leaks(pools, [running, chunk])
    pools = release(chunk, running, pools).unwrap()
    assert not find_leaks(pools, [running]) and pools.num_free_tokens == 512


def test_leaks_held_twice_and_stale_lengths() -> None:
    """A slot in two records, or at another length than the pools own, is reported."""
    running, pools = _running(make_test_pools())
    assert find_leaks(pools, [running, running]).held_twice == (1, 2)
    _, after = mix(running, (), 1, pools, [1, 2]).unwrap()
    assert find_leaks(after, [running]).wrong_length == (1, 2)  # one token behind


@pytest.mark.parametrize("page_size", [1, 16])
def test_hostile_inputs_are_typed_and_change_nothing(page_size: int) -> None:
    """Budget 0, a chunk not held, a chunk used twice, a duplicate: typed, inputs unchanged."""
    running, pools = _running(make_test_pools(page_size))
    chunk, pools = _chunked(pools)
    before = snapshot((running, pools))
    cases = {
        "budget 0": mix(running, [chunk], 0, pools, [1, 1]),
        "never held": mix(running, [Chunked(Req(70, (1,) * 9), 9, 4, gen=0)], 5, pools, [1, 1]),
        "nothing": mix(idle(CPU), [], 5, pools),
    }
    assert isinstance(cases["budget 0"].failure(), NoChunkBudget)
    assert isinstance(cases["never held"].failure(), NotHeld)
    assert isinstance(cases["nothing"].failure(), EmptyExtend)
    assert all(str(result.failure()) for result in cases.values())
    with pytest.raises(BatchConflict, match="twice"):
        mix(running, [chunk, chunk], 5, pools, [1, 1])
    with pytest.raises(BatchConflict, match="input tokens"):
        mix(running, [chunk], 5, pools, [1])
    with pytest.raises(PhaseError):
        finish_mixed(running)  # type: ignore[arg-type]  # for callers without mypy
    assert_unchanged(before, (running, pools), "inputs after hostile calls")
    # A chunk continued once is stale: continuing it again is NotHeld.
    step, after = mix(idle(CPU), [chunk], 8, pools).unwrap()
    _, (next_chunk,) = finish_mixed(step)
    assert next_chunk.cached == 16
    again = mix(idle(CPU), [chunk], 8, after)
    assert isinstance(again, Failure) and isinstance(again.failure(), NotHeld)
    # Merged into the running batch by its last chunk: in a batch, so a conflict; not freeable.
    last, after = mix(running, [next_chunk], 40, after, [1, 1]).unwrap()
    merged = finish_mixed(last).running
    with pytest.raises(BatchConflict, match="twice"):
        mix(merged, [next_chunk], 8, after, [1, 1, 1])
    assert isinstance(release(next_chunk, merged, after).failure(), StillRunning)
    assert isinstance(release(next_chunk, idle(CPU), after).failure(), NotOwned)


def test_follow_gathers_tokens_by_rid_and_refuses_strangers() -> None:
    """Tokens follow rows through a split and a merge; a row without one is a BatchConflict."""
    running, pools = _running(make_test_pools(), (3, 4, 5))
    sampled = Sampled.of(running.rows, torch.tensor([7, 8, 9]))
    kept, _ = split(running, [0, 2])
    assert read_sampled(gather_sampled(sampled, kept)).tolist() == [7, 9]
    newcomers, pools = _running(pools, (6,), first_rid=10)
    with pytest.raises(BatchConflict, match="no sampled token"):
        gather_sampled(sampled, merge(kept, newcomers))
    assert gather_sampled(sampled, running) is sampled


@pytest.mark.parametrize("page_size", [1, 16])
def test_overlap_step_on_meta_reads_only_through_read_sampled(page_size: int) -> None:
    """decode_sampled, mix with device tokens, finish_mixed, gather_sampled, split and release
    read nothing; read_sampled makes one read, permitted, at its own line."""
    pools = make_test_pools(page_size, device=META)
    running, pools = _running(pools, (3, 16, 9))
    sampled = Sampled.of(running.rows, torch.zeros(3, dtype=torch.int64, device=META))
    with device_reads(forbid=True) as log:
        decoding, pools = decode_sampled(running, sampled, pools).unwrap()
        running, _ = finish_mixed(decoding)
        sampled = Sampled.of(decoding.rows, torch.zeros(3, dtype=torch.int64, device=META))
        kept, left = split(running, [0, 2])
        pools = release(left, kept, pools).unwrap()
        admit = make_reqs([40], 30)
        mixed, pools = mix(kept, admit, 16, pools, gather_sampled(sampled, kept)).unwrap()
        running, held = finish_mixed(mixed)
        check_leaks(pools, [running, *held])
        with pytest.raises(NotImplementedError, match="meta"):  # no data: the read reached torch
            read_sampled(sampled)
    (read,) = log.report().reads
    assert read.location.startswith("batchstate/transitions/sampled.py:")
    assert read.permitted == "sampled tokens: finish checks"
    assert log.report().forbidden == ()
    assert np.array_equal(mixed.extend_lens, [16, 1, 1])
