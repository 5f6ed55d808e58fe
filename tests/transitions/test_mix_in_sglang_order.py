"""`mix(running, ...)` is one transition for SGLang's three-call mixed step (extend the
new requests, decode the running rows, merge them): the shadow replays SGLang's order,
and both leave the same rows, held chunk and pools."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from batchstate import (
    Chunked,
    Filtered,
    Pools,
    Req,
    decode,
    extend,
    filter_batch,
    finish_mixed,
    idle,
    make_pools,
    merge,
    mix,
    unwrap,
)

DEVICE = torch.device("cpu")


def _running() -> tuple[Filtered, Pools]:
    pools = make_pools(8, 256, 512, DEVICE, page_size=4, prefix_cache=True)
    first, pools = unwrap(
        extend(idle(DEVICE), [Req(0, tuple(range(1, 23))), Req(1, tuple(range(1, 9)))], pools)
    )
    return filter_batch(first, [0, 1]), pools


def _seen(
    batch: Filtered, held: Sequence[Chunked], pools: Pools
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], tuple[int, int], int, int]:
    pairs = sorted(zip(batch.rows.rids.tolist(), batch.rows.seq_lens.host.tolist(), strict=True))
    chunks = [(c.req.rid, c.cached) for c in held]
    counts = (pools.num_free_slots, pools.num_free_tokens)
    return pairs, chunks, counts, pools.cache.num_evictable, pools.cache.num_locked


@pytest.mark.parametrize("budget", [20, 200], ids=["chunked", "whole"])
def test_mix_of_the_running_batch_equals_extend_decode_merge(budget: int) -> None:
    # A prompt sharing the running rows' first page (a cache hit) and 42 tokens more.
    prompt = tuple(range(1, 5)) + tuple(range(100, 142))
    running, pools = _running()
    mixed, after = unwrap(mix(running, [Req(2, prompt)], budget, pools, (7, 8)))
    one = _seen(*finish_mixed(mixed), after)

    running, pools = _running()
    extended, pools = unwrap(mix(idle(DEVICE), [Req(2, prompt)], budget, pools))
    new, held = finish_mixed(extended)
    decoded, pools = unwrap(decode(running, pools))
    rows = filter_batch(decoded, [0, 1])
    three = _seen(merge(rows, new), held, pools)
    assert one == three
    assert one[0][:2] == [(0, 23), (1, 9)]  # both running rows decoded one token
