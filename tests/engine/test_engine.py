"""The reference engine: every request's tokens (greedy or sampled) equal the model run alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    GREEDY,
    Decoding,
    Pools,
    Sampling,
    SamplingParams,
    make_pools,
)
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
from batchstate.engine._sampler import sample_logits
from tests.engine_oracle import PassThrough, alone_outputs, tiny_model

# Staggered arrivals (poisson), finishes at max tokens or at END_TOKEN.
WORKLOAD: Final = WorkloadConfig(
    num_requests=200, arrival_rate=3.0, prompt_len=(4, 40), output_len=(2, 40)
)
LONGEST: Final = 40 + 40


def _run(
    specs: Sequence[RequestSpec],
    pools: Pools,
    config: EngineConfig,
    corrupt: Callable[[Decoding[Sampling]], Decoding[Sampling]] | None = None,
    model: TinyModel | None = None,
) -> Engine:
    model = tiny_model() if model is None else model
    tokens = ModelTokens(model, make_kv_cache(model, pools))
    source = tokens if corrupt is None else _Corrupting(tokens, corrupt)
    engine = Engine(config, specs, pools, source)
    engine.run()
    return engine


@attrs.define
class _Corrupting(PassThrough):
    """A token source that hands the model a decode batch with one metadata value wrong."""

    corrupt: Callable[[Decoding[Sampling]], Decoding[Sampling]]

    def after_decode(
        self, batch: Decoding[Sampling], pools: Pools, last_tokens: Sequence[int]
    ) -> list[int]:
        return self.inner.after_decode(self.corrupt(batch), pools, last_tokens)


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
    assert engine.outputs == alone_outputs(WORKLOAD)
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
    assert engine.outputs == alone_outputs(WORKLOAD)
    trace = engine.trace
    assert (trace.num_retractions > 0) == (num_kv_tokens < 4096)
    assert trace.num_chunks > 0 or not chunk_size
    assert trace.num_mixed_steps > 0 or not mixed
    # Overlap decodes each request once past its stop (the token is dropped).
    assert trace.overshoot_tokens == (len(engine.outputs) if overlap else 0)
    assert engine.pools.num_free_tokens == num_kv_tokens
    assert trace.num_checks > 20  # check_leaks ran with every periodic check


@pytest.mark.parametrize(
    ("config", "page_size", "num_kv_tokens", "max_running"),
    [
        (EngineConfig(chunk_size=16, mixed=True, overlap=True), 16, 4096, 32),
        (EngineConfig(chunk_size=16, new_token_ratio=0.0, headroom_pages=0), 1, 400, 32),
        (EngineConfig(mixed=True, overlap=True, headroom_pages=0), 16, LONGEST + 16, 8),
    ],
    ids=["p16-chunked-mixed-overlap", "p1-chunked-retract", "p16-mixed-overlap-retract-to-one"],
)
def test_the_ragged_kernel_matches_oracle(
    config: EngineConfig, page_size: int, num_kv_tokens: int, max_running: int
) -> None:
    """Attention over the step's K/V and the paged prefix, then the write: exact too, with
    every forward's contract checked before it runs (`check_every=1`)."""
    pools = make_pools(max_running, LONGEST, num_kv_tokens, torch.device("cpu"), page_size)
    config = attrs.evolve(config, max_running=max_running, check_every=1)
    model = make_model(ModelConfig(attention="ragged"))  # the default model's weights
    engine = _run(make_workload(WORKLOAD), pools, config, model=model)
    assert engine.outputs == alone_outputs(WORKLOAD)
    assert (engine.trace.num_retractions > 0) == (num_kv_tokens < 4096)
    assert engine.pools.num_free_tokens == num_kv_tokens


def _swap_out_cache_loc(batch: Decoding[Sampling]) -> Decoding[Sampling]:
    locs = batch.out_cache_loc.device.clone()
    locs[[0, 1]] = locs[[1, 0]]
    return attrs.evolve(batch, out_cache_loc=attrs.evolve(batch.out_cache_loc, device=locs))


def _swap_req_pool_indices(batch: Decoding[Sampling]) -> Decoding[Sampling]:
    rows = batch.rows
    order = np.arange(len(rows))
    order[[0, 1]] = order[[1, 0]]
    swapped = rows.req_pool_indices.take(order)
    return attrs.evolve(batch, rows=attrs.evolve(rows, req_pool_indices=swapped))


def _shorten_seq_lens(batch: Decoding[Sampling]) -> Decoding[Sampling]:
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
def test_wrong_metadata_fails_the_oracle(
    corrupt: Callable[[Decoding[Sampling]], Decoding[Sampling]],
) -> None:
    """The model really reads the paged cache through the batch: one wrong value changes tokens."""
    workload = attrs.evolve(WORKLOAD, num_requests=24, arrival="all")
    pools = make_pools(24, LONGEST, 4096, torch.device("cpu"), 16)
    engine = _run(make_workload(workload), pools, EngineConfig(max_running=24), corrupt)
    expected = alone_outputs(workload)
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
    model = tiny_model()
    free = generate_alone(model, (5, 9, 2), 30, end_token=-1)
    stop = free[3]
    assert generate_alone(model, (5, 9, 2), 30, end_token=stop)[-1] == stop
    assert len(generate_alone(model, (5, 9, 2), 30, end_token=stop)) == free.index(stop) + 1


SAMPLED: Final = attrs.evolve(WORKLOAD, sampling="mixed")


@pytest.mark.parametrize(
    ("page_size", "num_kv_tokens", "max_running", "config"),
    [
        (1, 4096, 32, EngineConfig()),
        (16, 4096, 32, EngineConfig()),
        (1, 400, 32, EngineConfig(new_token_ratio=0.0, headroom_pages=0)),
        (16, LONGEST + 16, 8, EngineConfig(new_token_ratio=0.0, headroom_pages=0)),
        (1, 400, 32, EngineConfig(chunk_size=16, mixed=True, new_token_ratio=0.0)),
        (16, 4096, 32, EngineConfig(chunk_size=16, mixed=True, overlap=True)),
        (16, LONGEST + 16, 8, EngineConfig(mixed=True, overlap=True, headroom_pages=0)),
    ],
    ids=[
        "p1", "p16", "p1-retract", "p16-retract-to-one", "p1-chunked-mixed-retract",
        "p16-chunked-mixed-overlap", "p16-overlap-retract-to-one",
    ],
)  # fmt: skip
def test_sampled_mix_matches_oracle(
    page_size: int, num_kv_tokens: int, max_running: int, config: EngineConfig
) -> None:
    """Each request samples with its own parameters and seed: its tokens equal the oracle's
    (the same parameters, run alone), whatever it was batched, chunked or retracted with."""
    pools = make_pools(max_running, LONGEST, num_kv_tokens, torch.device("cpu"), page_size)
    config = attrs.evolve(config, max_running=max_running, check_every=10)
    engine = _run(make_workload(SAMPLED), pools, config)
    assert engine.outputs == alone_outputs(SAMPLED)
    assert (engine.trace.num_retractions > 0) == (num_kv_tokens < 4096)
    assert engine.pools.num_free_tokens == num_kv_tokens
    # The mix really samples: many requests leave the greedy path, and the greedy ones don't.
    greedy = alone_outputs(WORKLOAD)
    specs = make_workload(SAMPLED)
    assert sum(engine.outputs[s.rid] != greedy[s.rid] for s in specs) > len(specs) // 3
    assert all(engine.outputs[s.rid] == greedy[s.rid] for s in specs if not s.sampling.temperature)


def test_sampled_mix_over_the_prefix_cache_matches_oracle() -> None:
    """Prefills over the cache admit the rows' Sampling columns; follow-ups and shared prefixes."""
    workload = attrs.evolve(
        SAMPLED, num_requests=80, shared_prefixes=3, shared_fraction=0.6, follow_ups=0.3
    )
    run = simulate(SimulationConfig(workload=workload, num_kv_tokens=1024, page_size=16))
    assert run.pools.cache.enabled and run.trace.cache_hits > 0
    assert run.oracle is not None and run.oracle.passed and run.oracle.num_checked == 80


def test_sampling_follows_temperature_and_seed() -> None:
    """Temperature 0 (any seed) and top-k 1 are greedy; sampling departs from greedy, the same
    seed repeats, and two seeds give two different outputs."""
    model, prompt = tiny_model(), (5, 9, 2, 17)

    def alone(params: SamplingParams) -> tuple[int, ...]:
        return generate_alone(model, prompt, 40, end_token=-1, sampling=params)

    greedy = alone(GREEDY)
    assert alone(SamplingParams(seed=7)) == greedy
    assert alone(SamplingParams(temperature=1.0, top_k=1, seed=7)) == greedy
    hot = alone(SamplingParams(temperature=1.0, seed=7))
    assert hot != greedy
    assert alone(SamplingParams(temperature=1.0, seed=7)) == hot
    assert alone(SamplingParams(temperature=1.0, seed=8)) != hot
    # A low temperature stays closer to greedy than a high one.
    cold = alone(SamplingParams(temperature=0.3, seed=7))
    assert sum(map(int.__eq__, cold, greedy)) > sum(map(int.__eq__, hot, greedy))


def test_a_rows_draw_does_not_depend_on_its_batch() -> None:
    """The sampler is row-wise: a row's token is the same alone and among other rows."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 96, generator=generator, dtype=torch.float64) * 3
    params = [
        GREEDY,
        SamplingParams(1.0, seed=1),
        SamplingParams(0.7, top_k=5, seed=2),
        SamplingParams(1.2, top_p=0.5, seed=3),
        SamplingParams(1.0, min_p=0.2, seed=4),
        SamplingParams(0.9, top_p=0.9, top_k=20, min_p=0.05, seed=5),
    ]
    positions = np.arange(10, 16, dtype=np.int64)
    cpu = torch.device("cpu")
    together = sample_logits(logits, Sampling.of(params, cpu), positions).tolist()
    alone = [
        int(sample_logits(logits[i : i + 1], Sampling.of([p], cpu), positions[i : i + 1])[0])
        for i, p in enumerate(params)
    ]
    assert together == alone
    assert together[0] == int(logits[0].argmax())


def test_sampling_mixes_leave_the_rest_of_the_workload_alone() -> None:
    """A sampling mix draws from a stream of its own: the same prompts, budgets and arrivals
    as the greedy workload; `mixed` samples about three quarters, each with its own seed."""
    greedy, mixed = make_workload(WORKLOAD), make_workload(SAMPLED)
    fixed = make_workload(
        attrs.evolve(WORKLOAD, sampling="fixed", fixed_sampling=SamplingParams(0.5, top_k=3))
    )
    for specs in (mixed, fixed):
        assert [attrs.evolve(s, sampling=GREEDY) for s in specs] == list(greedy)
    assert all(s.sampling == GREEDY for s in greedy)
    sampled = [s.sampling for s in mixed if s.sampling.temperature]
    assert 0.6 * len(mixed) < len(sampled) < 0.9 * len(mixed)
    assert len({p.seed for p in sampled}) == len(sampled)
    assert {(p.temperature, p.top_k) for p in (s.sampling for s in fixed)} == {(0.5, 3)}
