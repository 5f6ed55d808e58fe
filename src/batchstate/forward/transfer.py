"""Where a prefill server's memory goes: each row of an `admit_prefilled` batch, per kind of memory.

`admit_prefilled` admits requests whose prompt another server computed, and runs
no forward: whoever transfers that server's memory writes it here. What
it must fill, all from host values of the pools:

    full-attention layers:  the K/V of positions [0, seq_lens[i]) of row i,
                            at kv_locs (the rows back to back)
    window layers:          the K/V of the window's tail only, positions
                            [kv_starts[i], seq_lens[i]), at out_cache_loc,
                            in the window pages kv_indices[kv_indptr[i]:...]
    state layers:           the state after the prompt's last token, at
                            state slot state_indices[i]

A window layer's next forward (the decode at `seq_lens[i]`) reads
positions from `seq_lens[i] - window + 1` on, so `admit_prefilled` holds window
pages from that position's page on and nothing earlier is transferred;
a state layer reads only its state. One upload; nothing read from the
device.
"""

from __future__ import annotations

from typing import Any, final

import attrs
import numpy as np

from batchstate.base.expect import expect_instance
from batchstate.base.mirrored import HostArray, Mirrored, frozen, upload
from batchstate.forward.hybrid import HybridInputs, StateInputs, WindowInputs, window_rows
from batchstate.pools.pools import Pools, expect_pools
from batchstate.records.phases import Filtered
from batchstate.records.rows import expect_current

__all__ = ["TransferTargets", "spans", "transfer_targets"]


@final
@attrs.frozen(eq=False, repr=False)
class TransferTargets:
    """Where each row's transferred memory goes, per kind: full-attention, window, state.

    Args:
        num_rows: the batch's rows.
        kv_locs: int64 `[seq_lens_sum]`, the full-attention KV location of
            each position `[0, seq_lens[i])` of row `i`, the rows back to back.
        hybrid: the window and state layers' targets, in the form
            `hybrid_inputs` gives a forward: per window kind, `kv_starts[i]`
            (the first position row `i`'s window pages hold: its window's
            tail starts there, a page start), its window pages
            (`kv_indptr`, `kv_indices`) and `out_cache_loc`, the window
            location of each tail position `[kv_starts[i], seq_lens[i])`,
            the rows back to back; per state kind, `state_indices[i]`, the
            slot that takes row `i`'s state after its last token. No entry
            for a full-attention model.
    """

    num_rows: int
    kv_locs: Mirrored
    hybrid: HybridInputs

    def __repr__(self) -> str:
        return f"TransferTargets(num_rows={self.num_rows}, {self.hybrid!r})"


def transfer_targets(batch: Filtered[Any], pools: Pools) -> TransferTargets:
    """Where a transfer writes `batch`'s rows' memory: full-attention, window tail, state.

    For an `admit_prefilled` batch, before it decodes: the locations its prefill
    server's K/V and states go to (see the module's table). Pass the pools
    `admit_prefilled` returned (or any later ones in which the rows still hold
    their lengths). One upload; nothing is read from the device.

    Raises:
        TypeError: `batch` is not `Filtered`.
        StaleRecord: a row's slot holds another length or generation: the
            row grew, or was released (its slot, window pages and state
            handed on).
        StalePools: `pools` is not the newest pools.
        BatchConflict: `batch` and `pools` live on different devices.

    >>> import torch
    >>> from batchstate import MemoryKinds, RecurrentState, Req, SlidingWindow, idle
    >>> from batchstate import admit_prefilled, make_pools
    >>> kinds = MemoryKinds((SlidingWindow(8, 64), RecurrentState(16, 4)))
    >>> pools = make_pools(4, 32, 64, torch.device("cpu"), page_size=4, memory=kinds)
    >>> batch, pools = admit_prefilled(idle("cpu"), [Req(0, tuple(range(20)))], pools).unwrap()
    >>> targets = transfer_targets(batch, pools)
    >>> window = targets.hybrid.windows[0]  # the decode at 20 reads from 13 on
    >>> window.kv_starts.host.tolist(), window.kv_indices.host.tolist()
    ([12], [1, 2])
    >>> len(targets.kv_locs), len(window.out_cache_loc), targets.hybrid.states[0].state_indices.host
    (20, 8, array([1]))
    """
    expect_instance(batch, Filtered, "transfer_targets: batch")
    expect_pools(pools)
    rows = batch.rows
    pools.table.expect_on(rows.device)
    expect_current(rows, pools)
    slots, seq = rows.req_pool_indices.host, rows.seq_lens.host
    page_size = pools.page_size
    token_rows, positions = spans(np.zeros_like(seq), seq)
    hosts: list[HostArray] = [pools.table.host[slots[token_rows], positions].astype(np.int64)]
    for window in pools.memory.windows:
        kv_starts, indptr, pages = window_rows(window.table, window.starts, page_size, slots, seq)
        tail_rows, tail = spans(kv_starts, seq)
        locs = window.table[slots[tail_rows], tail // page_size] * page_size + tail % page_size
        hosts += [
            kv_starts.astype(np.int32),
            indptr.astype(np.int32),
            pages.astype(np.int32),
            locs.astype(np.int64),
        ]
    hosts += [state.of_slot[slots] for state in pools.memory.states]
    pairs: list[Mirrored[Any]] = [
        Mirrored.trusted(frozen(host), side)
        for host, side in zip(hosts, upload(hosts, rows.device), strict=True)
    ]
    windows = tuple(
        WindowInputs(window.window, page_size, *pairs[1 + 4 * at : 5 + 4 * at])
        for at, window in enumerate(pools.memory.windows)
    )
    first_state = 1 + 4 * len(windows)
    states = tuple(
        StateInputs(state.kind.state_size, pair)
        for state, pair in zip(pools.memory.states, pairs[first_state:], strict=True)
    )
    return TransferTargets(len(rows), pairs[0], HybridInputs(len(rows), windows, states))


def spans(first: HostArray, end: HostArray) -> tuple[HostArray, HostArray]:
    """Each position of `[first[i], end[i])` for every row `i`, rows back to back: row, position."""
    counts = end - first
    rows = np.repeat(np.arange(counts.shape[0]), counts)
    offsets = np.cumsum(counts) - counts
    return rows, first[rows] + np.arange(rows.shape[0]) - offsets[rows]
