"""Extend and prebuilt: where admitted tokens land, and chunked prefills continued."""

from __future__ import annotations

import pytest
from returns.result import Failure

from batchstate import (
    BatchConflict,
    Chunked,
    ContextTooLong,
    EmptyExtend,
    EmptyPrompt,
    NotHeld,
    OutOfKVTokens,
    OutOfReqSlots,
    PhaseError,
    Req,
    check_batch,
    check_pools,
    decode,
    extend,
    filter_batch,
    idle,
)
from tests.builders import CPU, make_extended, make_reqs, make_test_pools
from tests.strategies import assert_unchanged, snapshot


def test_extend_lays_tokens_out_back_to_back() -> None:
    """input_ids, out_cache_loc and the table agree row by row, in the documented layout."""
    pools = make_test_pools(page_size=4)
    batch, pools = make_extended(pools, [3, 6])
    assert batch.extend_lens.tolist() == [3, 6]
    assert batch.prefix_lens.tolist() == [0, 0]
    assert batch.input_ids.device.tolist() == [*range(0, 3), *range(100, 106)]
    locs = batch.out_cache_loc.device.tolist()
    table = pools.table.host
    assert locs[:3] == table[1, :3].tolist()
    assert locs[3:] == table[2, :6].tolist()
    # Page size 4: the first row takes one page, the second two; no location is shared.
    assert len(set(locs)) == 9
    assert {loc // 4 for loc in locs[:3]}.isdisjoint({loc // 4 for loc in locs[3:]})


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_request_continues_in_its_own_slot(page_size: int) -> None:
    """A chunked prefill: the second chunk fills the partly used page, then takes new ones."""
    pools = make_test_pools(page_size)
    full = make_reqs([21])[0]
    first = Req(full.rid, full.input_ids[:5])
    chunk, pools = extend(idle(CPU), [first], pools).unwrap()
    slot = int(chunk.rows.req_pool_indices.host[0])
    held = filter_batch(chunk, [])  # out of the batch, memory kept
    second, pools = extend(
        idle(CPU), [Chunked(full, slot, 5, gen=int(chunk.rows.gens[0]))], pools
    ).unwrap()
    assert second.prefix_lens.tolist() == [5]
    assert second.extend_lens.tolist() == [16]
    assert second.input_ids.device.tolist() == list(full.input_ids[5:])
    assert second.rows.req_pool_indices.host.tolist() == [slot]
    check_batch(second, compare_device=True)
    check_pools(pools, [second, held], compare_device=True)
    if page_size == 16:
        first_page = int(pools.table.host[slot, 0]) // 16
        assert int(pools.table.host[slot, 15]) // 16 == first_page
        assert int(pools.table.host[slot, 16]) // 16 != first_page


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        ([], EmptyExtend()),  # nothing to admit
        ([Req(7, ())], EmptyPrompt(7, 0, 0)),  # a request with no tokens
        ([Req(8, tuple(range(65)))], ContextTooLong(8, 65, 64)),  # longer than the table
        (
            [Chunked(Req(9, (1, 2)), 3, 1, gen=0)],
            NotHeld(9, 3, 1, 0),
        ),  # continuing a slot nobody holds
        (make_reqs([1] * 17), OutOfReqSlots(17, 16)),  # one more than the slots
        (make_reqs([64] * 9), OutOfKVTokens(576, 512, 1)),  # more tokens than the pool
    ],
    ids=["empty", "empty-prompt", "too-long", "chunk-not-held", "slots", "tokens"],
)
def test_extend_failures_change_nothing(inputs: list[Req | Chunked], expected: object) -> None:
    """Each bad or too-large admission is its Failure, and the pools and table are untouched."""
    pools = make_test_pools()
    before = snapshot(pools)
    assert extend(idle(CPU), inputs, pools) == Failure(expected)
    assert_unchanged(before, pools, "pools")


def test_extend_rejects_duplicate_rids_and_wrong_phases() -> None:
    """Two inputs with one rid, or a non-Idle source, are broken contracts."""
    pools = make_test_pools()
    with pytest.raises(BatchConflict, match=r"rid appears twice among the requests: \[1\]"):
        extend(idle(CPU), [Req(1, (1,)), Req(1, (2,))], pools)
    batch, pools = make_extended(pools, [2])
    decoded, pools = decode(batch, pools).unwrap()
    with pytest.raises(PhaseError, match="extend starts from Idle, got Decoding"):
        extend(decoded, make_reqs([1], 5), pools)  # type: ignore[call-overload]  # the runtime check
