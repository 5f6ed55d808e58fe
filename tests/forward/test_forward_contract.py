"""`check_forward`: the forward's contract, checked for a record about to run.

Every forward the transitions build keeps it (the cache state machine checks
each one); records broken by hand are refused with the row and the cell.
"""

from __future__ import annotations

from typing import Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    DeviceOnly,
    Filtered,
    InvariantViolation,
    MemoryKinds,
    Mirrored,
    PhaseError,
    RecordShapeError,
    RecurrentState,
    Req,
    SlidingWindow,
    StalePools,
    check_forward,
    decode,
    extend,
    finish_mixed,
    idle,
    make_pools,
    mix,
    verify,
)
from tests.builders import CPU, make_reqs

META: Final = torch.device("meta")
SYSTEM: Final = tuple(range(100, 120))  # 20 tokens: five pages of 4


def test_every_phase_a_transition_builds_keeps_the_contract() -> None:
    pools = make_pools(8, 64, 256, CPU, page_size=4, prefix_cache=True)
    reqs = [Req(0, (*SYSTEM, 1)), Req(1, (*SYSTEM, 2, 3)), Req(2, (7, 8, 9))]
    extended, pools = extend(idle(CPU), reqs, pools).unwrap()
    check_forward(extended, pools)
    decoding, pools = decode(extended, pools).unwrap()
    check_forward(decoding, pools)
    window, pools = verify(decoding, [2, 0, 3], pools).unwrap()
    check_forward(window, pools)
    check_forward(idle(CPU), pools)  # no forward: nothing to check


def test_a_chunk_continued_after_a_new_request_with_its_prompt_keeps_the_contract() -> None:
    """The chunk publishes first; the new request moves onto its pages at positions it computes."""
    pools = make_pools(4, 32, 64, CPU, page_size=4, prefix_cache=True)
    prompt = tuple(range(1, 14))
    first, pools = mix(idle(CPU), [Req(0, prompt)], 6, pools).unwrap()
    settled = finish_mixed(first)
    (held,) = settled.held
    second, pools = mix(settled.running, [Req(1, (*prompt, 99)), held], 64, pools).unwrap()
    check_forward(second, pools)
    new_slot, chunk_slot = second.rows.req_pool_indices.host.tolist()
    table = pools.table.host
    # The chunk keeps its own cells (positions 4 and 5 an earlier forward wrote); the new
    # request reads the chunk's pages for positions 4-11, its own two pages retired.
    assert (table[new_slot, 4:12] == table[chunk_slot, 4:12]).all()
    assert sorted(pools.retired.tolist()) == sorted(
        (second.out_cache_loc.device[:8:4] // 4).tolist()
    )
    assert pools.prefixes[new_slot] == pools.prefixes[chunk_slot] == prompt[:12]


def test_a_hybrid_forward_resuming_from_an_anchor_keeps_the_contract() -> None:
    kinds = MemoryKinds((SlidingWindow(8, 128), RecurrentState(4, 16)))
    pools = make_pools(8, 64, 256, CPU, page_size=4, prefix_cache=True, memory=kinds)
    first, pools = extend(idle(CPU), [Req(0, (*SYSTEM, 1))], pools).unwrap()
    check_forward(first, pools)
    second, pools = extend(idle(CPU), [Req(1, (*SYSTEM, 2, 3))], pools).unwrap()
    assert second.prefix_lens.tolist() == [20]  # resumed from the anchor at 20
    check_forward(second, pools)


def test_phases_that_run_no_forward_are_refused() -> None:
    pools = make_pools(8, 64, 256, CPU)
    extended, pools = extend(idle(CPU), make_reqs([3]), pools).unwrap()
    with pytest.raises(PhaseError, match=r"check_forward takes .* got Filtered"):
        check_forward(Filtered(extended.rows), pools)  # type: ignore[arg-type]  # on purpose


def test_stale_pools_are_refused() -> None:
    pools = make_pools(8, 64, 256, CPU)
    extended, _ = extend(idle(CPU), make_reqs([3]), pools).unwrap()
    with pytest.raises(StalePools):
        check_forward(extended, pools)


def test_pools_that_do_not_hold_the_rows_are_named() -> None:
    pools = make_pools(8, 64, 256, CPU)
    extended, pools = extend(idle(CPU), make_reqs([3, 4]), pools).unwrap()
    _, pools = decode(extended, pools).unwrap()  # one token more each
    with pytest.raises(
        InvariantViolation,
        match=r"row 0 \(request 0, slot 1\) runs to 3 tokens, the pools hold 4 in its slot",
    ):
        check_forward(extended, pools)


def test_a_location_written_twice_is_named() -> None:
    pools = make_pools(8, 64, 256, CPU)
    extended, pools = extend(idle(CPU), make_reqs([3, 2]), pools).unwrap()
    locs = extended.out_cache_loc.device.clone()
    locs[3] = locs[0]  # NOTE: request 1's first token written over request 0's
    forged = attrs.evolve(extended, out_cache_loc=DeviceOnly(locs))
    with pytest.raises(
        InvariantViolation,
        match=r"location \d+ is written twice: by row 0 \(request 0, slot 1\) at position 0"
        r" and by row 1 \(request 1, slot 2\) at position 0",
    ):
        check_forward(forged, pools)


def test_a_prefix_cell_on_a_free_page_is_named() -> None:
    pools = make_pools(8, 64, 256, CPU, page_size=4)
    first, pools = extend(idle(CPU), make_reqs([6]), pools).unwrap()
    decoding, pools = decode(first, pools).unwrap()
    free_page = int(pools.free_pages[0])
    # NOTE: a cell pointed at a free page by hand, where no forward wrote the KV.
    pools.table.write(
        Mirrored.from_ints([1], CPU),
        Mirrored.from_ints([2], CPU),
        Mirrored.from_host(np.array([free_page * 4 + 2], dtype=np.int32), CPU),
    )
    with pytest.raises(
        InvariantViolation,
        match=rf"row 0 \(request 0, slot 1\) reads position 2 of its prefix at location"
        rf" {free_page * 4 + 2}, on a page no row holds",
    ):
        check_forward(decoding, pools)


def test_on_meta_a_decode_is_checked_and_an_extend_refused() -> None:
    pools = make_pools(8, 64, 256, META, page_size=4)
    extended, pools = extend(idle(META), make_reqs([5]), pools).unwrap()
    with pytest.raises(RecordShapeError, match="Extended on meta holds no locations"):
        check_forward(extended, pools)
    decoding, pools = decode(extended, pools).unwrap()
    check_forward(decoding, pools)  # its locations are its table cells
