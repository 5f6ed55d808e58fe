"""The prefix cache's anchors on hybrid pools: kept at release, evicted per kind, conserved,
and copied by padded engine forwards with the oracle exact."""

from __future__ import annotations

from typing import Final

import torch

from batchstate import (
    MemoryKinds,
    Pools,
    RecurrentState,
    Req,
    SlidingWindow,
    check_pools,
    decode,
    extend,
    forward_inputs,
    hybrid_inputs,
    idle,
    make_pools,
    release,
    split,
    unwrap,
)
from batchstate.engine import EngineConfig, SimulationConfig, WorkloadConfig, simulate
from batchstate.engine._model_config import HYBRID_LAYERS, ModelConfig

CPU: Final = torch.device("cpu")
PROMPT: Final = tuple(range(100, 140))  # 40 tokens: 10 pages of 4


def _pools(window_tokens: int = 512, num_states: int = 8) -> Pools:
    kinds = MemoryKinds((SlidingWindow(8, window_tokens), RecurrentState(16, num_states)))
    return make_pools(4, 128, 256, CPU, 4, prefix_cache=True, memory=kinds)


def test_a_row_released_on_a_page_boundary_keeps_its_tail_and_state_as_an_anchor() -> None:
    """Its own window pages of the tail and its own state slot become the anchor: no copy."""
    pools = _pools()
    first, pools = unwrap(extend(idle(CPU), [Req(0, PROMPT[:38])], pools))
    running, pools = unwrap(decode(first, pools))  # 39 tokens with KV
    running, pools = unwrap(decode(running, pools))  # 40: the last page is whole
    slot = int(running.rows.req_pool_indices.host[0])
    state = int(pools.memory.states[0].of_slot[slot])
    tail = pools.memory.windows[0].table[slot, 8:10].tolist()  # positions 32..39
    kept, left = split(running, [])
    pools = unwrap(release(left, kept, pools, [PROMPT]))
    anchor = pools.memory.cached.anchors[PROMPT]
    assert anchor.state == state and list(anchor.window_pages) == tail and not anchor.locks
    assert state not in pools.memory.states[0].free.ids.tolist()
    check_pools(pools)
    second, pools = unwrap(extend(idle(CPU), [Req(1, (*PROMPT, 5, 6))], pools))
    assert second.prefix_lens.tolist() == [40]
    copies = hybrid_inputs(forward_inputs(second, pools.table, pools.page_size), pools).cached[0]
    assert copies.state_from.host.tolist() == [state]
    assert copies.window_from.host.tolist() == tail
    check_pools(pools, [second])


def test_window_pressure_evicts_unlocked_anchors_but_never_a_locked_one() -> None:
    """A row's window pages falling short evict anchors, least recently used first; an
    anchor a new row resumes from stays until the row's forward copied it."""
    pools = _pools(window_tokens=48)  # 12 window pages: a row's prompt and a few anchors
    anchors = []
    for rid in range(3):  # three prompts of 17 tokens: an anchor of two pages at 16 each
        prompt = tuple(range(rid * 50, rid * 50 + 17))
        batch, pools = unwrap(extend(idle(CPU), [Req(rid, prompt)], pools))
        kept, left = split(batch, [])
        pools = unwrap(release(left, kept, pools))
        anchors.append(prompt[:16])
    assert set(pools.memory.cached.anchors) == set(anchors)
    assert pools.memory.cached.evictable() == (6, 3)
    # Resume from the last anchor while a long prompt needs most of the window pages.
    resumed = Req(10, (*anchors[2], 9))
    long = Req(11, tuple(range(500, 524)))  # 24 tokens: 6 window pages, the resumed 3
    batch, pools = unwrap(extend(idle(CPU), [resumed, long], pools))
    assert batch.prefix_lens.tolist() == [16, 0]
    cached = pools.memory.cached
    assert anchors[2] in cached.anchors and cached.anchors[anchors[2]].locks == 1
    assert cached.protected() == (2, 1)  # its two window pages and its state
    assert anchors[0] not in cached.anchors  # the least recently used went first
    assert cached.num_evicted >= 1
    check_pools(pools, [batch])


def test_padded_forwards_perform_the_anchor_copies_of_their_real_rows() -> None:
    """Padded to captured sizes, with mixed steps and drafts: the copies and checkpoints
    name the real rows' tokens, and every token stays exact."""
    workload = WorkloadConfig(
        num_requests=16,
        arrival="all",
        prompt_len=(8, 40),
        output_len=(8, 16),
        shared_prefixes=2,
        shared_prefix_len=16,
        shared_fraction=0.6,
        follow_ups=0.3,
    )
    engine = EngineConfig(max_running=8, chunk_size=8, mixed=True, speculative=2, check_every=1)
    config = SimulationConfig(
        workload=workload,
        engine=engine,
        model=ModelConfig(num_layers=len(HYBRID_LAYERS), layer_kinds=HYBRID_LAYERS, window=8),
        num_kv_tokens=2048,
        page_size=4,
        cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64),
    )
    run = simulate(config)
    assert run.oracle is not None and run.oracle.passed, run.oracle
    assert run.trace.cache_hits > 0
    assert run.feeder is not None and run.feeder.padded_tokens > 0
    assert run.pools_conserved
