"""Records of every forward phase, and a naive reference of their attention inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch
from returns.result import Result

from batchstate import (
    Chunked,
    Decoding,
    DoesNotFit,
    Extended,
    ForwardInputs,
    GraphBuffers,
    Idle,
    Mixed,
    NoColumns,
    Padded,
    Pools,
    Req,
    Verifying,
    decode,
    extend,
    fill_buffers,
    finish_mixed,
    forward_inputs,
    idle,
    make_pools,
    mix,
    split,
    verify,
)

CPU: Final = torch.device("cpu")
PHASE_NAMES: Final = ("idle", "extended", "decoding", "mixed", "verifying")
PAGE_SIZES: Final = (1, 16, 64)
# Prompt lengths: one-token rows, and rows around page boundaries.
LENGTHS: Final = ((1,), (1, 1, 1), (3, 16, 17, 64, 65, 130))

Record = Idle[Any] | Extended[Any] | Decoding[Any] | Mixed[Any] | Verifying[Any]


def make_pools_for(page_size: int, device: torch.device = CPU) -> Pools:
    """Pools wide and deep enough for every case at `page_size`."""
    return make_pools(16, 400, 64 * 96, device, page_size)


def reqs_of(lengths: Sequence[int], first_rid: int = 0) -> list[Req]:
    """Requests with prompts of `lengths`, token ids counting up from 1."""
    return [
        Req(first_rid + index, tuple(range(1, length + 1))) for index, length in enumerate(lengths)
    ]


def make_record(phase: str, lengths: Sequence[int], pools: Pools) -> tuple[Record, Pools]:
    """A record of `phase` reached through the public transitions, and the pools it holds."""
    device = pools.table.device.device
    if phase == "idle":
        return idle(device), pools
    extended, pools = extend(idle(device), reqs_of(lengths), pools).unwrap()
    if phase == "extended":
        return extended, pools
    decoding, pools = decode(extended, pools).unwrap()
    if phase == "decoding":
        return decoding, pools
    if phase == "verifying":
        drafts = [index % 4 for index in range(len(lengths))]
        window, pools = verify(decoding, drafts, pools).unwrap()
        return window, pools
    # Mixed: a chunk of a long prompt, cut by the budget, then resumed beside the decode rows.
    running, _ = split(decoding, list(range(len(lengths))))
    first, pools = mix(running, reqs_of([90], 100), 37, pools, [5] * len(lengths)).unwrap()
    settled = finish_mixed(first)
    tokens = [5] * len(settled.running.rows)
    admit: list[Req | Chunked[NoColumns]] = [*settled.held, *reqs_of([1, 20], 200)]
    mixed, pools = mix(settled.running, admit, 40, pools, tokens).unwrap()
    return mixed, pools


def build(record: Record, pools: Pools) -> ForwardInputs:
    """`forward_inputs` of `record`, with the pools' slot tokens for a verify window."""
    if isinstance(record, Verifying):
        return forward_inputs(record, pools.table, pools.page_size, slot_tokens=pools.slot_tokens)
    return forward_inputs(record, pools.table, pools.page_size)


def fill_record(buffers: GraphBuffers, record: Record, pools: Pools) -> Result[Padded, DoesNotFit]:
    """`fill_buffers` of `record` into `buffers`; a verify window takes the pools' slot tokens."""
    if isinstance(record, Verifying):
        return fill_buffers(buffers, record, pools.table, slot_tokens=pools.slot_tokens)
    return fill_buffers(buffers, record, pools.table)


def naive(
    slots: Sequence[int],
    prefix: Sequence[int],
    extend_lens: Sequence[int],
    table: np.ndarray[Any, np.dtype[np.int32]],
    page_size: int,
) -> dict[str, list[int]]:
    """The attention inputs built one request at a time from Python lists."""
    out: dict[str, list[int]] = {
        "positions": [],
        "qo_indptr": [0],
        "cu_seqlens_k": [0],
        "kv_indptr": [0],
        "kv_indices": [],
        "kv_last_page_len": [],
        "seq_lens": [],
        "sample_index": [],
    }
    for slot, before, computed in zip(slots, prefix, extend_lens, strict=True):
        seq = before + computed
        out["positions"] += list(range(before, seq))
        out["qo_indptr"].append(out["qo_indptr"][-1] + computed)
        out["cu_seqlens_k"].append(out["cu_seqlens_k"][-1] + seq)
        pages = [int(table[slot, start]) // page_size for start in range(0, seq, page_size)]
        out["kv_indices"] += pages
        out["kv_indptr"].append(out["kv_indptr"][-1] + len(pages))
        out["kv_last_page_len"].append(seq - (len(pages) - 1) * page_size if pages else 0)
        out["seq_lens"].append(seq)
        out["sample_index"].append(out["qo_indptr"][-1] - 1)
    return out


def expected_lens(record: Record, pools: Pools) -> tuple[list[int], list[int], list[int]]:
    """Each row's slot, prefix and query length, from what built the record."""
    if isinstance(record, Verifying):
        slots = record.req_pool_indices.host.tolist()
        drafts = record.draft_lens.tolist()
        owned = [int(pools.slot_tokens[slot]) for slot in slots]
        return (
            slots,
            [n - d - 1 for n, d in zip(owned, drafts, strict=True)],
            [d + 1 for d in drafts],
        )
    rows = record.rows
    slots = rows.req_pool_indices.host.tolist()
    seq = rows.seq_lens.host.tolist()
    if isinstance(record, Idle):
        return [], [], []
    if isinstance(record, Decoding):
        return slots, [n - 1 for n in seq], [1] * len(seq)
    extend_lens = [int(n) for n in record.extend_lens]
    return slots, [n - e for n, e in zip(seq, extend_lens, strict=True)], extend_lens
