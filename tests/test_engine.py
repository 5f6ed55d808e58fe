"""The reference engine: every request's greedy tokens equal the model run alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import CachedPools, Decoding, Extended, Mixed, Pools, Sampled, make_pools
from batchstate.engine import (
    END_TOKEN,
    Engine,
    EngineConfig,
    ModelConfig,
    ModelTokens,
    RequestSpec,
    SimulationConfig,
    TinyModel,
    WorkloadConfig,
    generate_alone,
    make_kv_cache,
    make_model,
    make_workload,
    simulate,
)

MODEL: Final = ModelConfig()
# Staggered arrivals (poisson), finishes at max tokens or at END_TOKEN.
WORKLOAD: Final = WorkloadConfig(
    num_requests=200, arrival_rate=3.0, prompt_len=(4, 40), output_len=(2, 40)
)
LONGEST: Final = 40 + 40


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # A tiny model on 2 shared cores: extra intra-op threads only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@cache
def _model() -> TinyModel:
    return make_model(MODEL)


@cache
def _expected(workload: WorkloadConfig) -> dict[int, tuple[int, ...]]:
    # The oracle depends on the workload and the model only, not on the pools: compute it once.
    return {
        spec.rid: generate_alone(_model(), spec.prompt, spec.max_new_tokens, END_TOKEN)
        for spec in make_workload(workload)
    }


def _run(
    specs: Sequence[RequestSpec],
    pools: Pools,
    config: EngineConfig,
    corrupt: Callable[[Decoding], Decoding] | None = None,
) -> Engine:
    tokens = ModelTokens(_model(), make_kv_cache(_model(), pools))
    source = tokens if corrupt is None else _Corrupting(tokens, corrupt)
    engine = Engine(config, specs, pools, source)
    engine.run()
    return engine


@attrs.define
class _Corrupting:
    """A token source that hands the model a decode batch with one metadata value wrong."""

    inner: ModelTokens
    corrupt: Callable[[Decoding], Decoding]

    def after_extend(self, batch: Extended, pools: Pools | CachedPools) -> list[int]:
        return self.inner.after_extend(batch, pools)

    def after_decode(
        self, batch: Decoding, pools: Pools | CachedPools, last_tokens: Sequence[int]
    ) -> list[int]:
        return self.inner.after_decode(self.corrupt(batch), pools, last_tokens)

    def after_mixed(self, batch: Mixed, pools: Pools) -> Sampled:
        return self.inner.after_mixed(batch, pools)

    def read(self, sampled: Sampled) -> list[int]:
        return self.inner.read(sampled)


@pytest.mark.parametrize(
    ("page_size", "num_kv_tokens", "max_running", "optimistic", "runs_out"),
    [
        (1, 4096, 32, False, False),  # roomy, one token per page
        (16, 4096, 32, False, False),  # roomy, partly filled last pages
        # Memory runs out: nothing reserved at admission, so decode outgrows the pool and retracts.
        (1, 400, 32, True, True),
        (16, 480, 32, True, True),
        (16, LONGEST + 16, 8, True, True),  # one longest request fits: retract down to one
    ],
)
def test_engine_matches_oracle(
    page_size: int, num_kv_tokens: int, max_running: int, optimistic: bool, runs_out: bool
) -> None:
    """Hundreds of staggered requests match the oracle; memory is conserved; invariants hold."""
    pools = make_pools(max_running, LONGEST, num_kv_tokens, torch.device("cpu"), page_size)
    config = EngineConfig(max_running=max_running, check_every=25)
    if optimistic:
        config = attrs.evolve(config, new_token_ratio=0.0, headroom_pages=0)
    engine = _run(make_workload(WORKLOAD), pools, config)
    assert engine.outputs == _expected(WORKLOAD)
    assert (engine.trace.num_retractions > 0) == runs_out
    assert engine.pools.num_free_slots == max_running
    assert engine.pools.num_free_tokens == num_kv_tokens
    lengths = {len(tokens) for tokens in engine.outputs.values()}
    assert len(lengths) > 10  # requests finished at many different steps
    assert any(tokens[-1] == END_TOKEN for tokens in engine.outputs.values())


@pytest.mark.parametrize(
    ("chunk_size", "mixed", "overlap"),
    [(16, False, False), (16, True, False), (0, True, True), (16, True, True)],
    ids=["chunked", "chunked-mixed", "mixed-overlap", "chunked-mixed-overlap"],
)
@pytest.mark.parametrize(
    ("page_size", "num_kv_tokens", "max_running"),
    [(1, 4096, 32), (16, 4096, 32), (1, 400, 32), (16, LONGEST + 16, 8)],
    ids=["p1", "p16", "p1-retract", "p16-retract-to-one"],
)
def test_engine_modes_match_oracle(  # noqa: PLR0917  # pytest passes parameters by name
    chunk_size: int, mixed: bool, overlap: bool, page_size: int, num_kv_tokens: int,
    max_running: int,
) -> None:  # fmt: skip
    """Chunked prefill, mixed steps and overlap: every request matches the oracle, no leaks."""
    pools = make_pools(max_running, LONGEST, num_kv_tokens, torch.device("cpu"), page_size)
    config = EngineConfig(
        max_running=max_running, check_every=3, chunk_size=chunk_size, mixed=mixed,
        overlap=overlap,
    )  # fmt: skip
    if num_kv_tokens < 4096:
        config = attrs.evolve(config, new_token_ratio=0.0, headroom_pages=0)
    engine = _run(make_workload(WORKLOAD), pools, config)
    assert engine.outputs == _expected(WORKLOAD)
    trace = engine.trace
    assert (trace.num_retractions > 0) == (num_kv_tokens < 4096)
    assert trace.num_chunks > 0 or not chunk_size
    assert trace.num_mixed_steps > 0 or not mixed
    # Overlap decodes each request once past its stop (the token is dropped).
    assert trace.overshoot_tokens == (len(engine.outputs) if overlap else 0)
    assert engine.pools.num_free_tokens == num_kv_tokens
    assert trace.num_checks > 20  # check_leaks ran with every periodic check


def _swap_out_cache_loc(batch: Decoding) -> Decoding:
    locs = batch.out_cache_loc.device.clone()
    locs[[0, 1]] = locs[[1, 0]]
    return attrs.evolve(batch, out_cache_loc=attrs.evolve(batch.out_cache_loc, device=locs))


def _swap_req_pool_indices(batch: Decoding) -> Decoding:
    rows = batch.rows
    order = np.arange(len(rows))
    order[[0, 1]] = order[[1, 0]]
    swapped = rows.req_pool_indices.take(order)
    return attrs.evolve(batch, rows=attrs.evolve(rows, req_pool_indices=swapped))


def _shorten_seq_lens(batch: Decoding) -> Decoding:
    rows = batch.rows
    return attrs.evolve(batch, rows=attrs.evolve(rows, seq_lens=rows.seq_lens.add(-1)))


@pytest.mark.parametrize(
    "corrupt",
    [
        _swap_out_cache_loc,  # K/V written at another row's location
        _swap_req_pool_indices,  # rows read each other's table rows
        _shorten_seq_lens,  # positions and the causal mask one short
    ],
)
def test_wrong_metadata_fails_the_oracle(corrupt: Callable[[Decoding], Decoding]) -> None:
    """The model really reads the paged cache through the batch: one wrong value changes tokens."""
    workload = attrs.evolve(WORKLOAD, num_requests=24, arrival="all")
    pools = make_pools(24, LONGEST, 4096, torch.device("cpu"), 16)
    engine = _run(make_workload(workload), pools, EngineConfig(max_running=24), corrupt)
    expected = _expected(workload)
    assert sum(engine.outputs[rid] != expected[rid] for rid in expected) > 0


def test_meta_run_is_bookkeeping_only_and_conserves_memory() -> None:
    """A meta run (no model, seeded tokens) checks invariants every N steps and reads nothing."""
    config = SimulationConfig(
        workload=attrs.evolve(WORKLOAD, num_requests=600, arrival="burst", burst_size=50),
        engine=EngineConfig(
            max_running=48, check_every=10, audit_every=4, new_token_ratio=0.0, headroom_pages=0
        ),
        num_kv_tokens=1024,
        page_size=16,
        device="meta",
    )
    run = simulate(config)
    assert len(run.outputs) == 600
    assert run.pools_conserved
    assert run.trace.num_checks >= len(run.trace) // 10
    assert run.trace.num_retractions > 0
    assert run.trace.num_audited > 0 and run.trace.device_reads == 0
    assert run.oracle is None


def test_simulate_checks_the_oracle_on_cpu() -> None:
    """`simulate` on cpu runs the oracle itself and reports a pass."""
    config = SimulationConfig(workload=attrs.evolve(WORKLOAD, num_requests=30), num_kv_tokens=512)
    run = simulate(config)
    assert run.oracle is not None and run.oracle.passed and run.oracle.num_checked == 30


def test_generate_alone_stops_after_the_end_token() -> None:
    """The oracle stops at the end token, which it keeps as the last output."""
    model = _model()
    free = generate_alone(model, (5, 9, 2), 30, end_token=-1)
    stop = free[3]
    assert generate_alone(model, (5, 9, 2), 30, end_token=stop)[-1] == stop
    assert len(generate_alone(model, (5, 9, 2), 30, end_token=stop)) == free.index(stop) + 1
