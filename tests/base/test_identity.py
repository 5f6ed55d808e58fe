"""A holder from another pools lineage, or one already consumed, is refused whatever it says.

Two `make_pools` with the same history used to issue the same generations,
so a record of one passed as a record of the other, and a verify window
whose drafts were all accepted passed as the running batch it became. Each
call below once succeeded and lost a live request's memory.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pytest
import torch
from returns.result import Failure

from batchstate import (
    Chunked,
    DraftError,
    NotHeld,
    NotOwned,
    Pools,
    Req,
    StaleRecord,
    check_pools,
    decode,
    extend,
    filter_batch,
    idle,
    make_pools,
    release,
    sync,
    verify,
)
from tests.strategies import assert_unchanged, snapshot

CPU: Final = torch.device("cpu")
REQS: Final = (Req(0, (1, 2, 3)), Req(1, (4, 5, 6, 7)))


def _twin(prefix_cache: bool) -> Pools:
    return make_pools(4, 32, 64, CPU, 16, prefix_cache=prefix_cache)


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["cache-off", "cache-on"])
def test_a_record_of_one_lineage_is_stale_in_another_with_the_same_history(
    prefix_cache: bool,
) -> None:
    mine, pools_a = extend(idle(CPU), list(REQS), _twin(prefix_cache)).unwrap()
    theirs, pools_b = extend(idle(CPU), list(REQS), _twin(prefix_cache)).unwrap()
    assert mine.rows.req_pool_indices.host.tolist() == theirs.rows.req_pool_indices.host.tolist()
    assert not set(pools_a.slot_gens.tolist()[1:3]) & set(pools_b.slot_gens.tolist()[1:3])
    before = snapshot(pools_b)
    with pytest.raises(StaleRecord, match="generation"):
        decode(mine, pools_b)
    assert_unchanged(before, pools_b)
    # Pools B's own rows still decode: nothing of theirs was touched.
    decode(theirs, pools_b).unwrap()


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["cache-off", "cache-on"])
def test_a_released_record_of_another_lineage_frees_nothing(prefix_cache: bool) -> None:
    mine_extended, pools_a = extend(idle(CPU), list(REQS), _twin(prefix_cache)).unwrap()
    mine, _ = decode(mine_extended, pools_a).unwrap()
    theirs_extended, pools_b = extend(idle(CPU), list(REQS), _twin(prefix_cache)).unwrap()
    theirs, pools_b = decode(theirs_extended, pools_b).unwrap()
    before = snapshot(pools_b)
    result = release(filter_batch(mine, [0]), filter_batch(theirs, [1]), pools_b)
    assert isinstance(result, Failure) and isinstance(result.failure(), NotOwned)
    assert_unchanged(before, pools_b)
    release(filter_batch(theirs, [0]), filter_batch(theirs, [1]), pools_b).unwrap()


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["cache-off", "cache-on"])
def test_a_chunk_of_another_lineage_is_not_held(prefix_cache: bool) -> None:
    _, pools_a = extend(idle(CPU), [Req(7, (1, 2, 3, 4))], _twin(prefix_cache)).unwrap()
    _, pools_b = extend(idle(CPU), [Req(7, (1, 2, 3, 4))], _twin(prefix_cache)).unwrap()
    chunk = Chunked(Req(7, (1,) * 6), 1, 4, gen=int(pools_a.slot_gens[1]))
    before = snapshot(pools_b)
    result = extend(idle(CPU), [chunk], pools_b)
    assert isinstance(result, Failure) and isinstance(result.failure(), NotHeld)
    assert result.failure().stale
    assert_unchanged(before, pools_b)


def test_a_finished_chunk_is_not_held() -> None:
    _, pools = extend(idle(CPU), [Req(7, (1, 2, 3, 4))], _twin(False)).unwrap()
    chunk = Chunked(Req(7, (1,) * 6), 1, 4, gen=int(pools.slot_gens[1]))
    _, pools = extend(idle(CPU), [chunk], pools).unwrap()
    before = snapshot(pools)
    result = extend(idle(CPU), [chunk], pools)
    assert isinstance(result, Failure) and isinstance(result.failure(), NotHeld)
    assert_unchanged(before, pools)


@pytest.mark.parametrize("accepted", [0, 2], ids=["no-drafts", "all-accepted"])
@pytest.mark.parametrize("prefix_cache", [False, True], ids=["cache-off", "cache-on"])
def test_a_synced_window_is_refused_by_release_and_a_second_sync(
    accepted: int, prefix_cache: bool
) -> None:
    extended, pools = extend(idle(CPU), [REQS[0]], _twin(prefix_cache)).unwrap()
    batch, pools = decode(extended, pools).unwrap()
    window, pools = verify(batch, [accepted], pools).unwrap()
    running, pools = sync(window, np.array([accepted]), pools)
    before = snapshot(pools)
    result = release(window, idle(CPU), pools)
    assert isinstance(result, Failure) and isinstance(result.failure(), NotOwned)
    with pytest.raises(DraftError, match="do not hold this batch's drafts"):
        sync(window, np.array([0]), pools)
    assert_unchanged(before, pools)
    check_pools(pools, [running], compare_device=True)
    decoded, pools = decode(running, pools).unwrap()  # the live request goes on
    assert decoded.rows.seq_lens.host.tolist() == [5 + accepted]
