"""Small builders shared by the tests: pools, requests, and a record of each phase."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from batchstate import (
    Batch,
    Decoding,
    Extended,
    Filtered,
    Idle,
    Pools,
    Req,
    Step,
    decode,
    extend,
    filter_batch,
    idle,
    make_pools,
)

CPU: Final = torch.device("cpu")
PHASES: Final = (Idle, Extended, Decoding, Filtered)


def make_test_pools(
    page_size: int = 1,
    *,
    max_reqs: int = 16,
    max_context_len: int = 64,
    num_kv_tokens: int = 512,
    device: torch.device = CPU,
) -> Pools:
    """Roomy pools for a few short requests."""
    return make_pools(max_reqs, max_context_len, num_kv_tokens, device, page_size)


def make_reqs(lengths: Sequence[int], first_rid: int = 0) -> list[Req]:
    """One request per length, with distinct rids and recognisable token ids."""
    return [
        Req(first_rid + i, tuple(range(100 * (first_rid + i), 100 * (first_rid + i) + length)))
        for i, length in enumerate(lengths)
    ]


def make_extended(
    pools: Pools, lengths: Sequence[int] = (3, 5, 7), first_rid: int = 0, device: torch.device = CPU
) -> Step[Extended]:
    """An extend of fresh requests; fails the test if it does not fit."""
    return extend(idle(device), make_reqs(lengths, first_rid), pools).unwrap()


def make_phase(
    phase: type[object],
    pools: Pools,
    lengths: Sequence[int] = (3, 5, 7),
    first_rid: int = 0,
    device: torch.device = CPU,
) -> tuple[Batch, Pools]:
    """A record of `phase` reached through the public transitions."""
    if phase is Idle:
        return idle(device), pools
    extended, pools = make_extended(pools, lengths, first_rid, device)
    if phase is Extended:
        return extended, pools
    decoding, pools = decode(extended, pools).unwrap()
    if phase is Decoding:
        return decoding, pools
    return filter_batch(decoding, list(range(0, len(lengths), 2))), pools
