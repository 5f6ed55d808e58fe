"""A long, scripted decode loop over every decode-path transition, for audits and device checks.

The same script runs on any device: extend, then many decode steps with
staggered finishes (filter, release), new requests merged in, and, when
asked, speculative verify steps. Each extend, decode and verify forward is
written into its captured bucket's `GraphBuffers` (one bucket of each,
allocated before the loop) with `fill_buffers`. Every decision is taken from host data,
and after each transition the loop records a `Snapshot` of the host side
(mirrors, sums, slot and page ownership), so runs on two devices can be
compared step by step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol, final

import attrs
import numpy as np
import torch
from returns.result import Success

from batchstate import (
    FULL_ATTENTION,
    Batch,
    Decoding,
    Extended,
    Filtered,
    GraphBuffers,
    Idle,
    MemoryKinds,
    Pools,
    Req,
    Verifying,
    decode,
    extend,
    fill_buffers,
    idle,
    make_pools,
    merge,
    release,
    split,
    sync,
    verify,
)

__all__ = ["Accept", "LoopConfig", "Snapshot", "run_loop", "scripted_accept"]


class Accept(Protocol):
    """The verify forward's output: accepted drafts per row, int64 `[num_reqs]` on the device."""

    def __call__(self, batch: Verifying, step: int) -> torch.Tensor: ...


@final
@attrs.frozen
class LoopConfig:
    """Sizes and cadence of the loop; the defaults keep every allocation in bounds."""

    page_size: int = 1
    num_steps: int = 120
    max_reqs: int = 48
    max_context_len: int = 256
    num_kv_tokens: int = 4096
    first_reqs: int = 8
    admit_every: int = 5  # steps between admissions of two new requests
    draft_every: int = 0  # steps between speculative verify steps; 0 for none
    memory: MemoryKinds = FULL_ATTENTION  # a hybrid model's window pages and state slots


@final
@attrs.frozen
class Snapshot:
    """The host side after one transition: what every device must agree on."""

    step: int
    event: str  # the transition just run
    rids: tuple[int, ...]
    slots: tuple[int, ...]
    lens: tuple[int, ...]  # seq_lens mirror; draft_lens for "verify"
    seq_lens_sum: int  # 0 for "verify", whose lengths are device-only
    slot_tokens: tuple[int, ...]  # pools: slot -> KV tokens owned
    free_pages: tuple[int, ...]  # pools: free pages, in hand-out order


Check = Callable[[Batch, Pools], None]


def run_loop(
    device: torch.device,
    config: LoopConfig = LoopConfig(),
    accept: Accept | None = None,
    check: Check | None = None,
) -> tuple[Snapshot, ...]:
    """Run the script on `device` and return a snapshot after every transition.

    Args:
        device: where the batch's device tensors and the table live.
        config: sizes and cadence.
        accept: gives each verify window its accepted counts, then `sync`
            runs; None abandons each verify result instead (the pools from
            before it stay valid), which is all a `meta` run can do.
        check: called with each new batch and the pools after it.

    Raises:
        AssertionError: a transition failed where the script leaves room.
    """
    pools = make_pools(
        config.max_reqs,
        config.max_context_len,
        config.num_kv_tokens,
        device,
        config.page_size,
        memory=config.memory,
    )
    snapshots: list[Snapshot] = []
    buckets = _Buckets.allocate(device, config)

    def record(step: int, event: str, batch: Batch | Verifying, after: Pools) -> None:
        if check is not None and not isinstance(batch, Verifying):
            check(batch, after)
        snapshots.append(_snapshot(step, event, batch, after))

    running: Decoding | Filtered | Idle = idle(device)
    next_rid = 0
    for step in range(config.num_steps):
        if step % config.admit_every == 0:
            count = config.first_reqs if step == 0 else 2
            admitted = extend(idle(device), _make_reqs(next_rid, count), pools)
            if not isinstance(admitted, Success):
                continue  # out of slots or KV: admit later, the pools are unchanged
            extended, pools = admitted.unwrap()
            buckets.fill(extended, pools)
            next_rid += count
            running = merge(running, extended)
            record(step, "extend+merge", running, pools)
        if isinstance(running, Idle) or not running.rows.reqs:
            continue
        decoded = decode(running, pools)
        assert isinstance(decoded, Success), decoded
        decoding, pools = decoded.unwrap()
        buckets.fill(decoding, pools)
        record(step, "decode", decoding, pools)
        current: Decoding | Filtered = decoding
        if config.draft_every and step % config.draft_every == 0:
            current, pools = _speculate(step, decoding, pools, accept, record, buckets)
        running, pools = _finish(step, current, pools, record)
    return tuple(snapshots)


def scripted_accept(batch: Verifying, step: int) -> torch.Tensor:
    """Accepted drafts that vary by row and step, copied to the batch's device without waiting."""
    host = torch.from_numpy((batch.rids * 7 + step) % (batch.draft_lens + 1))
    if batch.device.type == "cuda":
        host = host.pin_memory()
    return host.to(batch.device, non_blocking=True)


Record = Callable[[int, str, "Batch | Verifying", Pools], None]


@final
@attrs.frozen
class _Buckets:
    # One captured bucket per forward kind, as large as the loop's forwards get.
    extend: GraphBuffers
    decode: GraphBuffers
    verify: GraphBuffers

    @classmethod
    def allocate(cls, device: torch.device, config: LoopConfig) -> _Buckets:
        rows, pages = config.max_reqs, -(-config.max_context_len // config.page_size)
        longest = max(_PROMPT_LENS)
        return cls(
            GraphBuffers.for_extend(
                device, config.page_size, config.first_reqs, config.first_reqs * longest, pages
            ),
            GraphBuffers.for_decode(device, config.page_size, rows, pages),
            GraphBuffers.for_verify(device, config.page_size, rows, _MAX_DRAFTS, pages),
        )

    def fill(self, batch: Extended | Decoding | Verifying, pools: Pools) -> None:
        # The forward's inputs, written into its bucket: the loop never runs out of room.
        if isinstance(batch, Verifying):
            filled = fill_buffers(self.verify, batch, pools.table, slot_tokens=pools.slot_tokens)
        else:
            filled = fill_buffers(
                self.extend if isinstance(batch, Extended) else self.decode, batch, pools.table
            )
        assert isinstance(filled, Success), filled


def _speculate(  # noqa: PLR0917  # the step, its records, then the loop's hooks
    step: int,
    decoding: Decoding,
    pools: Pools,
    accept: Accept | None,
    record: Record,
    buckets: _Buckets,
) -> tuple[Decoding | Filtered, Pools]:
    drafts = (decoding.rows.rids + step) % (_MAX_DRAFTS + 1)  # 0 to 3 drafts per row
    verified = verify(decoding, drafts, pools)
    assert isinstance(verified, Success), verified
    verifying, reserved = verified.unwrap()
    buckets.fill(verifying, reserved)
    record(step, "verify", verifying, reserved)
    if accept is None:
        # Abandoned: no draft accepted, the reserved KV goes back. Pools are linear, so
        # the pools from before verify are stale; counts the host has need no read.
        none = np.zeros(len(verifying.reqs), dtype=np.int64)
        synced, after = sync(verifying, none, reserved)
        record(step, "sync", synced, after)
        return synced, after
    synced, after = sync(verifying, accept(verifying, step), reserved)
    record(step, "sync", synced, after)
    return synced, after


def _finish(
    step: int, running: Decoding | Filtered, pools: Pools, record: Record
) -> tuple[Decoding | Filtered, Pools]:
    rows = running.rows
    targets = [_target_len(req) for req in rows.reqs]
    seq_lens = rows.seq_lens.host.tolist()
    done = [row for row, target in enumerate(targets) if seq_lens[row] >= target]
    if not done:
        return running, pools
    kept, left = split(running, [row for row in range(len(rows)) if row not in done])
    record(step, "filter", kept, pools)
    freed = release(left, kept, pools)
    assert isinstance(freed, Success), freed
    pools = freed.unwrap()
    record(step, "release", kept, pools)
    return kept, pools


def _snapshot(step: int, event: str, batch: Batch | Verifying, pools: Pools) -> Snapshot:
    # Host data only: taking a snapshot never reads the device.
    if isinstance(batch, Verifying):
        slots, lens, total = batch.req_pool_indices.host, batch.draft_lens, 0
        rids = batch.rids
    else:
        rows = batch.rows
        slots, lens, total, rids = (
            rows.req_pool_indices.host,
            rows.seq_lens.host,
            rows.seq_lens_sum,
            rows.rids,
        )
    return Snapshot(
        step,
        event,
        tuple(rids.tolist()),
        tuple(slots.tolist()),
        tuple(lens.tolist()),
        total,
        tuple(pools.slot_tokens.tolist()),
        tuple(pools.free_pages.tolist()),
    )


def _make_reqs(first_rid: int, count: int) -> list[Req]:
    # Prompts of 1 to 40 tokens, some a whole page of 16, some one past it.
    return [
        Req(rid, tuple(range(1000 * rid, 1000 * rid + _PROMPT_LENS[rid % len(_PROMPT_LENS)])))
        for rid in range(first_rid, first_rid + count)
    ]


def _target_len(req: Req) -> int:
    # Staggered finishes: each request generates 1 to 29 tokens.
    return len(req.input_ids) + 1 + (req.rid * 11) % 29


_PROMPT_LENS: Final = (3, 16, 17, 1, 32, 9, 40, 15, 33, 5)
_MAX_DRAFTS: Final = 3
