"""Cached pools count exactly: references per page, what eviction could free, what release takes."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from returns.result import Failure

from batchstate import (
    CachedPools,
    Extended,
    OutOfKVTokens,
    PhaseError,
    Req,
    cached_pools,
    decode_cached,
    extend_cached,
    idle,
    release_cached,
)
from tests.builders import CPU, make_test_pools


def _two_readers() -> tuple[CachedPools, Extended[Any]]:
    """12 pages of 4: three 8-token prefixes cached, the first read by two running rows."""
    pools = cached_pools(make_test_pools(4, num_kv_tokens=48))
    for rid, head in ((1, (1,) * 8), (2, (2,) * 8), (3, (3,) * 8)):
        batch, pools = extend_cached(idle(CPU), [Req(rid, (*head, 9))], pools).unwrap()
        pools = release_cached(batch, idle(CPU), pools).unwrap()
    reader, pools = extend_cached(idle(CPU), [Req(4, (1,) * 8 + (5,))], pools).unwrap()
    _, pools = extend_cached(idle(CPU), [Req(7, (1,) * 8 + (6,))], pools).unwrap()
    return pools, reader


def test_ref_counts_add_the_cache_and_every_reader() -> None:
    """Pages 1-2: cached and read by two rows (3); 4-5 and 7-8: cached only (1);
    10-11: each reader's private last page (1); the rest free (0)."""
    pools, _ = _two_readers()
    counts = pools.ref_counts()
    assert counts.dtype == np.int64 and not counts.flags.writeable
    assert counts.tolist() == [0, 3, 3, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0]


def test_running_out_counts_the_evictable_pages_as_free() -> None:
    """4 free pages and 4 evictable ones (those not read): 8 of the 12 asked for."""
    pools, _ = _two_readers()
    assert extend_cached(idle(CPU), [Req(6, (8,) * 48)], pools) == Failure(OutOfKVTokens(12, 8, 4))


def _exactly(kind: type[Exception], message: str) -> pytest.RaisesExc[Exception]:
    return pytest.raises(kind, match=f"^{re.escape(message)}$")


def test_release_cached_names_what_is_not_a_batch_and_a_row_count_that_differs() -> None:
    pools, reader = _two_readers()
    with _exactly(PhaseError, "release_cached takes Departed or a batch, got CachedPools"):
        release_cached(pools, idle(CPU), pools)  # type: ignore[arg-type]  # on purpose
    with _exactly(PhaseError, "release_cached takes a batch as running, got CachedPools"):
        release_cached(reader, pools, pools)  # type: ignore[arg-type]  # on purpose
    with _exactly(ValueError, "tokens for 2 rows, 1 rows left"):
        release_cached(reader, idle(CPU), pools, [[1] * 9, [2]])


def test_a_decode_with_nothing_free_or_evictable_names_its_one_page() -> None:
    pools = cached_pools(make_test_pools(4, num_kv_tokens=8))  # 2 pages
    batch, pools = extend_cached(idle(CPU), [Req(1, tuple(range(8)))], pools).unwrap()
    assert decode_cached(batch, pools) == Failure(OutOfKVTokens(1, 0, 4))


def test_a_decode_short_of_pages_evicts_only_the_shortfall() -> None:
    """Two rows each need a page, one is free: one cached page is evicted, not all three."""
    pools = cached_pools(make_test_pools(4, num_kv_tokens=24))  # 6 pages of 4
    for rid, token in ((1, 1), (2, 2), (3, 3)):  # three one-page prefixes cached
        batch, pools = extend_cached(idle(CPU), [Req(rid, (token,) * 4 + (9,))], pools).unwrap()
        pools = release_cached(batch, idle(CPU), pools).unwrap()
    rows, pools = extend_cached(idle(CPU), [Req(4, (5,) * 4), Req(5, (6,) * 4)], pools).unwrap()
    assert (pools.cache.num_pages, pools.num_free_tokens) == (3, 4)
    _, after = decode_cached(rows, pools).unwrap()
    assert (after.cache.num_pages, after.num_free_tokens) == (2, 0)
