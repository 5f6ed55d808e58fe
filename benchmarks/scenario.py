"""The benchmarked step, as a schedule every implementation replays identically.

Per step, at a steady batch size: decode the running batch; one request
finishes (filter it out, release its memory); one new request joins (a
one-request extend, then merge). Which row finishes and what joins come
from a seeded generator, so the three implementations see the same inputs
and must end in the same state.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch

from benchmarks.sampling_values import SamplingRow

__all__ = ["DEVICE", "PHASES", "Config", "Implementation", "Join", "Outcome", "Plan", "make_plan"]

# The "device" tensors live on the CPU here (see docs/performance.md).
DEVICE: Final = torch.device("cpu")

# Timed phases, in the order a step runs them.
PHASES: Final = ("decode", "filter", "release", "extend", "merge")

_PROMPT_LENS: Final = (16, 512)  # new prompts: uniform in [lo, hi)


class Config(NamedTuple):
    """One benchmark point: a steady batch size and a KV page size."""

    batch_size: int
    page_size: int


class Join(NamedTuple):
    """A step's inputs: the row that finishes and the request that joins."""

    finished_row: int
    keep: list[int]  # every other row, increasing (what a scheduler hands filter)
    rid: int
    input_ids: tuple[int, ...]


class Plan(NamedTuple):
    """Everything an implementation needs to set up and replay `num_steps` steps."""

    config: Config
    initial: list[tuple[int, tuple[int, ...]]]  # (rid, input_ids) of the starting batch
    steps: list[Join]
    max_context_len: int
    num_kv_tokens: int
    device: torch.device = DEVICE  # where the "device" tensors live: the CPU, or meta to count


class Outcome(NamedTuple):
    """The state an implementation ends in, as host data (compared across implementations)."""

    rids: list[int]
    slots: list[int]  # host mirror
    slots_device: list[int]
    seq_lens: list[int]  # host mirror
    seq_lens_device: list[int]
    seq_lens_sum: int
    out_cache_loc: list[int]  # of the last decode
    token_rows: list[list[int]]  # table[slot, :seq_len] per row: KV locations
    num_free_slots: int
    num_free_tokens: int
    sampling: list[SamplingRow]  # each row's parameters, device side; none without columns


class Implementation(Protocol):
    """One way to run the step; each phase method mutates only the harness-held state."""

    @property
    def name(self) -> str:
        """Its key in the results: batchstate, mutable or floor."""

    def decode(self) -> None: ...
    def filter(self, join: Join) -> None: ...
    def release(self) -> None: ...
    def extend(self, join: Join) -> None: ...
    def merge(self) -> None: ...
    def outcome(self) -> Outcome: ...
    def row_tensors(self) -> list[tuple[torch.Tensor | npt.NDArray[np.generic], bool]]:
        """Every per-row array of the batch, with True where it is a device tensor."""

    def row_objects(self) -> Sequence[object]:
        """The per-row Python objects the batch holds (its request list)."""


def make_plan(config: Config, num_steps: int, seed: int = 0, device: torch.device = DEVICE) -> Plan:
    """A steady batch of `config.batch_size` requests and `num_steps` steps to replay.

    One request joins per step, so (Little's law) a request lives about
    `batch_size` steps: the starting batch holds requests of every age,
    oldest first, each `age` tokens past its prompt. The request that
    finishes is a random one among the oldest eighth, so filters cut at
    varying positions and lengths stay near `prompt + batch_size`.

    The plan replays the lengths on the host to size the table and the KV
    pool tightly (a little slack): a KV free list the size of a whole GPU
    would make every release copy megabytes, in all three alike.
    """
    rng = random.Random(seed)
    batch_size, page_size = config
    oldest = max(1, batch_size // 8)

    def prompt(rid: int, extra: int = 0) -> tuple[int, ...]:
        return tuple(range(rid, rid + rng.randrange(*_PROMPT_LENS) + extra))

    initial = [(rid, prompt(rid, batch_size - 1 - rid)) for rid in range(batch_size)]
    lens = [len(input_ids) for _, input_ids in initial]
    max_len = max(lens)
    max_pages = 0
    steps = []
    for step in range(num_steps):
        lens = [length + 1 for length in lens]
        max_len = max(max_len, *lens)
        max_pages = max(max_pages, sum(-(-length // page_size) for length in lens))
        row = rng.randrange(oldest)
        del lens[row]
        rid = batch_size + step
        steps.append(Join(row, [i for i in range(batch_size) if i != row], rid, prompt(rid)))
        lens.append(len(steps[-1].input_ids))
    # One more decode after the last step (the smoke test compares states after it).
    max_len = max(max_len, max(lens) + 1)
    max_pages = max(max_pages, sum(-(-(length + 1) // page_size) for length in lens))
    # Decode writes position `max_len`; page-size slack keeps paged rounding in range.
    max_context_len = max_len + 2 * page_size
    num_kv_tokens = (max_pages + batch_size // 4 + 64) * page_size
    return Plan(config, initial, steps, max_context_len, num_kv_tokens, device)
