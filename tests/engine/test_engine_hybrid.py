"""`--model hybrid` in the engine: window pressure, what the oracle catches, refused options.

The mode matrix (`tests/engine/test_mode_matrix.py`) runs the hybrid model in
every mode, prebuilt arrivals, padded forwards and two data-parallel
ranks included; these check what it cannot show: that window pages alone
retract requests, that the oracle depends on the window (so a page given
back too early would fail it), and the options a hybrid run refuses as
usage errors.
"""

from __future__ import annotations

from typing import Final

import attrs
import pytest

from batchstate.cli import main
from batchstate.engine import (
    EngineConfig,
    SimulationConfig,
    WorkloadConfig,
    check_oracle,
    make_model,
    simulate,
)
from batchstate.engine._model_config import HYBRID_LAYERS, ModelConfig
from batchstate.engine._workload import END_TOKEN

HYBRID: Final = ModelConfig(num_layers=len(HYBRID_LAYERS), layer_kinds=HYBRID_LAYERS, window=8)
CONFIG: Final = SimulationConfig(
    workload=WorkloadConfig(num_requests=12, arrival="all", prompt_len=(4, 40), output_len=(8, 24)),
    engine=EngineConfig(max_running=12, chunk_size=8, check_every=1),
    model=HYBRID,
    num_kv_tokens=4096,  # never short of full-attention pages
    page_size=1,
    prefix_cache=False,
    num_window_tokens=48,  # about four rows' windows
)


def test_window_pressure_alone_retracts_and_the_oracle_stays_exact() -> None:
    run = simulate(CONFIG)
    assert run.oracle is not None and run.oracle.passed, run.oracle
    assert run.trace.num_retractions > 0  # KV is plentiful: the window pages ran short
    assert run.pools_conserved
    sizes = run.trace.forward_sizes()
    assert sum(sizes) / len(sizes) >= 1.4  # retraction did not serialise the rows


def test_the_oracle_depends_on_the_window() -> None:
    """The engine's tokens match a model of this window, and not one of a window shorter by one."""
    run = simulate(attrs.evolve(CONFIG, oracle=False))
    requests = {spec.rid: (run.prompts[spec.rid], spec.max_new_tokens) for spec in run.specs}
    assert check_oracle(make_model(HYBRID), requests, run.outputs, END_TOKEN).passed
    shorter = make_model(attrs.evolve(HYBRID, window=HYBRID.window - 1))
    assert not check_oracle(shorter, requests, run.outputs, END_TOKEN).passed


@pytest.mark.parametrize(("mixed", "drafts"), [(False, 0), (True, 2)])
def test_padded_forwards_keep_the_oracle_exact(mixed: bool, drafts: int) -> None:
    """Padded to captured sizes, padding rows and tokens past every row write the padding
    window page and state slot, and the real rows' tokens do not change. The window and state
    inputs are written into each bucket's `HybridBuffers`, as its `GraphBuffers` are."""
    engine = attrs.evolve(CONFIG.engine, mixed=mixed, speculative=drafts, overlap=True)
    sizes = (1, 2, 4, 8, 16, 32, 64)
    run = simulate(attrs.evolve(CONFIG, engine=engine, cuda_graph_sizes=sizes))
    assert run.oracle is not None and run.oracle.passed, run.oracle
    assert run.feeder is not None and run.feeder.padded_forwards > 0
    assert run.feeder.padded_tokens > 0
    buckets = run.feeder.buckets
    assert buckets.hybrid and set(buckets.hybrid) <= set(buckets.buffers)
    assert run.pools_conserved


# Shared headers and follow-up turns: prompts the prefix cache serves.
SHARING: Final = attrs.evolve(
    CONFIG.workload,
    num_requests=24,
    shared_prefixes=2,
    shared_prefix_len=16,
    shared_fraction=0.5,
    follow_ups=0.4,
)


def test_the_prefix_cache_saves_hybrid_prefills_and_the_oracle_stays_exact() -> None:
    """Follow-up turns and shared headers resume from the cache's anchors: fewer tokens
    computed than with the cache off, every token exact, the anchors' memory evictable."""
    roomy = attrs.evolve(CONFIG, workload=SHARING, num_window_tokens=None)  # no window pressure
    off = simulate(roomy)
    on = simulate(attrs.evolve(roomy, prefix_cache=True))
    for run in (off, on):
        assert run.oracle is not None and run.oracle.passed, run.oracle
        assert run.pools_conserved
    assert off.trace.cache_hits == 0
    assert on.trace.cache_hits >= 5
    assert on.trace.prefill_computed < off.trace.prefill_computed
    anchors = on.pools.memory.cached
    assert anchors.anchors  # finished with anchors cached: window tails and states
    assert anchors.num_states == len(anchors.anchors)


def test_prebuilt_arrivals_and_cached_prefixes_run_together_exactly() -> None:
    """Transferred window tails and states, and anchors resumed from, in one run."""
    workload = attrs.evolve(SHARING, prebuilt=0.5)
    run = simulate(attrs.evolve(CONFIG, workload=workload, prefix_cache=True))
    assert run.oracle is not None and run.oracle.passed, run.oracle
    assert run.pools_conserved
    assert run.trace.prebuilt_requests > 0
    assert run.trace.cache_hits > 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--no-prefix-cache", "--window-tokens", "40"], "--window-tokens 40 must be"),
        (["--no-prefix-cache", "--window", "0"], "--window 0 must be"),
        (["--no-prefix-cache", "--window", "100000"], "--window 100000 must be in [1,"),
        (["--no-prefix-cache", "--window-tokens", "99999999999984"], "lower --window-tokens"),
    ],
)
def test_hybrid_runs_refuse_what_they_cannot_do(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--model", "hybrid", "--requests", "4", "--device", "meta", *options]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--window", "--window-tokens"])
def test_window_options_need_the_hybrid_model(
    option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", option, "64", "--device", "meta"]) == 2
    assert f"{option} sizes the window layer of --model hybrid" in capsys.readouterr().err
