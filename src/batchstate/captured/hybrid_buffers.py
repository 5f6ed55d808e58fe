"""A captured bucket's window and state inputs: allocated once, written every step.

A replayed CUDA graph reads the addresses it was captured with, so the
window and state layers' inputs (`hybrid_inputs`) need fixed buffers as
the full-attention ones do (`GraphBuffers`). `HybridBuffers` is that set
for one bucket, beside its `GraphBuffers`; `fill_hybrid_buffers` computes a padded
forward's `hybrid_inputs` on the host and writes them into it in one copy
(all but the prefix cache's anchor copies, uploaded apart: see there):

    block  (uint8, one host-to-device copy)   per window kind: out_cache_loc
                                              (int64 [tokens]); per state kind:
                                              state_indices (int64 [rows]); then
                                              per window kind kv_starts (int32
                                              [rows]), kv_indptr (int32 [rows + 1])
                                              and kv_indices (int32 [window_pages])

A padding row (slot 0) reads and writes the padding window page 0 and
state slot 0, as in `hybrid_inputs`; `kv_indices` is used up to the
forward's count, which `kv_indptr` bounds.
"""

from __future__ import annotations

from typing import Final, Self, final

import attrs
import numpy as np
import torch
from returns.result import Failure, Result, Success

from batchstate.base.expect import expect_instance
from batchstate.base.mirrored import describe, torch_dtype
from batchstate.captured.graph_buffers import DoesNotFit, GraphBuffersError
from batchstate.forward.hybrid import HybridInputs, anchor_copies, hybrid_hosts, hybrid_of
from batchstate.forward.inputs import ForwardInputs
from batchstate.memory.kinds import MemoryKinds
from batchstate.pools.pools import Pools

__all__ = ["HybridBuffers", "fill_hybrid_buffers"]

# Per window kind: kv_starts, kv_indptr, kv_indices, out_cache_loc; per state kind: slots.
_WINDOW_WHAT: Final = ("rows", "rows", "window pages", "tokens")
_WINDOW_DTYPES: Final = (np.int32, np.int32, np.int32, np.int64)


@final
@attrs.frozen(eq=False, repr=False)
class HybridBuffers:
    """One captured bucket's window and state inputs on the device, allocated once.

    Build it with `allocate` before capture, beside the bucket's
    `GraphBuffers`; `fill_hybrid_buffers` before each replay. Written in place: a
    `HybridInputs` from an earlier fill shows the newer values once the
    newer fill's copy has run, as the replay it fed did before it.

    Args:
        device: where the buffers live.
        kinds: the pools' memory kinds the buffers are laid out for.
        rows: the bucket's rows.
        tokens: the bucket's query tokens.
        window_pages: `kv_indices` entries: the most window pages all rows hold.
        block: the inputs' bytes on the device, one tensor (see the module).
        staging: the host bytes a fill lays a step out in (pinned on CUDA).
        copies: on CUDA, the event of the last copy out of `staging`, which
            the next fill waits on before it writes `staging` again.
    """

    device: torch.device
    kinds: MemoryKinds
    rows: int
    tokens: int
    window_pages: int
    block: torch.Tensor
    staging: torch.Tensor
    copies: list[torch.cuda.Event]

    @classmethod
    def allocate(
        cls,
        device: torch.device,
        kinds: MemoryKinds,
        *,
        rows: int,
        tokens: int,
        window_pages: int,
    ) -> Self:
        """Allocate the buffers of a bucket of `rows` rows and `tokens` tokens.

        `window_pages`: the most window pages the bucket's rows hold in all,
        e.g. `rows` times the pages of the longest context (`GraphBuffers`'
        `kv_capacity`).

        Raises:
            GraphBuffersError: a size below 1, or not an int; `kinds` not a `MemoryKinds`.
        """
        expect_instance(kinds, MemoryKinds, "HybridBuffers.allocate: kinds")
        for name, value in (("rows", rows), ("tokens", tokens), ("window_pages", window_pages)):
            if type(value) is not int or value < 1:  # a bool is no size
                raise GraphBuffersError(f"{name} must be an int >= 1, got {value!r}")
        size = sum(length * item for _, length, item in _layout(kinds, rows, tokens, window_pages))
        return cls(
            device,
            kinds,
            rows,
            tokens,
            window_pages,
            torch.zeros(size, dtype=torch.uint8, device=device),
            torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda"),
            [],
        )

    @property
    def nbytes(self) -> int:
        """Device bytes the buffers hold."""
        return int(self.block.numel())

    def __repr__(self) -> str:
        return (
            f"HybridBuffers(rows={self.rows}, tokens={self.tokens},"
            f" window_pages={self.window_pages}, {describe('block', self.block)})"
        )


def fill_hybrid_buffers(
    buffers: HybridBuffers, inputs: ForwardInputs, pools: Pools
) -> Result[HybridInputs, DoesNotFit]:
    """`hybrid_inputs(inputs, pools)`, written into the bucket's `buffers` in one copy.

    `inputs`: the bucket's padded forward (`fill_buffers`'s or `pad`'s `inputs`).
    The window and state inputs take no allocation. The anchor copies
    (`HybridInputs.cached`) are not in the buffers: a forward that resumes
    from or publishes an anchor (an extend, chunk or mixed step with the
    prefix cache on; a decode never does) gets them uploaded apart, at
    addresses of their own, so it runs outside a captured graph, its copies
    before and after the forward as the reference engine performs them.

    Returns:
        The `HybridInputs` whose device sides are views of `buffers.block`,
        or `Failure(DoesNotFit)` with the buffers unchanged.

    Raises:
        TypeError: `buffers` or `inputs` is not of its type.
        GraphBuffersError: `inputs` on another device than the buffers, or
            pools of other memory kinds than theirs.
        ForwardInputsError, StalePools: as `hybrid_inputs`.

    >>> from batchstate import MemoryKinds, Req, SlidingWindow, RecurrentState, extend, idle
    >>> from batchstate import GraphBuffers, fill_buffers, make_pools
    >>> kinds = MemoryKinds((SlidingWindow(8, 64), RecurrentState(16, 4)))
    >>> pools = make_pools(4, 32, 64, torch.device("cpu"), page_size=4, memory=kinds)
    >>> batch, pools = extend(idle("cpu"), [Req(0, tuple(range(10)))], pools).unwrap()
    >>> cpu = torch.device("cpu")
    >>> graph = GraphBuffers.for_extend(cpu, 4, 1, 16, 8)
    >>> padded = fill_buffers(graph, batch, pools.table).unwrap()
    >>> buffers = HybridBuffers.allocate(cpu, kinds, rows=1, tokens=16, window_pages=8)
    >>> hybrid = fill_hybrid_buffers(buffers, padded.inputs, pools).unwrap()
    >>> hybrid.windows[0].kv_indices.device.tolist(), len(hybrid.windows[0].out_cache_loc)
    ([1, 2, 3], 16)
    """
    expect_instance(buffers, HybridBuffers, "fill_hybrid_buffers: buffers")
    hosts = hybrid_hosts(inputs, pools, "fill_hybrid_buffers")
    if inputs.device != buffers.device or pools.memory_kinds != buffers.kinds:
        raise GraphBuffersError(
            f"inputs on {inputs.device} with {pools.memory_kinds!r}; the buffers on"
            f" {buffers.device} with {buffers.kinds!r}"
        )
    layout = _layout(buffers.kinds, buffers.rows, buffers.tokens, buffers.window_pages)
    # `kv_starts` comes before `kv_indptr`: rows too many are reported as rows.
    for host, (what, capacity, _) in zip(hosts, layout, strict=True):
        if host.shape[0] > capacity:
            return Failure(DoesNotFit(what, int(host.shape[0]), capacity))
    # Before anything is written: a forward whose anchor is gone leaves the buffers as they were.
    cached = anchor_copies(inputs, pools)
    if buffers.copies:  # CUDA: the last step's copy out of the staging bytes, long done
        buffers.copies.pop().synchronize()
    staging = buffers.staging.numpy()
    offsets = _offsets(layout)
    for host, offset in zip(hosts, offsets, strict=True):
        staging[offset : offset + host.nbytes] = np.ascontiguousarray(host).view(np.uint8)
    # NOTE: the one upload, at fixed addresses.
    buffers.block.copy_(buffers.staging, non_blocking=True)
    if buffers.device.type == "cuda":
        buffers.copies.append(torch.cuda.Event())  # type: ignore[no-untyped-call]  # torch's
        buffers.copies[0].record()
    sides = [
        buffers.block[offset : offset + host.nbytes].view(torch_dtype(host.dtype))
        for host, offset in zip(hosts, offsets, strict=True)
    ]
    return Success(hybrid_of(inputs, pools, hosts, sides, cached))


def _layout(
    kinds: MemoryKinds, rows: int, tokens: int, window_pages: int
) -> list[tuple[str, int, int]]:
    # (what, capacity, bytes per entry) of each array, in `hybrid_hosts`' order.
    layout: list[tuple[str, int, int]] = []
    for _ in kinds.windows:
        sizes = (rows, rows + 1, window_pages, tokens)
        layout += [
            (what, size, np.dtype(dtype).itemsize)
            for what, size, dtype in zip(_WINDOW_WHAT, sizes, _WINDOW_DTYPES, strict=True)
        ]
    layout += [("rows", rows, 8) for _ in kinds.states]
    return layout


def _offsets(layout: list[tuple[str, int, int]]) -> list[int]:
    # Each array's byte offset in the block: int64 arrays first, so every view is aligned.
    order = sorted(range(len(layout)), key=lambda index: -layout[index][2])
    offsets = [0] * len(layout)
    start = 0
    for index in order:
        _, capacity, item = layout[index]
        offsets[index] = start
        start += capacity * item
    return offsets
