"""The engine's attention reads only the forward inputs; padded to captured sizes, still exact."""

from __future__ import annotations

from typing import Any, Final

import attrs
import pytest

import batchstate
import batchstate.engine._feeder as feeder_module
from batchstate import DeviceOnly, ForwardInputs
from batchstate.engine import (
    DataParallelConfig,
    EngineConfig,
    SimulationConfig,
    WorkloadConfig,
    launch,
    simulate,
)
from batchstate.engine._dp_report import render_dp_summary, summarize_dp
from batchstate.engine._report import render_summary, summarize

SIZES: Final = (1, 2, 4, 8, 16, 32, 64)
WORKLOAD: Final = WorkloadConfig(
    num_requests=24, arrival_rate=3.0, prompt_len=(4, 40), output_len=(2, 24)
)
MODES: Final = {
    "mixed-chunks": (EngineConfig(max_running=8, chunk_size=16, mixed=True), WORKLOAD, 16),
    "whole-prompts": (EngineConfig(max_running=8), WORKLOAD, 1),
    "prefix-cache": (
        EngineConfig(max_running=8),
        attrs.evolve(WORKLOAD, shared_prefixes=2, shared_prefix_len=32, shared_fraction=0.6),
        16,
    ),
    "overlap-sampled": (
        EngineConfig(max_running=8, chunk_size=16, mixed=True, overlap=True),
        attrs.evolve(WORKLOAD, sampling="mixed"),
        64,
    ),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_padded_forwards_match_the_oracle(mode: str) -> None:
    """Every forward padded to the next captured size (on the CPU), every request exact."""
    engine, workload, page_size = MODES[mode]
    config = SimulationConfig(
        workload=workload,
        engine=engine,
        num_kv_tokens=1024,
        page_size=page_size,
        prefix_cache=mode == "prefix-cache",
        cuda_graph_sizes=SIZES,
    )
    run = simulate(config)
    assert run.oracle is not None and run.oracle.passed, run.oracle
    feeder = run.feeder
    assert feeder is not None
    assert feeder.padded_forwards + feeder.eager_forwards == feeder.forwards > 0
    assert feeder.padded_forwards > 0 and feeder.padded_tokens > 0
    summary = summarize(run)
    assert summary.cuda_graph_sizes == SIZES
    assert summary.padded_tokens_per_step == feeder.padded_tokens / feeder.forwards
    assert "cuda graphs         padded to sizes 1 2 4 8 16 32 64:" in render_summary(summary)


def test_a_wrong_page_list_breaks_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention takes its keys from kv_indices alone: swap two rows' pages, tokens change."""
    real = batchstate.forward_inputs

    def swapped(*args: Any) -> ForwardInputs:
        inputs = real(*args)
        pages = inputs.kv_indices.device
        return attrs.evolve(inputs, kv_indices=DeviceOnly(pages.flip(0)))

    monkeypatch.setattr(feeder_module, "forward_inputs", swapped)
    config = SimulationConfig(workload=WORKLOAD, engine=EngineConfig(max_running=8), page_size=4)
    run = simulate(config)
    assert run.oracle is not None and not run.oracle.passed


def test_meta_runs_pad_too_and_read_nothing() -> None:
    """On meta the forward inputs are built and padded every step, with no device read."""
    config = SimulationConfig(
        workload=WORKLOAD, engine=EngineConfig(max_running=8, audit_every=1), device="meta",
        cuda_graph_sizes=SIZES,
    )  # fmt: skip
    run = simulate(config)
    assert run.feeder is not None and run.feeder.padded_forwards > 0
    assert summarize(run).ok


def test_bad_sizes_are_a_config_error() -> None:
    """Sizes that are not strictly increasing positive ints: ValueError naming the option."""
    with pytest.raises(ValueError, match="--cuda-graph-sizes: captured sizes"):
        SimulationConfig(cuda_graph_sizes=(8, 4)).validate()


@pytest.mark.parametrize("drafts", [2])  # verify windows run eagerly beside padded forwards
def test_data_parallel_ranks_pad_to_the_largest_ranks_bucket(drafts: int) -> None:
    """Every rank pads its forward (an idle rank brings padding tokens) to the bucket of the
    largest rank's, so the shared layers see one size: a rank bringing another count would
    stop the run. Verify windows run eagerly beside them. The oracle stays exact."""
    config = SimulationConfig(
        workload=WORKLOAD,
        engine=EngineConfig(max_running=8, chunk_size=16, speculative=drafts),
        page_size=4,
        cuda_graph_sizes=SIZES,
    )
    run = launch(config, DataParallelConfig(2), show_progress=False)
    assert run.oracle is not None and run.oracle.passed
    summary = summarize_dp(run)
    assert summary.padded_forwards > 0 and summary.padded_tokens > 0
    assert "every rank to the bucket of the largest rank's forward" in render_dp_summary(summary)
