"""What a hybrid model's other layers read in a forward: window pages and state slots.

`forward_inputs` gives the full-attention layers their inputs; the window
and recurrent layers take more, all from host values of the pools:

    window layers:  row i holds KV positions [kv_starts[i], seq_lens[i]) in
                    window pages kv_indices[kv_indptr[i]:kv_indptr[i + 1]];
                    each new token's window KV goes to out_cache_loc
    state layers:   row i reads and writes state slot state_indices[i]

A row holds only the window pages its window reads, so the window page
lists are short and are built on the host and uploaded, in one copy with
the state indices. Nothing is read from the device.
"""

from __future__ import annotations

from typing import Any, final

import attrs
import numpy as np
import torch

from batchstate.base.expect import expect_instance
from batchstate.base.mirrored import HostArray, Mirrored, frozen, upload
from batchstate.forward.anchor_copies import CachedCopies, cached_copies
from batchstate.forward.inputs import ForwardInputs, ForwardInputsError
from batchstate.pools.pools import Pools, expect_pools

__all__ = [
    "HybridInputs",
    "StateInputs",
    "WindowInputs",
    "anchor_copies",
    "hybrid_hosts",
    "hybrid_inputs",
    "hybrid_of",
    "window_rows",
]


@final
@attrs.frozen(eq=False, repr=False)
class WindowInputs:
    """The window layers' inputs: each row's window start and window pages, and new locations.

    Args:
        window: positions a token reads, itself included.
        page_size: tokens per window page.
        kv_starts: int32 `[num_rows]`, the first position each row's window
            pages hold (a page start; positions before it were given back).
        kv_indptr: int32 `[num_rows + 1]`, offsets into `kv_indices`.
        kv_indices: int32 `[num_window_pages]`, each row's window pages in order.
        out_cache_loc: int64 `[num_tokens]`, where each new token's window KV goes.
    """

    window: int
    page_size: int
    kv_starts: Mirrored[np.int32]
    kv_indptr: Mirrored[np.int32]
    kv_indices: Mirrored[np.int32]
    out_cache_loc: Mirrored

    def __repr__(self) -> str:
        return f"WindowInputs(window={self.window}, num_pages={len(self.kv_indices)})"


@final
@attrs.frozen(eq=False, repr=False)
class StateInputs:
    """The recurrent layers' inputs: the state slot each row reads and writes.

    Args:
        state_size: elements per state.
        state_indices: int64 `[num_rows]`, each row's state slot.
    """

    state_size: int
    state_indices: Mirrored

    def __repr__(self) -> str:
        return f"StateInputs(state_size={self.state_size}, num_rows={len(self.state_indices)})"


@final
@attrs.frozen(eq=False, repr=False)
class HybridInputs:
    """A forward's inputs for a hybrid model's window and recurrent layers, per kind.

    `windows` and `states` hold one entry each for the kinds the pools were
    made with, none for a full-attention model; `cached` one when rows of
    the forward resume from or publish prefix-cache anchors (docs/hybrid.md).
    """

    num_rows: int
    windows: tuple[WindowInputs, ...]
    states: tuple[StateInputs, ...]
    # The prefix cache's anchor copies this forward performs (one entry), () for none.
    cached: tuple[CachedCopies, ...] = ()

    def __repr__(self) -> str:
        kinds = ", ".join(map(repr, (*self.windows, *self.states)))
        return f"HybridInputs(num_rows={self.num_rows}, {kinds})"


def hybrid_inputs(inputs: ForwardInputs, pools: Pools) -> HybridInputs:
    """The window and state inputs of the forward `inputs` describe, from `pools`' host values.

    Pass the pools the forward's transition returned: they hold exactly
    the forward's rows and lengths. One upload; nothing read from the device.
    Padded inputs (`pad(...).inputs`, or a filled bucket's) work too: a
    padding row, at slot 0, reads and writes the padding window page 0 and
    the padding state slot 0.

    Raises:
        ForwardInputsError: `pools` are not the ones `inputs` were built
            against, or they moved on (a row's slot holds another length).
        StalePools: `pools` is not the newest pools.

    >>> import torch
    >>> from batchstate import MemoryKinds, Req, SlidingWindow, extend, forward_inputs, idle
    >>> from batchstate import make_pools, RecurrentState
    >>> kinds = MemoryKinds((SlidingWindow(8, 64), RecurrentState(16, 4)))
    >>> pools = make_pools(4, 32, 64, torch.device("cpu"), page_size=4, memory=kinds)
    >>> batch, pools = extend(idle("cpu"), [Req(0, tuple(range(10)))], pools).unwrap()
    >>> hybrid = hybrid_inputs(forward_inputs(batch, pools.table, pools.page_size), pools)
    >>> hybrid.windows[0].kv_indices.host.tolist(), hybrid.states[0].state_indices.host.tolist()
    ([1, 2, 3], [1])
    """
    hosts = hybrid_hosts(inputs, pools, "hybrid_inputs")
    cached = anchor_copies(inputs, pools)
    return hybrid_of(inputs, pools, hosts, upload(hosts, inputs.device), cached)


def hybrid_hosts(inputs: ForwardInputs, pools: Pools, caller: str) -> list[HostArray]:
    """`hybrid_inputs`' checks, then its host arrays, in `hybrid_of`'s order.

    Per window kind `kv_starts`, `kv_indptr`, `kv_indices` (int32) and
    `out_cache_loc` (int64), then per state kind `state_indices` (int64).
    """
    expect_instance(inputs, ForwardInputs, f"{caller}: inputs")
    expect_pools(pools)
    slots, seq = inputs.req_pool_indices.host, inputs.seq_lens.host
    if inputs.kv_cache_size != pools.kv_cache_size or inputs.table_rows != pools.max_reqs + 1:
        raise ForwardInputsError(f"{caller}: the inputs were built against other pools")
    real = slots != 0  # a padded forward's padding rows sit at slot 0, which no row owns
    if inputs.num_rows and not np.array_equal(pools.slot_tokens[slots[real]], seq[real]):
        raise ForwardInputsError(
            f"{caller}: the pools hold other lengths than the forward's rows: pass the"
            " pools the forward's transition returned"
        )
    hosts: list[HostArray] = []
    for window in pools.memory.windows:
        hosts += _window_hosts(window.table, window.starts, window.page_size, inputs)
    hosts += [state.of_slot[slots] for state in pools.memory.states]
    return hosts


def anchor_copies(inputs: ForwardInputs, pools: Pools) -> tuple[CachedCopies, ...]:
    """The anchor copies of the forward `inputs` on `pools` (`cached_copies`), uploaded.

    Raises:
        ForwardInputsError: as `cached_copies`.
    """
    memory = pools.memory
    return cached_copies(
        inputs,
        memory.cached,
        memory.windows[0] if memory.windows else None,
        memory.states[0].of_slot if memory.states else None,
    )


def hybrid_of(
    inputs: ForwardInputs,
    pools: Pools,
    hosts: list[HostArray],
    sides: list[torch.Tensor],
    cached: tuple[CachedCopies, ...],
) -> HybridInputs:
    """The `HybridInputs` of `hybrid_hosts`' arrays, their device sides and `anchor_copies`."""
    pairs: list[Mirrored[Any]] = [
        Mirrored.trusted(frozen(host), side) for host, side in zip(hosts, sides, strict=True)
    ]
    windows = tuple(
        WindowInputs(window.window, window.page_size, *pairs[:4]) for window in pools.memory.windows
    )
    states = tuple(
        StateInputs(state.kind.state_size, pair)
        for state, pair in zip(pools.memory.states, pairs[len(windows) * 4 :], strict=True)
    )
    return HybridInputs(inputs.num_rows, windows, states, cached)


def window_rows(
    table: HostArray, starts: HostArray, page_size: int, slots: HostArray, seq: HostArray
) -> tuple[HostArray, HostArray, HostArray]:
    """Each row's window start, and the window pages it holds in CSR form: starts, indptr, pages.

    Row `i` (in slot `slots[i]`, holding `seq[i]` tokens) holds the pages of
    positions `[starts[slots[i]], seq[i])`; int64 host arrays.
    """
    kv_starts = starts[slots]
    first = kv_starts // page_size
    counts = np.maximum(-(-seq // page_size) - first, 0)
    indptr = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    rows = np.repeat(np.arange(counts.shape[0]), counts)
    pages = table[slots[rows], first[rows] + np.arange(rows.shape[0]) - indptr[:-1][rows]]
    return kv_starts, indptr, pages


def _window_hosts(
    table: HostArray, starts: HostArray, page_size: int, inputs: ForwardInputs
) -> list[HostArray]:
    # kv_starts, kv_indptr, kv_indices and out_cache_loc of the window layers, on the host.
    slots, seq = inputs.req_pool_indices.host, inputs.seq_lens.host.astype(np.int64)
    kv_starts, indptr, pages = window_rows(table, starts, page_size, slots, seq)
    token_rows = np.repeat(np.arange(slots.shape[0]), inputs.extend_lens.host)
    positions = inputs.positions.host[: token_rows.shape[0]]
    locs = table[slots[token_rows], positions // page_size] * page_size + positions % page_size
    # A padded forward's tokens past every row (a filled bucket's) write the padding page 0.
    locs = np.concatenate((locs, np.zeros(len(inputs.positions) - locs.shape[0], np.int64)))
    return [
        kv_starts.astype(np.int32),
        indptr.astype(np.int32),
        pages.astype(np.int32),
        locs.astype(np.int64),
    ]
