"""Pools with the cache on count exactly: references per page, what eviction could free, release."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from returns.result import Failure

from batchstate import (
    Extended,
    OutOfKVTokens,
    PhaseError,
    Pools,
    Req,
    check_pools,
    decode,
    extend,
    idle,
    release,
)
from tests.builders import CPU, make_test_pools


def _shared(num_kv_tokens: int) -> Pools:
    return make_test_pools(4, num_kv_tokens=num_kv_tokens, prefix_cache=True)


def _two_readers() -> tuple[Pools, Extended[Any]]:
    """12 pages of 4: three 8-token prefixes cached, the first read by two running rows."""
    pools = _shared(48)
    for rid, head in ((1, (1,) * 8), (2, (2,) * 8), (3, (3,) * 8)):
        batch, pools = extend(idle(CPU), [Req(rid, (*head, 9))], pools).unwrap()
        pools = release(batch, idle(CPU), pools).unwrap()
    reader, pools = extend(idle(CPU), [Req(4, (1,) * 8 + (5,))], pools).unwrap()
    _, pools = extend(idle(CPU), [Req(7, (1,) * 8 + (6,))], pools).unwrap()
    return pools, reader


def test_ref_counts_add_the_cache_and_every_reader() -> None:
    """Pages 1-2: cached and read by two rows (3); 4-5 and 7-8: cached only (1);
    10-11: each reader's private last page (1); the rest free (0)."""
    pools, _ = _two_readers()
    counts = pools.ref_counts()
    assert counts.dtype == np.int64 and not counts.flags.writeable
    assert counts.tolist() == [0, 3, 3, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0]
    assert pools.num_available_tokens == (4 + 4) * 4  # free pages plus evictable ones
    check_pools(pools)


def test_running_out_counts_the_evictable_pages_as_free() -> None:
    """4 free pages and 4 evictable ones (those not read): 8 of the 12 asked for."""
    pools, _ = _two_readers()
    assert extend(idle(CPU), [Req(6, (8,) * 48)], pools) == Failure(OutOfKVTokens(12, 8, 4))


def _exactly(kind: type[Exception], message: str) -> pytest.RaisesExc[Exception]:
    return pytest.raises(kind, match=f"^{re.escape(message)}$")


def test_release_names_what_is_not_a_batch_and_a_row_count_that_differs() -> None:
    pools, reader = _two_readers()
    with _exactly(
        PhaseError, "release takes Departed, Chunked, Verifying or a batch as left, got Pools"
    ):
        release(pools, idle(CPU), pools)  # type: ignore[arg-type]  # on purpose
    with _exactly(PhaseError, "release takes a batch as running, got Pools"):
        release(reader, pools, pools)  # type: ignore[arg-type]  # on purpose
    with _exactly(ValueError, "tokens for 2 rows, 1 rows left"):
        release(reader, idle(CPU), pools, [[1] * 9, [2]])
    with _exactly(TypeError, "expected Pools, got Extended"):
        release(reader, idle(CPU), reader)  # type: ignore[arg-type]  # on purpose


def test_a_decode_with_nothing_free_or_evictable_names_its_one_page() -> None:
    """Both pages are the row's own prompt, published and so locked: not evictable."""
    batch, pools = extend(idle(CPU), [Req(1, tuple(range(8)))], _shared(8)).unwrap()
    assert (pools.cache.num_pages, pools.cache.num_evictable) == (2, 0)
    assert decode(batch, pools) == Failure(OutOfKVTokens(1, 0, 4))


def test_a_decode_short_of_pages_evicts_only_the_shortfall() -> None:
    """Two rows each need a page, one is free: one cached page is evicted, not all three."""
    pools = _shared(24)  # 6 pages of 4
    for rid, token in ((1, 1), (2, 2), (3, 3)):  # three one-page prefixes cached
        batch, pools = extend(idle(CPU), [Req(rid, (token,) * 4 + (9,))], pools).unwrap()
        pools = release(batch, idle(CPU), pools).unwrap()
    rows, pools = extend(idle(CPU), [Req(4, (5,) * 4), Req(5, (6,) * 4)], pools).unwrap()
    # The two one-page prompts are published (locked): 5 cached, 3 of them evictable.
    assert (pools.cache.num_pages, pools.cache.num_evictable, pools.num_free_tokens) == (5, 3, 4)
    decoded, after = decode(rows, pools).unwrap()
    assert (after.cache.num_pages, after.num_free_tokens) == (4, 0)
    assert after.cache.num_evicted == pools.cache.num_evicted + 1
    check_pools(after, [decoded])
