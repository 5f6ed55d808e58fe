"""The production step's schedule: prefix cache, chunked prefill and overlap, in steady state.

Per iteration, at a steady batch size N:

- the running batch of N rows decodes one token, its input tokens the last
  forward's sampled tokens, still on the device (overlap);
- one prefill forward continues the held chunk to its prompt's end and
  admits one new request, whose prompt starts with one of a few system
  prompts (a cached prefix), for its first chunk of `FIRST_CHUNK` tokens:
  it becomes the next held chunk; at each chunk's end its whole pages go
  into the cache;
- one running row finishes (a random one among the oldest eighth): its
  prompt and generated tokens go into the cache, its slot is freed;
- the chunk that completed joins the running batch.

Every row's tokens come from this plan: prompts here, and the token at
position p of request r is `generated(r, p)`, what the fake forward
"samples". So both implementations see the same inputs and must end in the
same state, cache included. The KV pool leaves room for a few finished
requests beyond what live rows use, so in steady state allocation evicts
cached pages every iteration, least recently used first.
"""

from __future__ import annotations

import random
from typing import Final, NamedTuple

import torch

from benchmarks.scenario import DEVICE

__all__ = [
    "FIRST_CHUNK",
    "PHASES",
    "SYSTEM_LEN",
    "ProductionPlan",
    "Turn",
    "generated",
    "make_production_plan",
]

# Timed phases, in the order an iteration runs them.
PHASES: Final = ("decode", "prefill", "settle", "release", "merge")

SYSTEM_LEN: Final = 128  # tokens of each system prompt: whole pages at page sizes 1 and 16
FIRST_CHUNK: Final = 128  # a new request's first chunk (page-aligned, as SGLang truncates)
_NUM_SYSTEMS: Final = 4
_TAIL: Final = (FIRST_CHUNK + 16, FIRST_CHUNK + 256)  # a prompt's own tokens: [lo, hi)
_CACHED_ROWS: Final = 8  # finished requests the pool has room to keep cached


class Turn(NamedTuple):
    """One iteration's inputs: the running row that finishes and the request that arrives."""

    finished_row: int
    keep: list[int]  # every other running row, increasing
    rid: int
    input_ids: tuple[int, ...]


class ProductionPlan(NamedTuple):
    """The starting state and `len(turns)` iterations to replay."""

    batch_size: int
    page_size: int
    initial: list[tuple[int, tuple[int, ...]]]  # (rid, input_ids) of the running rows
    held: tuple[int, tuple[int, ...]]  # the request whose first chunk is held at the start
    turns: list[Turn]
    max_reqs: int
    max_context_len: int
    num_kv_tokens: int
    device: torch.device = DEVICE


def generated(rid: int, position: int) -> int:
    """The token request `rid` holds at `position` past its prompt: distinct per (rid, position)."""
    return 50_000_000 + rid * 100_000 + position


def make_production_plan(
    batch_size: int, page_size: int, num_turns: int, seed: int = 0, device: torch.device = DEVICE
) -> ProductionPlan:
    """A steady batch of `batch_size` rows, one held chunk, and `num_turns` iterations.

    As in the plain step (see `benchmarks.scenario`), the starting rows are
    of every age, oldest first. Sizes are replayed on the host without
    sharing (an upper bound on live pages), plus room for `_CACHED_ROWS`
    finished requests: the rest of the cache is evicted as it grows.
    """
    rng = random.Random(seed)
    systems = [tuple(range(1000 * k, 1000 * k + SYSTEM_LEN)) for k in range(1, _NUM_SYSTEMS + 1)]

    def prompt(rid: int, extra: int = 0) -> tuple[int, ...]:
        tail = rng.randrange(*_TAIL) + extra
        own = range(10_000_000 + rid * 100_000, 10_000_000 + rid * 100_000 + tail)
        return rng.choice(systems) + tuple(own)

    initial = [(rid, prompt(rid, batch_size - 1 - rid)) for rid in range(batch_size)]
    held = (batch_size, prompt(batch_size))
    lens = [len(ids) for _, ids in initial]
    pending = len(held[1])  # the held chunk's prompt: it joins at the next iteration
    oldest = max(1, batch_size // 8)

    def pages(length: int) -> int:
        return -(-length // page_size)

    max_len = max(*lens, pending)
    max_pages = max_row = 0
    turns = []
    for turn in range(num_turns):
        rid = batch_size + 1 + turn
        ids = prompt(rid)
        lens = [length + 1 for length in lens]
        # Live at the prefill: every running row, the completing chunk and the new one.
        max_pages = max(max_pages, sum(map(pages, lens)) + pages(pending) + pages(len(ids)))
        max_len = max(max_len, *lens)
        row = rng.randrange(oldest)
        max_row = max(max_row, pages(lens[row]))
        del lens[row]
        lens.append(pending)
        pending = len(ids)
        turns.append(Turn(row, [i for i in range(batch_size) if i != row], rid, ids))
    # One more decode after the last turn (the smoke test compares states after it).
    max_len = max(max_len, max(lens) + 1)
    max_pages = max(max_pages, sum(pages(length + 1) for length in lens) + pages(pending))
    return ProductionPlan(
        batch_size,
        page_size,
        initial,
        held,
        turns,
        max_reqs=batch_size + 2,  # the running rows, the held chunk and the new request
        max_context_len=max_len + 2 * page_size,
        num_kv_tokens=(max_pages + _CACHED_ROWS * max_row + 64) * page_size,
        device=device,
    )
