"""A Hugging Face transformers architecture through the engine, against transformers.generate.

The mode matrix's workload (shared prefixes, follow-up turns, a KV pool small
enough that requests are retracted and cached pages evicted) runs on
transformers' `LlamaForCausalLM` and `Qwen3ForCausalLM` (grouped-query
attention: four query heads share two K/V heads; Qwen3 adds RMSNorm on each
head's queries and keys), small and seeded, in float32. Only attention and
the KV cache are the engine's. Every request's tokens must equal what
transformers' own `generate` gives it alone, with no near-tie allowed
(`num_near_ties == 0`): the comparison is exact in every cell here.

Skipped, saying why, where transformers is not installed (the `hf` extra).
"""

from __future__ import annotations

import itertools
import json
import sys
from typing import Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import GREEDY, SamplingParams, flush
from batchstate.cli import main
from batchstate.engine import (
    NEAR_TIE,
    Attend,
    DataParallelConfig,
    Engine,
    EngineConfig,
    MissingExtra,
    ModelConfig,
    ModelTokens,
    SamplingMix,
    Simulation,
    SimulationConfig,
    WorkloadConfig,
    build_model,
    check_oracle,
    launch,
    make_kv_cache,
    make_workload,
    simulate,
)
from batchstate.engine._alone import AloneRun
from batchstate.engine._hf_model import HfModel
from batchstate.engine._model import FeedForward
from batchstate.engine._oracle import near_tie

pytest.importorskip(
    "transformers",
    reason="transformers is not installed (the hf extra: pip install 'batchstate[hf]')",
)

LLAMA: Final = ModelConfig(architecture="llama", dtype="float32", kv_groups=2)
QWEN3: Final = attrs.evolve(LLAMA, architecture="qwen3")
WORKLOAD: Final = WorkloadConfig(
    num_requests=12,
    arrival="all",
    prompt_len=(4, 20),
    output_len=(8, 16),
    shared_prefixes=2,
    shared_prefix_len=16,
    shared_fraction=0.6,
    follow_ups=0.3,
    seed=3,
)
GRAPH_SIZES: Final = (1, 2, 4, 8, 16, 32, 64)
Mode = tuple[bool, int, bool, bool, int]  # prefix cache, chunk size, mixed, overlap, drafts
MODES: Final[list[Mode]] = list(
    itertools.product((False, True), (0, 8), (False, True), (False, True), (0, 2))
)
EVERYTHING: Final[Mode] = (True, 8, True, True, 2)  # SGLang's default step, speculating


def _name(mode: Mode) -> str:
    cache, chunk, mixed, overlap, drafts = mode
    return "-".join(
        (
            "cache" if cache else "no-cache",
            f"chunk{chunk}" if chunk else "whole",
            "mixed" if mixed else "apart",
            "overlap" if overlap else "read",
            f"spec{drafts}" if drafts else "no-spec",
        )
    )


def _config(model: ModelConfig, mode: Mode, page_size: int = 16) -> SimulationConfig:
    cache, chunk, mixed, overlap, drafts = mode
    engine = EngineConfig(
        max_running=12,
        chunk_size=chunk,
        mixed=mixed,
        overlap=overlap,
        speculative=drafts,
        check_every=1,
        new_token_ratio=0.0,
        headroom_pages=0,
    )
    return SimulationConfig(
        workload=WORKLOAD,
        engine=engine,
        model=model,
        num_kv_tokens=96 if page_size == 1 else 128,  # a few requests at a time: retractions
        page_size=page_size,
        prefix_cache=cache,
    )


def _assert_exact(run: Simulation, mode: Mode) -> None:
    assert run.oracle is not None and run.oracle.passed, run.oracle
    assert run.oracle.num_near_ties == 0, run.oracle  # token for token, no tie excused
    assert run.oracle.num_checked == run.config.workload.num_requests
    assert run.trace.num_checks == len(run.trace) + 1
    pools = flush(run.pools)
    assert pools.num_free_slots == pools.max_reqs
    assert pools.num_free_tokens == pools.num_pages * pools.page_size
    cache, _, _, _, drafts = mode
    if cache:
        assert run.trace.cache_hits > 0
    if drafts:
        assert run.trace.speculative_steps > 0
    assert max(run.trace.forward_sizes()) >= 3  # requests ran together


def test_llama_with_every_mode_on_matches_generate() -> None:
    """The quick suite's real-model cell: cache, chunks, mixed steps, overlap, drafts."""
    _assert_exact(simulate(_config(LLAMA, EVERYTHING)), EVERYTHING)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES, ids=_name)
def test_every_mode_runs_llama_token_for_token(mode: Mode) -> None:
    _assert_exact(simulate(_config(LLAMA, mode)), mode)


# The ragged kernel (the prefix read before the step's write), page size 1, padding to
# captured sizes, prebuilt arrivals and sampled requests, each on a few modes.
Cell = tuple[ModelConfig, Mode, int, tuple[int, ...], float, SamplingMix]
CELLS: Final[list[Cell]] = [
    (attrs.evolve(LLAMA, attention="ragged"), EVERYTHING, 16, (), 0.0, "greedy"),
    (attrs.evolve(LLAMA, attention="ragged"), (True, 0, False, False, 0), 1, (), 0.0, "greedy"),
    (
        attrs.evolve(LLAMA, attention="ragged"),
        (True, 8, True, True, 0),
        16,
        GRAPH_SIZES,
        0.0,
        "greedy",
    ),
    (LLAMA, (True, 8, False, True, 2), 1, (), 0.0, "greedy"),
    (LLAMA, (False, 8, True, False, 0), 1, GRAPH_SIZES, 0.0, "greedy"),
    (LLAMA, (False, 0, False, True, 0), 16, GRAPH_SIZES, 0.5, "greedy"),
    (LLAMA, EVERYTHING, 16, (), 0.0, "mixed"),
    (LLAMA, (False, 0, False, False, 0), 1, (), 0.0, "mixed"),
    (QWEN3, EVERYTHING, 16, (), 0.0, "greedy"),
    (QWEN3, (False, 0, False, False, 0), 16, (), 0.0, "greedy"),
    (QWEN3, (True, 8, False, False, 2), 1, (), 0.0, "greedy"),
    (QWEN3, (False, 8, True, True, 0), 16, GRAPH_SIZES, 0.5, "greedy"),
    (attrs.evolve(QWEN3, attention="ragged"), EVERYTHING, 16, (), 0.0, "mixed"),
    (attrs.evolve(QWEN3, attention="ragged"), (True, 0, True, False, 2), 1, (), 0.0, "greedy"),
]


def _cell_name(cell: Cell) -> str:
    model, mode, page_size, sizes, prebuilt, sampling = cell
    padded = "-graphs" if sizes else ""
    extra = f"-prebuilt{prebuilt}" if prebuilt else ""
    kernel = f"{model.architecture}-{model.attention}"
    return f"{kernel}-{_name(mode)}-page{page_size}{padded}{extra}-{sampling}"


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=[_cell_name(cell) for cell in CELLS])
def test_kernels_padding_prebuilt_and_sampling_run_the_real_models_token_for_token(
    cell: Cell,
) -> None:
    model, mode, page_size, sizes, prebuilt, sampling = cell
    config = _config(model, mode, page_size)
    workload = attrs.evolve(WORKLOAD, prebuilt=prebuilt, sampling=sampling)
    run = simulate(attrs.evolve(config, workload=workload, cuda_graph_sizes=sizes))
    _assert_exact(run, mode)
    if sizes:
        assert run.feeder is not None and run.feeder.padded_forwards > 0
    if sampling == "mixed":
        assert any(spec.sampling.temperature > 0 for spec in run.specs)


# Qwen3 with a sliding-window first layer (transformers' layer_types) through the engine's
# window pages: a window of 8, shorter than most requests, and window token slots few
# enough (the mode matrix's hybrid sizes) that window pressure retracts too.
SLIDING: Final = attrs.evolve(QWEN3, layer_kinds=("window", "full"), window=8)
WINDOW_TOKENS: Final = {1: 80, 16: 96}
SlidingCell = tuple[Mode, int, tuple[int, ...], float]
SLIDING_CELLS: Final[list[SlidingCell]] = [
    ((False, 0, False, False, 0), 16, (), 0.0),
    ((False, 8, True, True, 2), 16, (), 0.0),
    ((True, 8, True, True, 2), 1, (), 0.0),  # rows resume from the cache's window tails
    ((True, 8, False, True, 0), 16, (), 0.0),
    ((False, 8, False, False, 2), 1, GRAPH_SIZES, 0.5),  # padded, prebuilt window tails
]


def _sliding_name(cell: SlidingCell) -> str:
    mode, page_size, sizes, prebuilt = cell
    extras = ("-graphs" if sizes else "") + ("-prebuilt" if prebuilt else "")
    return f"{_name(mode)}-page{page_size}{extras}"


def _sliding_config(cell: SlidingCell) -> SimulationConfig:
    mode, page_size, sizes, prebuilt = cell
    config = _config(SLIDING, mode, page_size)
    return attrs.evolve(
        config,
        workload=attrs.evolve(WORKLOAD, prebuilt=prebuilt),
        num_window_tokens=WINDOW_TOKENS[page_size],
        cuda_graph_sizes=sizes,
    )


@pytest.mark.slow
@pytest.mark.parametrize("cell", SLIDING_CELLS, ids=_sliding_name)
def test_qwen3_with_a_sliding_window_layer_runs_token_for_token(cell: SlidingCell) -> None:
    run = simulate(_sliding_config(cell))
    _assert_exact(run, cell[0])
    if cell[2]:
        assert run.feeder is not None and run.feeder.padded_forwards > 0


@pytest.mark.slow
def test_a_window_one_longer_fails_the_sliding_window_oracle() -> None:
    """The window matters: generate with a window of 9 disagrees with the engine's 8."""
    run = simulate(attrs.evolve(_sliding_config(SLIDING_CELLS[0]), oracle=False))
    wider = build_model(attrs.evolve(SLIDING, window=9))
    requests = {spec.rid: (run.prompts[spec.rid], spec.max_new_tokens) for spec in run.specs}
    result = check_oracle(wider, requests, run.outputs, 0)
    assert result.num_mismatched > 0, result


@pytest.mark.slow
def test_the_real_model_cells_retract() -> None:
    """The pool is small enough that decode retracts requests, re-prefilled exactly."""
    run = simulate(_config(LLAMA, (False, 0, False, False, 0), 1))
    assert run.trace.num_retractions > 0
    _assert_exact(run, (False, 0, False, False, 0))


@pytest.mark.slow
def test_two_ranks_run_llama_token_for_token() -> None:
    config = attrs.evolve(
        _config(LLAMA, EVERYTHING), workload=attrs.evolve(WORKLOAD, num_requests=16)
    )
    run = launch(config, DataParallelConfig(2), show_progress=False)
    assert run.oracle is not None and run.oracle.passed, run.oracle
    assert run.oracle.num_near_ties == 0


def test_positions_off_by_one_fail_the_oracle() -> None:
    """The oracle sees rotary positions: every position after a request's first one too far
    (a decode fed its row's length, not its last index) changes the tokens. Rotary
    attention sees only differences of positions, so shifting all of them would not."""
    model = build_model(LLAMA)
    assert isinstance(model, HfModel)

    class Shifted:
        config, device = model.config, model.device
        mlp, greedy, sample, first_layers = (
            model.mlp,
            model.greedy,
            model.sample,
            model.first_layers,
        )

        def hidden(
            self,
            input_ids: torch.Tensor,
            positions: torch.Tensor,
            attend: Attend,
            feed_forward: FeedForward | None = None,
        ) -> torch.Tensor:
            shifted = torch.where(positions > 0, positions + 1, positions)
            return model.hidden(input_ids, shifted, attend, feed_forward)

    config = _config(LLAMA, (False, 0, False, False, 0))
    pools = config.make_pools(torch.device("cpu"))
    shifted = Shifted()
    engine = Engine(
        config.engine_config,
        make_workload(WORKLOAD),
        pools,
        ModelTokens(shifted, make_kv_cache(shifted, pools)),
    )
    engine.run()
    specs = make_workload(WORKLOAD)
    requests = {spec.rid: (engine.prompts[spec.rid], spec.max_new_tokens) for spec in specs}
    result = check_oracle(model, requests, engine.outputs, 0)
    assert result.num_mismatched > WORKLOAD.num_requests // 2, result


def test_the_engines_logits_are_within_rounding_of_generates() -> None:
    """What NEAR_TIE is measured against: the engine's attention over the request's own
    cache, token by token, against generate's logits, on both architectures."""
    prompt = (5, 17, 3, 44, 9, 61, 2, 30)
    for config in (LLAMA, QWEN3):
        model = build_model(config)
        assert isinstance(model, HfModel)
        tokens, logits = model.generate(prompt, 12, -1, GREEDY)
        run = AloneRun(model)
        fed: tuple[int, ...] = prompt
        worst = 0.0
        for step, token in enumerate(tokens):
            ids = torch.tensor(fed)
            positions = torch.arange(run.length, run.length + len(fed))
            hidden = model.hidden(ids, positions, run._attend)[-1:]
            run.length += len(fed)
            ours = model.logits(hidden)[0]
            worst = max(worst, float((ours - logits[step]).abs().max()))
            assert int(ours.argmax()) == token
            fed = (token,)
        assert worst < NEAR_TIE / 10, worst
        assert len(set(tokens)) > 3  # the random model's outputs vary


def test_a_difference_past_a_near_tie_is_a_mismatch() -> None:
    logits = [torch.tensor([0.0, 1.0, 1.0 - NEAR_TIE / 2, 0.5])]
    assert near_tie((2,), (1,), logits)
    assert not near_tie((3,), (1,), logits)  # 0.5 below: no rounding explains it
    assert not near_tie((1, 2), (1,), logits)  # a length differs


def test_check_oracle_names_generate_and_counts_a_mismatch() -> None:
    model = build_model(LLAMA)
    prompt = (5, 6, 7, 8)
    expected = check_oracle(model, {0: (prompt, 6)}, {}, 0)
    assert expected.num_mismatched == 1 and "transformers.generate" in expected.first_mismatch


def test_sampled_requests_draw_as_the_engine_does() -> None:
    """generate with the engine's draw gives the engine's alone path's tokens."""
    model = build_model(LLAMA)
    assert isinstance(model, HfModel)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7)
    tokens, _ = model.generate((5, 6, 7, 8), 10, -1, params)
    run = AloneRun(model, params)
    alone = [run.next_token((5, 6, 7, 8))]
    while len(alone) < 10:
        alone.append(run.next_token(alone[-1:]))
    assert list(tokens) == alone
    greedy, _ = model.generate((5, 6, 7, 8), 10, -1, GREEDY)
    assert tokens != greedy


def test_without_transformers_build_model_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingExtra, match=r"pip install 'batchstate\[hf\]'"):
        build_model(LLAMA)


def test_without_transformers_simulate_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util  # noqa: PLC0415

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    assert main(["simulate", "--model", "llama", "--requests", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'batchstate[hf]'" in err and "Traceback" not in err


def test_meta_runs_the_bookkeeping_of_a_real_model_config_without_reading_the_device() -> None:
    config = attrs.evolve(_config(LLAMA, EVERYTHING), device="meta")
    run = simulate(config)
    assert run.oracle is None
    assert run.trace.device_reads == 0
    assert np.all(np.asarray(run.trace.forward_sizes()) > 0)


def test_the_command_line_runs_qwen3_with_a_sliding_window_layer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--model", "qwen3", "--window", "8", "--requests", "4", "--json"]
    assert main([*argv, "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model"] == "qwen3" and summary["oracle_passed"] is True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--model", "llama", "--window", "8"], "sliding-window layers are Qwen3's"),
        (["--model", "qwen3", "--window-tokens", "64"], "give --window too"),
    ],
)
def test_window_options_a_model_cannot_take_are_usage_errors(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *options, "--requests", "2", "--no-progress"]) == 2
    assert message in capsys.readouterr().err
