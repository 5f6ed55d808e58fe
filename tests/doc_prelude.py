"""The names the docs' fragments use: a device, pools, a running batch, a scheduler.

A fragment is a code block of README.md or docs/ marked `<!-- fragment -->`:
one step of a longer program, shown without the lines that set it up.
tests/test_doc_blocks.py runs each one in a fresh copy of this module's
globals, so a fragment reads these names as a scheduler's own code would
and may rebind them (`batch, pools = ...`) without another block seeing it.
"""

from __future__ import annotations

import copy

import torch

from batchstate import (
    ContextTooLong,
    Filtered,
    OutOfKVTokens,
    Pools,
    Req,
    decode,
    extend,
    forward_inputs,
    idle,
    make_pools,
    merge,
    release,
    split,
    unwrap,
)

__all__ = [
    "ContextTooLong",
    "OutOfKVTokens",
    "Scheduler",
    "arrivals",
    "batch",
    "decode",
    "decoding",
    "device",
    "extend",
    "idle",
    "input_ids",
    "inputs",
    "keep",
    "merge",
    "model",
    "pools",
    "release",
    "running",
    "sampled",
    "scheduler",
    "split",
    "unwrap",
]

device = torch.device("cpu")
pools = make_pools(max_reqs=8, max_context_len=64, num_kv_tokens=256, device=device, page_size=16)

# Two requests, prefilled and decoded once: the running batch between two steps.
_first, pools = unwrap(extend(idle(device), [Req(0, (5, 6, 7)), Req(1, (8, 9))], pools))
_decoded, pools = unwrap(decode(_first, pools))
running = split(_decoded, [0, 1]).kept  # a Filtered: every row goes on
batch = running
keep = [1]  # the rows that go on after this step: request 0 finished
arrivals = [Req(2, (1, 2, 3, 4))]  # requests that joined the waiting queue
sampled = torch.tensor([11, 12])  # the last forward's sampled tokens (on the CPU here)
# The running batch decoded once more: its forward's attention inputs, and its input ids.
# Pools are linear: this decode ahead runs on a copy, so `pools` stays the newest.
decoding, _ahead = unwrap(decode(running, copy.deepcopy(pools)))
inputs = forward_inputs(decoding, _ahead.table, _ahead.page_size)
input_ids = sampled


def model(ids: torch.Tensor, inputs: object) -> torch.Tensor:
    """A stand-in forward: a hidden state of 4 per input token."""
    return torch.zeros(ids.shape[0], 4)


class Scheduler:
    """A stand-in for an engine's scheduler: each step decodes the running batch once."""

    def __init__(self, batch: Filtered, pools: Pools) -> None:
        self.batch, self.pools = batch, pools

    def step(self) -> None:
        """One decode step, then every row goes on."""
        decoding, self.pools = unwrap(decode(self.batch, self.pools))
        self.batch = split(decoding, range(len(decoding.rows))).kept


scheduler = Scheduler(running, copy.deepcopy(pools))  # its own lineage, as `decoding`'s
