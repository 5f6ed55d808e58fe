"""`fill_hybrid_buffers`: a padded forward's window and state inputs, in a captured bucket's
buffers.

What `hybrid_inputs` builds fresh, written at fixed addresses: every step
of a bucket reads the same block, the values equal `hybrid_inputs`' on
both sides, a forward that does not fit changes nothing, and on `meta`
nothing is read from the device.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from immutables import Map
from returns.result import Failure

from batchstate import (
    DoesNotFit,
    ForwardInputsError,
    GraphBuffers,
    GraphBuffersError,
    HybridBuffers,
    HybridInputs,
    MemoryKinds,
    Pools,
    RecurrentState,
    Req,
    SlidingWindow,
    decode,
    extend,
    fill_buffers,
    fill_hybrid_buffers,
    hybrid_inputs,
    idle,
    make_pools,
    unwrap,
)
from batchstate.audit import device_reads
from tests.strategies import assert_unchanged, snapshot

CPU = torch.device("cpu")
KINDS = MemoryKinds((SlidingWindow(8, 512), RecurrentState(16, 8)))


def _pools(page_size: int, device: torch.device = CPU) -> Pools:
    return make_pools(8, 96, 1024, device, page_size, memory=KINDS)


def _sides(hybrid: HybridInputs) -> list[tuple[list[int], list[int]]]:
    pairs = [pair for window in hybrid.windows for pair in (
        window.kv_starts, window.kv_indptr, window.kv_indices, window.out_cache_loc
    )] + [state.state_indices for state in hybrid.states]  # fmt: skip
    return [(pair.host.tolist(), pair.device.tolist()) for pair in pairs]


@pytest.mark.parametrize("page_size", [1, 16])
def test_every_step_of_a_bucket_writes_hybrid_inputs_at_the_same_addresses(page_size: int) -> None:
    pools = _pools(page_size)
    reqs = [Req(rid, tuple(range(5 + 7 * rid))) for rid in range(3)]
    extended, pools = unwrap(extend(idle(CPU), reqs, pools))
    batch, pools = unwrap(decode(extended, pools))
    max_pages = -(-96 // page_size)
    graph = GraphBuffers.for_decode(CPU, page_size, 4, max_pages)
    buffers = HybridBuffers.allocate(CPU, KINDS, rows=4, tokens=4, window_pages=4 * max_pages)
    addresses = set()
    for _ in range(20):  # rows move past their windows: starts and pages change
        padded = unwrap(fill_buffers(graph, batch, pools.table))
        hybrid = unwrap(fill_hybrid_buffers(buffers, padded.inputs, pools))
        assert _sides(hybrid) == _sides(hybrid_inputs(padded.inputs, pools))
        window = hybrid.windows[0]
        assert window.kv_indptr.host[-1] == len(window.kv_indices)
        assert hybrid.states[0].state_indices.host.tolist()[3] == 0  # the padding row: slot 0
        block = buffers.block.data_ptr()
        sides = (window.kv_starts.device, window.out_cache_loc.device)
        assert all(block <= side.data_ptr() < block + buffers.nbytes for side in sides)
        addresses.add(tuple(side.data_ptr() for side in sides))
        batch, pools = unwrap(decode(batch, pools))
    assert len(addresses) == 1


def test_a_forward_too_large_for_the_buffers_changes_nothing() -> None:
    pools = _pools(4)
    batch, pools = unwrap(extend(idle(CPU), [Req(0, tuple(range(40)))], pools))
    padded = unwrap(fill_buffers(GraphBuffers.for_extend(CPU, 4, 1, 64, 24), batch, pools.table))
    buffers = HybridBuffers.allocate(CPU, KINDS, rows=1, tokens=64, window_pages=4)
    before = snapshot(buffers.block)
    refused = fill_hybrid_buffers(buffers, padded.inputs, pools)
    assert refused == Failure(DoesNotFit("window pages", 10, 4))
    assert_unchanged(before, buffers.block)


def test_a_forward_naming_a_gone_anchor_raises_before_the_buffers_are_written() -> None:
    """Anchor copies are named first: their `ForwardInputsError` leaves the buffers as they were."""
    pools = make_pools(8, 96, 1024, CPU, 4, prefix_cache=True, memory=KINDS)
    batch, pools = unwrap(extend(idle(CPU), [Req(0, tuple(range(41)))], pools))
    assert pools.memory.cached.anchors  # published at 40 by this forward
    padded = unwrap(fill_buffers(GraphBuffers.for_extend(CPU, 4, 1, 64, 24), batch, pools.table))
    buffers = HybridBuffers.allocate(CPU, KINDS, rows=1, tokens=64, window_pages=24)
    # Pools whose pending publish names an anchor they do not hold (made by hand: no
    # transition leaves one; `cached_copies` refuses it as a prefix read as if whole).
    cached = attrs.evolve(pools.memory.cached, anchors=Map(), lengths=Map())
    broken = pools.next_version(memory=attrs.evolve(pools.memory, cached=cached)).commit()
    before = snapshot(buffers.block), snapshot(buffers.staging)
    with pytest.raises(ForwardInputsError, match="no longer keeps"):
        fill_hybrid_buffers(buffers, padded.inputs, broken)
    assert_unchanged(before[0], buffers.block)
    assert_unchanged(before[1], buffers.staging)


def test_buffers_of_other_kinds_or_sizes_are_refused() -> None:
    pools = _pools(4)
    batch, pools = unwrap(extend(idle(CPU), [Req(0, (1, 2, 3))], pools))
    padded = unwrap(fill_buffers(GraphBuffers.for_extend(CPU, 4, 1, 8, 24), batch, pools.table))
    other = MemoryKinds((SlidingWindow(4, 512),))
    buffers = HybridBuffers.allocate(CPU, other, rows=1, tokens=8, window_pages=24)
    with pytest.raises(GraphBuffersError, match="with"):
        fill_hybrid_buffers(buffers, padded.inputs, pools)
    with pytest.raises(GraphBuffersError, match="rows must be an int >= 1"):
        HybridBuffers.allocate(CPU, KINDS, rows=0, tokens=8, window_pages=24)


def test_filling_reads_nothing_from_the_device() -> None:
    meta = torch.device("meta")
    pools = _pools(16, meta)
    extended, pools = unwrap(extend(idle(meta), [Req(0, tuple(range(30)))], pools))
    batch, pools = unwrap(decode(extended, pools))
    graph = GraphBuffers.for_decode(meta, 16, 2, 6)
    buffers = HybridBuffers.allocate(meta, KINDS, rows=2, tokens=2, window_pages=12)
    with device_reads(forbid=True) as log:
        padded = unwrap(fill_buffers(graph, batch, pools.table))
        hybrid = unwrap(fill_hybrid_buffers(buffers, padded.inputs, pools))
    assert log.report().count == 0
    # Positions 16 to 30 in page 2; the padding row reads the padding page 0.
    assert hybrid.windows[0].kv_indices.host.tolist() == [2, 0]
