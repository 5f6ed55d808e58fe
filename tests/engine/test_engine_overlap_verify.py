"""Speculation under overlap: each verify window is read once, a step later; the oracle exact."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch

from batchstate import Pools, Sampled, Sampling, Verified, Verifying, flush, make_pools
from batchstate.engine import (
    Acceptance,
    Engine,
    EngineConfig,
    ModelTokens,
    SimulationConfig,
    UnreadAcceptance,
    WorkloadConfig,
    make_kv_cache,
    make_workload,
    simulate,
)
from tests.engine_oracle import PassThrough, alone_outputs, tiny_model

WORKLOAD: Final = WorkloadConfig(
    num_requests=40, arrival_rate=2.0, prompt_len=(4, 30), output_len=(2, 30), seed=5
)


@attrs.define
class _Reads(PassThrough):
    """Counts each step's reads of tokens: sampled, verified (synced) and read ahead."""

    reads: list[str] = attrs.field(factory=list)

    def read(self, sampled: Sampled) -> list[int]:
        self.reads.append("sampled")
        return self.inner.read(sampled)

    def after_verify(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> Acceptance:
        self.reads.append("synced verify")
        return self.inner.after_verify(window, pools, committed, tokens)

    def read_acceptance(self, unread: UnreadAcceptance) -> Verified:
        self.reads.append("verified")
        return self.inner.read_acceptance(unread)


def _run(overlap: bool, page_size: int, num_kv_tokens: int) -> tuple[Engine, list[list[str]]]:
    pools = make_pools(16, 96, num_kv_tokens, torch.device("cpu"), page_size=page_size)
    source = _Reads(ModelTokens(tiny_model(), make_kv_cache(tiny_model(), pools)))
    config = EngineConfig(
        max_running=8,
        overlap=overlap,
        speculative=3,
        check_every=1,
        chunk_size=0,
        new_token_ratio=0.0,
        headroom_pages=0,
    )
    engine = Engine(config, make_workload(WORKLOAD), pools, source)
    per_step: list[list[str]] = []

    def after_step(_: int) -> None:
        per_step.append(source.reads.copy())
        source.reads.clear()

    engine.run(after_step)
    return engine, per_step


@pytest.mark.parametrize(("page_size", "num_kv_tokens"), [(1, 2048), (16, 2048), (1, 160)])
def test_overlapped_verify_reads_each_window_once_a_step_later(
    page_size: int, num_kv_tokens: int
) -> None:
    engine, per_step = _run(True, page_size, num_kv_tokens)
    assert engine.outputs == alone_outputs(WORKLOAD)
    trace = engine.trace
    assert trace.speculative_steps > 0
    # The small pool makes the bound miss KV: the window closes, and decode retracts.
    assert (trace.num_retractions > 0) == (num_kv_tokens < 1000)
    # Never the synced read; every verify window read exactly once; one read a step at most.
    flat = [kind for step in per_step for kind in step]
    assert "synced verify" not in flat
    assert flat.count("verified") == trace.speculative_steps
    assert max(len(step) for step in per_step) == 1
    # A window is read in the step after its forward, never in its own.
    assert not per_step[0]
    pools = flush(engine.pools)
    assert pools.num_free_slots == pools.max_reqs


def test_overlap_costs_speculation_no_steps_nor_concurrency() -> None:
    """Steps and rows per forward with overlap stay within 10% of the synced path's."""
    overlapped, _ = _run(True, 16, 2048)
    synced, _ = _run(False, 16, 2048)
    assert overlapped.outputs == synced.outputs
    assert len(overlapped.trace) <= 1.1 * len(synced.trace)
    sizes, synced_sizes = overlapped.trace.forward_sizes(), synced.trace.forward_sizes()
    assert sum(sizes) / len(sizes) >= 0.9 * sum(synced_sizes) / len(synced_sizes)


def test_overlapped_verify_reads_nothing_on_meta_but_the_named_read() -> None:
    """Every step audited on `meta`: verify_ahead, exact_window and sync with host counts
    read nothing (a read of `meta` data would raise), and each verify is read once."""
    config = SimulationConfig(
        workload=WORKLOAD,
        engine=EngineConfig(
            max_running=8, overlap=True, speculative=3, audit_every=1, check_every=1
        ),
        device="meta",
    )
    run = simulate(config)
    trace = run.trace
    # Every step whose forward ran rows was audited (a step with none is not).
    assert all(
        audited for audited, rows in zip(trace.audited, trace.batch_size, strict=True) if rows
    )
    assert trace.device_reads == 0
    assert trace.speculative_steps > 0
    assert trace.speculative_steps <= trace.named_reads <= len(trace)
