"""The scheduler policy is swappable: another order, victim or chunk budget, same bookkeeping.

Each test hands the engine a policy of its own and checks what a user
sees change (which request finishes first, whom decode retracts, how
prompts are cut into chunks) while every request's tokens still equal the
model run alone and the pools end empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import attrs
import pytest
import torch

from batchstate import Req, make_pools
from batchstate.engine import (
    Budget,
    Engine,
    EngineConfig,
    EngineError,
    FirstComeFirstServed,
    ModelTokens,
    SchedulerPolicy,
    WorkloadConfig,
    choose,
    make_kv_cache,
    make_workload,
)
from tests.engine_oracle import alone_outputs, tiny_model

WORKLOAD: Final = WorkloadConfig(
    num_requests=12, arrival="all", prompt_len=(4, 30), output_len=(4, 16), seed=11
)
LONGEST: Final = 30 + 16


@attrs.define
class ShortestFirst:
    """Shortest prompt first; decode retracts the row with the most output left."""

    chunk: int = 0  # prompt tokens per chunked step; 0: as the default policy
    victims: list[tuple[int, ...]] = attrs.field(factory=list)  # each retraction's remaining

    def order(self, waiting: Sequence[Req]) -> Sequence[Req]:
        return sorted(waiting, key=lambda req: len(req.input_ids))

    def admit(self, waiting: Iterable[Req], remaining: Iterable[int], budget: Budget) -> int:
        return choose(waiting, remaining, budget)

    def victim(self, rids: Sequence[int], remaining: Sequence[int]) -> int:
        self.victims.append(tuple(remaining))
        return max(range(len(rids)), key=lambda row: remaining[row])

    def chunk_budget(self, config: EngineConfig) -> int:
        return self.chunk or FirstComeFirstServed().chunk_budget(config)


def _run(config: EngineConfig, policy: SchedulerPolicy, kv_tokens: int = 2048) -> Engine:
    pools = make_pools(config.max_running, LONGEST, kv_tokens, torch.device("cpu"), 4)
    tokens = ModelTokens(tiny_model(), make_kv_cache(tiny_model(), pools))
    engine = Engine(config, make_workload(WORKLOAD), pools, tokens, policy=policy)
    engine.run()
    assert engine.outputs == alone_outputs(WORKLOAD)
    assert engine.pools.num_free_slots == config.max_running
    return engine


@pytest.mark.parametrize("overlap", [False, True])
def test_the_order_decides_who_finishes_first(overlap: bool) -> None:
    """One request at a time: first come first served finishes in arrival order, the
    swapped policy in prompt-length order."""
    config = EngineConfig(max_running=1, overlap=overlap)
    by_arrival = [spec.rid for spec in make_workload(WORKLOAD)]
    by_length = [
        spec.rid for spec in sorted(make_workload(WORKLOAD), key=lambda spec: len(spec.prompt))
    ]
    assert by_arrival != by_length
    assert list(_run(config, FirstComeFirstServed()).outputs) == by_arrival
    assert list(_run(config, ShortestFirst()).outputs) == by_length


@pytest.mark.parametrize("chunk_size", [0, 8])
def test_the_policy_names_whom_decode_retracts(chunk_size: int) -> None:
    """Under memory pressure each retraction takes the row with the most output left."""
    config = EngineConfig(
        max_running=8, chunk_size=chunk_size, new_token_ratio=0.0, headroom_pages=0
    )
    policy = ShortestFirst()
    engine = _run(config, policy, kv_tokens=128)
    assert engine.trace.num_retractions >= len(policy.victims) > 0
    default = _run(config, FirstComeFirstServed(), kv_tokens=128)
    assert default.trace.num_retractions > 0
    assert len(engine.trace) != len(default.trace)  # another victim, another schedule


def test_the_chunk_budget_comes_from_the_policy() -> None:
    """Whole prompts fit the default budget; a policy's 4-token budget cuts them into chunks."""
    config = EngineConfig(mixed=True)
    assert _run(config, FirstComeFirstServed()).trace.num_chunks == 0
    assert _run(config, ShortestFirst(chunk=4)).trace.num_chunks > 0


@attrs.define
class _NoSuchRow(ShortestFirst):
    def victim(self, rids: Sequence[int], remaining: Sequence[int]) -> int:
        return len(rids)


def test_a_victim_past_the_rows_is_refused() -> None:
    config = EngineConfig(max_running=8, new_token_ratio=0.0, headroom_pages=0)
    with pytest.raises(EngineError, match="the policy named row"):
        _run(config, _NoSuchRow(), kv_tokens=128)
