"""Requests prefilled elsewhere: admitted by `admit_prefilled`, KV transferred, then decoded.

Their tokens must still equal the model run alone, whether they decode to
the end or are retracted and re-prefilled here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Final

import attrs
import pytest
import torch

from batchstate import (
    Decoding,
    Extended,
    Filtered,
    Idle,
    Mixed,
    Pools,
    Sampled,
    Sampling,
    make_pools,
)
from batchstate.cli import main
from batchstate.engine import (
    Engine,
    EngineConfig,
    ModelTokens,
    RandomTokens,
    SimulationConfig,
    TinyModel,
    WorkloadConfig,
    make_kv_cache,
    make_workload,
    simulate,
)
from batchstate.engine._alone import prefill_alone
from batchstate.engine._sources import _params
from tests.engine_oracle import PassThrough, alone_outputs, tiny_model

LONGEST: Final = 40 + 40
# Staggered arrivals; every request fits a table of LONGEST tokens.
SHAPE: Final = WorkloadConfig(
    num_requests=120, arrival_rate=3.0, prompt_len=(4, 40), output_len=(2, 40)
)
HALF: Final = attrs.evolve(SHAPE, prebuilt=0.5, sampling="mixed")
ALL: Final = attrs.evolve(SHAPE, prebuilt=1.0)
PLAIN: Final = EngineConfig(check_every=10)
MIXED: Final = EngineConfig(check_every=10, chunk_size=16, mixed=True)
CHUNKED: Final = EngineConfig(check_every=10, chunk_size=16, mixed=False)


def _tight(config: EngineConfig) -> EngineConfig:
    # Nothing reserved at admission: decode outgrows the pool and retracts.
    return attrs.evolve(config, new_token_ratio=0.0, headroom_pages=0)


def _engine(workload: WorkloadConfig, config: EngineConfig, page_size: int, kv: int) -> Engine:
    pools = make_pools(config.max_running, LONGEST, kv, torch.device("cpu"), page_size)
    tokens = ModelTokens(tiny_model(), make_kv_cache(tiny_model(), pools))
    return Engine(config, make_workload(workload), pools, tokens)


@pytest.mark.parametrize(
    ("workload", "config", "page_size", "kv"),
    [
        (HALF, PLAIN, 1, 4096),
        (HALF, PLAIN, 16, 4096),
        (ALL, MIXED, 16, 4096),
        (HALF, _tight(PLAIN), 1, 400),
        (ALL, _tight(PLAIN), 16, 480),
        (HALF, _tight(MIXED), 1, 400),
        (ALL, _tight(MIXED), 16, 480),
        (HALF, _tight(CHUNKED), 16, 480),
    ],
    ids=[
        "half-plain-1",
        "half-plain-16",
        "all-mixed-16",
        "half-plain-1-tight",
        "all-plain-16-tight",
        "half-mixed-1-tight",
        "all-mixed-16-tight",
        "half-chunked-16-tight",
    ],
)
def test_prebuilt_arrivals_match_the_oracle(
    workload: WorkloadConfig, config: EngineConfig, page_size: int, kv: int
) -> None:
    """Each prebuilt arrival is admitted once by a prebuilt step; every request matches."""
    engine = _engine(workload, config, page_size, kv)
    engine.run()
    assert engine.outputs == alone_outputs(workload)
    specs = make_workload(workload)
    assert engine.trace.prebuilt_requests == sum(spec.prebuilt for spec in specs) > 0
    assert 0 < engine.trace.prebuilt_steps <= engine.trace.prebuilt_requests
    assert engine.pools.num_free_slots == config.max_running
    assert engine.pools.num_free_tokens == kv
    tight = config.headroom_pages == 0
    assert (engine.trace.num_retractions > 0) == tight
    if workload.prebuilt == 1.0:
        # No prompt is computed here unless a retracted prebuilt request is re-prefilled.
        assert (engine.trace.prefill_computed > 0) == tight


def test_a_prebuilt_step_runs_no_forward_and_the_next_decodes_its_rows() -> None:
    """Every request prebuilt, roomy pools: no extend ever runs; each prebuilt step is a
    transfer alone, and the next forward (after any other prebuilt steps) decodes its rows."""
    calls: list[tuple[str, tuple[int, ...]]] = []
    pools = make_pools(32, LONGEST, 4096, torch.device("cpu"), 16)
    source = _Recording(ModelTokens(tiny_model(), make_kv_cache(tiny_model(), pools)), calls)
    engine = Engine(PLAIN, make_workload(ALL), pools, source)
    engine.run()
    assert engine.outputs == alone_outputs(ALL)
    kinds = [kind for kind, _ in calls]
    assert "extend" not in kinds
    assert kinds.count("transfer") == engine.trace.prebuilt_steps
    assert len(calls) == len(engine.trace)  # one token-source call per step
    forwards = [(at, call) for at, call in enumerate(calls) if call[0] != "transfer"]
    for at, (kind, rids) in enumerate(calls):
        if kind == "transfer":
            after, next_rids = next(call for later, call in forwards if later > at)
            assert after == "decode"
            unfinished = {rid for rid in rids if len(engine.outputs[rid]) > 1}
            assert unfinished <= set(next_rids)


def test_the_oracle_catches_a_transfer_that_writes_no_kv() -> None:
    """First tokens right, KV left unwritten: the decoded tokens after them differ."""
    pools = make_pools(32, LONGEST, 4096, torch.device("cpu"), 16)
    source = _NoKV(ModelTokens(tiny_model(), make_kv_cache(tiny_model(), pools)), tiny_model())
    engine = Engine(PLAIN, make_workload(HALF), pools, source)
    engine.run()
    expected = alone_outputs(HALF)
    prebuilt = [spec.rid for spec in make_workload(HALF) if spec.prebuilt]
    assert all(engine.outputs[rid][0] == expected[rid][0] for rid in prebuilt)
    assert sum(engine.outputs[rid] != expected[rid] for rid in prebuilt) > len(prebuilt) // 2


def test_the_prefill_server_samples_the_first_token_as_the_oracle_does() -> None:
    """`prefill_alone` hands over the oracle's first token, and K/V for every prompt position
    (no state: this model has no state layer)."""
    for spec in make_workload(HALF)[:20]:
        token, k, v, states = prefill_alone(tiny_model(), spec.prompt, spec.sampling)
        assert token == alone_outputs(HALF)[spec.rid][0]
        config = tiny_model().config
        shape = (config.num_layers, len(spec.prompt), config.num_heads, config.head_dim)
        assert tuple(k.shape) == tuple(v.shape) == shape
        assert states.shape[0] == 0


def test_params_round_trip_through_the_columns() -> None:
    specs = make_workload(HALF)
    columns = Sampling.of([spec.sampling for spec in specs], torch.device("cpu"))
    again = Sampling.of([_params(columns, row) for row in range(len(specs))], torch.device("cpu"))
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        assert getattr(columns, name).host.tolist() == getattr(again, name).host.tolist()


@pytest.mark.parametrize("config", [PLAIN, MIXED, _tight(CHUNKED)])
def test_meta_runs_prebuilt_arrivals_without_reading_the_device(config: EngineConfig) -> None:
    """RandomTokens draws the first tokens; on meta any device read would raise."""
    workload = WorkloadConfig(num_requests=100, prebuilt=0.5)
    run = simulate(
        SimulationConfig(workload=workload, engine=config, device="meta", num_kv_tokens=512)
    )
    assert run.pools_conserved and len(run.outputs) == 100
    assert run.trace.prebuilt_requests == sum(spec.prebuilt for spec in run.specs) > 0
    assert run.trace.device_reads == 0 and run.trace.num_audited > 0


def test_random_tokens_draw_one_first_token_per_row() -> None:
    workload = attrs.evolve(SHAPE, num_requests=4, arrival="all", prebuilt=1.0)
    pools = make_pools(4, LONGEST, 512, torch.device("meta"), 16)
    source = _Recording(RandomTokens(96, 0), [])
    Engine(PLAIN, make_workload(workload), pools, source).run()
    kind, rids = source.calls[0]
    assert kind == "transfer" and len(rids) == 4


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill-steps", "mixed"])
def test_prebuilt_arrivals_run_with_overlap_and_the_cache(mixed: bool) -> None:
    """A transferred row's first token joins the device tokens; its pages are published."""
    workload = attrs.evolve(SHAPE, num_requests=12, prebuilt=0.5, shared_prefixes=2)
    specs = make_workload(workload)
    pools = make_pools(12, LONGEST + 16, 512, torch.device("meta"), 16, prefix_cache=True)
    config = EngineConfig(chunk_size=16, mixed=mixed, overlap=True, check_every=1)
    engine = Engine(config, specs, pools, RandomTokens(96, 0))
    engine.run()
    assert len(engine.outputs) == len(specs)
    assert engine.trace.prebuilt_requests > 0 and engine.trace.overshoot_tokens > 0
    assert engine.pools.num_free_slots == engine.pools.max_reqs


def test_the_workload_marks_first_turns_only_and_keeps_its_draws() -> None:
    base = WorkloadConfig(num_requests=200, follow_ups=0.3)
    plain = make_workload(base)
    assert not any(spec.prebuilt for spec in plain)
    for share in (0.5, 1.0):
        specs = make_workload(attrs.evolve(base, prebuilt=share))
        assert [attrs.evolve(spec, prebuilt=False) for spec in specs] == list(plain)
        assert not any(spec.prebuilt for spec in specs if spec.follows is not None)
        marked = sum(spec.prebuilt for spec in specs)
        first_turns = sum(spec.follows is None for spec in specs)
        assert (marked == first_turns) if share == 1.0 else (0 < marked < first_turns)


@pytest.mark.parametrize("share", [-0.1, 1.5, math.nan])
def test_the_share_is_validated(share: float) -> None:
    with pytest.raises(ValueError, match=r"--prebuilt must be in \[0, 1\]"):
        WorkloadConfig(prebuilt=share).validate()


CLI: Final = ["simulate", "--requests", "24", "--no-progress", "--kv-tokens", "512"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prebuilt", "1.5"], "--prebuilt must be in [0, 1], got 1.5"),
        (["--prebuilt", "-1"], "--prebuilt must be in [0, 1], got -1.0"),
        (["--prebuilt", "nan"], "--prebuilt must be in [0, 1], got nan"),
        (["--prebuilt", "x"], "argument --prebuilt: invalid float value: 'x'"),
    ],
)
def test_bad_prebuilt_options_get_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*CLI, *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "mode",
    [[], ["--chunk-size", "0", "--no-overlap"], ["--mixed", "--shared-prefix", "2", "16", "0.5"]],
)
def test_cli_runs_prebuilt_arrivals_and_reports_them(
    mode: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*CLI, "--json", "--prebuilt", "0.5", *mode]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["oracle_passed"] is True and summary["ok"] is True
    assert 0 < summary["prebuilt_steps"] <= summary["prebuilt_requests"] < 24
    steps = summary["extend_steps"] + summary["decode_steps"] + summary["prebuilt_steps"]
    assert steps == summary["steps"]
    assert main([*CLI, "--prebuilt", "1", "--device", "meta", *mode]) == 0
    out = capsys.readouterr().out
    assert "prebuilt            24 requests arrived prefilled" in out
    assert " prebuilt)\n" in out


@attrs.define
class _Recording(PassThrough):
    """Passes every call through, recording its kind and the rows' request ids."""

    calls: list[tuple[str, tuple[int, ...]]]

    def after_extend(self, batch: Extended[Sampling], pools: Pools) -> list[int]:
        self.calls.append(("extend", tuple(batch.rows.rids.tolist())))
        return self.inner.after_extend(batch, pools)

    def after_decode(
        self, batch: Decoding[Sampling], pools: Pools, last_tokens: Sequence[int]
    ) -> list[int]:
        self.calls.append(("decode", tuple(batch.rows.rids.tolist())))
        return self.inner.after_decode(batch, pools, last_tokens)

    def after_mixed(
        self, batch: Mixed[Sampling], pools: Pools, sampling: Sampling | None
    ) -> Sampled:
        self.calls.append(("mixed", tuple(batch.rows.rids.tolist())))
        return self.inner.after_mixed(batch, pools, sampling)

    def transfer(
        self, batch: Filtered[Sampling], pools: Pools, prompts: Sequence[Sequence[int]]
    ) -> list[int]:
        self.calls.append(("transfer", tuple(batch.rows.rids.tolist())))
        return self.inner.transfer(batch, pools, prompts)

    def after_idle(self, batch: Idle[Sampling] | Filtered[Sampling]) -> None:
        self.calls.append(("idle", ()))
        self.inner.after_idle(batch)


@attrs.define
class _NoKV(PassThrough):
    """A prefill server that hands over the right first tokens but no KV."""

    model: TinyModel

    def transfer(
        self, batch: Filtered[Sampling], pools: Pools, prompts: Sequence[Sequence[int]]
    ) -> list[int]:
        columns = batch.rows.columns
        return [
            prefill_alone(self.model, prompt, _params(columns, row))[0]
            for row, prompt in enumerate(prompts)
        ]
