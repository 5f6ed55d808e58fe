"""The benchmark runs at tiny sizes, and its three implementations reach the same state.

No timing is asserted: benchmarks are not tests. Agreement is what keeps the
mutable baseline and the floor honest: each must do the work batchstate does.
"""

from __future__ import annotations

import numpy as np
import pytest
from benchmarks.check_cost import measure as measure_check_cost
from benchmarks.columns import VARIANTS
from benchmarks.columns import run as run_columns
from benchmarks.engine_feed import SIZES as FEED_SIZES
from benchmarks.engine_feed import run_once as run_engine_feed
from benchmarks.graph_buffers import count as count_graph_buffers
from benchmarks.graph_buffers import measure as measure_graph_buffers
from benchmarks.measure import (
    by_role,
    count_blocks,
    count_work,
    final_outcomes,
    implementations_carrying,
    time_config,
)
from benchmarks.production import final_outcomes as production_outcomes
from benchmarks.production import run as run_production
from benchmarks.profile import profile_point, profile_production
from benchmarks.sampling_values import request_sampling
from benchmarks.scenario import PHASES, Config
from benchmarks.step import run

from batchstate.engine import SimulationConfig, WorkloadConfig


@pytest.mark.parametrize(
    "config",
    [
        Config(1, 1),  # the last row finishes and a new one joins every step
        Config(8, 1),
        Config(8, 16),  # paged: new pages only where a row crosses a page boundary
        Config(33, 4),  # a batch that is not a multiple of anything
    ],
)
def test_implementations_agree(config: Config) -> None:
    """All three end with the same rows, lengths, slots, KV locations and free memory."""
    batchstate, mutable, floor = final_outcomes(config, num_steps=12)
    assert mutable == batchstate
    assert floor == batchstate
    assert batchstate.slots_device == batchstate.slots
    assert batchstate.seq_lens_device == batchstate.seq_lens
    assert batchstate.seq_lens_sum == sum(batchstate.seq_lens)


def _expected_sampling(rids: list[int]) -> list[tuple[float, float, int, float, int]]:
    # Each row's parameters as a float32 / int32 / int64 device column holds them.
    params = [request_sampling(rid) for rid in rids]
    as_f32 = {value: float(np.float32(value)) for value in (0.0, 0.7, 0.9)}
    return [
        (as_f32[p.temperature], as_f32[p.top_p], p.top_k, as_f32[p.min_p], p.seed) for p in params
    ]


@pytest.mark.parametrize("config", [Config(1, 1), Config(8, 16), Config(33, 4)])
def test_implementations_agree_with_sampling_columns(config: Config) -> None:
    """With `--columns sampling`, all three also hold each row's own parameters."""
    batchstate, mutable, floor = final_outcomes(config, num_steps=12, columns="sampling")
    assert mutable == batchstate
    assert floor == batchstate
    assert batchstate.sampling == _expected_sampling(batchstate.rids)


def test_without_columns_no_side_carries_sampling_parameters() -> None:
    assert all(outcome.sampling == [] for outcome in final_outcomes(Config(8, 1), 4))


@pytest.mark.parametrize("page_size", [1, 16])
def test_sampling_columns_cost_batchstate_one_upload_and_the_baseline_one_op_per_tensor(
    page_size: int,
) -> None:
    """On meta, with sampling columns: batchstate's counts stay, but for the joining
    request's columns (one more copy in extend); SGLang's `SamplingBatchInfo` adds a
    gather per tensor to filter, a concatenation per tensor to merge and an upload per
    tensor to extend (five tensors); the floor's packed rows one of each."""
    config = Config(8, page_size)
    plain = by_role(count_work(config, steps=4))
    sampled = by_role(count_work(config, 4, implementations_carrying("sampling")))
    work = sampled["batchstate"]
    copies = {phase: work[phase]["copies"] for phase in PHASES}
    assert copies == {"decode": 1, "filter": 1, "release": 0, "extend": 2, "merge": 1}
    kernels = {phase: work[phase]["kernels"] for phase in PHASES}
    assert kernels == {"decode": 1, "filter": 0, "release": 0, "extend": 1, "merge": 0}
    for name, tensors in (("mutable", 5), ("floor", 1)):
        before, after = plain[name], sampled[name]
        assert after["filter"]["kernels"] == before["filter"]["kernels"] + tensors
        assert after["merge"]["kernels"] == before["merge"]["kernels"] + tensors
        assert after["extend"]["copies"] == before["extend"]["copies"] + tensors
        assert after["step"]["kernels"] == before["step"]["kernels"] + 2 * tensors


def test_run_reports_every_point() -> None:
    """A tiny full run yields one summary per point, with ratios and the side counts."""
    points, extras = run([1, 4], [1, 16], repeats=4, warmup=1, quiet=True)
    assert [(p["page_size"], p["batch_size"]) for p in points] == [(1, 1), (1, 4), (16, 1), (16, 4)]
    for point in points:
        assert set(point["stats"]) == {"batchstate", "mutable", "floor"}
        step = point["stats"]["batchstate"]["step"]
        assert 0 < step["q1_us"] <= step["median_us"] <= step["q3_us"]
        medians = {name: stats["step"]["median_us"] for name, stats in point["stats"].items()}
        assert point["a_over_b"] == pytest.approx(medians["batchstate"] / medians["mutable"])
        assert point["a_over_c"] == pytest.approx(medians["batchstate"] / medians["floor"])
    assert set(extras["work"]) == {1, 16}
    assert set(extras["work"][1]) == {"batchstate", "mutable", "floor"}


def test_a_run_with_sampling_columns_reports_by_role() -> None:
    """With columns, the points and counts are keyed as without, and the bytes per
    request include every side's columns."""
    points, extras = run([2], [1], repeats=3, warmup=1, quiet=True, columns="sampling")
    _, plain = run([2], [1], repeats=3, warmup=1, quiet=True)
    assert set(points[0]["stats"]) == {"batchstate", "mutable", "floor"}
    assert extras["work"][1]["batchstate"]["step"]["copies"] == 5
    # Per row: three float32, one int32, one int64 on the device (24 bytes) on every side.
    for name in ("batchstate", "mutable", "floor"):
        assert extras["device_bytes"][name] == plain["device_bytes"][name] + 24
    assert extras["host_bytes"]["batchstate"] == plain["host_bytes"]["batchstate"] + 24


@pytest.mark.parametrize("interleave", [True, False])
def test_each_implementation_times_every_step_interleaved_or_alone(interleave: bool) -> None:
    timings = time_config(Config(4, 1), repeats=5, warmup=2, interleave=interleave)
    assert set(timings) == {"batchstate", "mutable", "floor"}
    for phases in timings.values():
        assert set(phases) == {*PHASES, "step"}
        assert all(len(durations) == 5 for durations in phases.values())


@pytest.mark.parametrize("page_size", [1, 16])
def test_batchstate_uploads_once_per_transition_and_launches_no_bookkeeping_kernels(
    page_size: int,
) -> None:
    """On meta: one host-to-device copy for each transition that builds columns, none for
    release; the only kernels are the table writes of decode and extend."""
    work = count_work(Config(8, page_size), steps=4)["batchstate"]
    copies = {phase: work[phase]["copies"] for phase in ("decode", "filter", "release", "extend")}
    assert copies == {"decode": 1, "filter": 1, "release": 0, "extend": 1}
    assert work["merge"]["copies"] == 1
    kernels = {phase: work[phase]["kernels"] for phase in ("decode", "extend", "filter", "merge")}
    assert kernels == {"decode": 1, "extend": 1, "filter": 0, "merge": 0}
    mutable = count_work(Config(8, page_size), steps=4)["mutable"]
    assert work["step"]["kernels"] <= mutable["step"]["kernels"]


def test_allocation_counter_sees_allocations() -> None:
    """Each implementation allocates Python objects every step; the counter sees them."""
    assert all(count > 0 for count in count_blocks(Config(4, 1), steps=3).values())


def test_a_column_set_adds_one_upload_per_step_and_no_kernel() -> None:
    """With Sampling or eight columns: the joining request's columns are the one extra copy."""
    names = ("batchstate", "batchstate+sampling", "batchstate+eight")
    plain, sampled, eight = (
        count_work(Config(8, 1), steps=4, implementations=[make])[name]["step"]
        for make, name in zip(VARIANTS, names, strict=True)
    )
    assert sampled["copies"] == eight["copies"] == plain["copies"] + 1
    assert sampled["kernels"] == eight["kernels"] == plain["kernels"]


def test_the_column_benchmark_reports_each_point() -> None:
    """A tiny run gives one row per point, with both timings and the counts."""
    rows = run_columns([1], [1], repeats=3, warmup=1)
    assert len(rows) == 3
    cells = rows[2].strip("|").split("|")
    assert [cell.strip() for cell in cells[:2]] == ["1", "1"]
    assert cells[7].strip() == "3 / 4 / 4"


@pytest.mark.parametrize(
    ("batch_size", "page_size", "turns"),
    [
        (1, 16, 30),  # the one running row finishes every iteration
        (8, 1, 30),
        (8, 16, 30),
        (33, 4, 60),  # a batch and a page size that are not multiples of anything
    ],
)
def test_production_step_implementations_agree(batch_size: int, page_size: int, turns: int) -> None:
    """With the prefix cache, chunked prefill and overlap, batchstate and the SGLang-style
    baseline end with the same rows, lengths, table rows, held chunk, free slots and pages
    (in hand-out order), cached pages with their lock counts, and device input tokens."""
    batchstate, mutable = production_outcomes(batch_size, page_size, turns)
    assert mutable == batchstate
    assert len(batchstate.rids) == batch_size  # steady state: one leaves, one joins
    assert batchstate.slots_device == batchstate.slots
    assert batchstate.seq_lens_device == batchstate.seq_lens
    # The cache filled up and evicted, so both chose the same least recently used pages.
    assert batchstate.num_evicted > 0
    assert batchstate.hits >= turns * 3 // 4  # new requests read a cached system prompt
    assert any(locks > 0 for _, locks in batchstate.cache.values())


@pytest.mark.parametrize(
    ("batch_size", "page_size", "turns"), [(1, 16, 30), (8, 1, 30), (33, 4, 60)]
)
def test_production_step_implementations_agree_with_sampling_columns(
    batch_size: int, page_size: int, turns: int
) -> None:
    """With sampling columns, the held chunk's parameters travel through the prefill, the
    settle's filter and the merge on both sides."""
    batchstate, mutable = production_outcomes(batch_size, page_size, turns, columns="sampling")
    assert mutable == batchstate
    assert batchstate.sampling == _expected_sampling(batchstate.rids)
    assert batchstate.num_evicted > 0


def test_the_production_benchmark_with_columns_reports_by_role() -> None:
    points = run_production(
        [2], [16], repeats=3, warmup=2, rounds=1, quiet=True, columns="sampling"
    )
    assert set(points[0]["best_us"]) == {"batchstate", "mutable", "floor"}
    assert points[0]["a_over_b"] > 0


def test_the_production_benchmark_reports_each_point() -> None:
    """A tiny run gives one point per (page, batch) with all three timed and both ratios."""
    points = run_production([1, 4], [1, 16], repeats=3, warmup=2, rounds=2, quiet=True)
    assert [(p["page_size"], p["batch_size"]) for p in points] == [(1, 1), (1, 4), (16, 1), (16, 4)]
    for point in points:
        steps = {name: best["step"] for name, best in point["best_us"].items()}
        assert set(steps) == {"batchstate", "mutable", "floor"}
        assert all(value > 0 for value in steps.values())
        assert point["a_over_b"] == pytest.approx(steps["batchstate"] / steps["mutable"])
        assert point["a_over_c"] == pytest.approx(steps["batchstate"] / steps["floor"])


def test_the_profile_lists_each_phase_and_the_functions_that_cost_most() -> None:
    report = profile_point(4, 1, num_steps=20, top=5)
    assert report.startswith("batch 4, page 1: median µs per phase: decode ")
    assert all(f"{phase} " in report.splitlines()[0] for phase in (*PHASES, "step"))
    table = [line for line in report.splitlines() if line.startswith("| `")]
    assert len(table) == 5


def test_the_production_profile_lists_functions_and_module_shares() -> None:
    report = profile_production(4, 1, num_turns=10, top=5)
    assert report.startswith("production, Sampling columns, batch 4, page 1: median cycle ")
    functions = [line for line in report.splitlines() if line.startswith("| `")]
    assert len(functions) == 10  # five functions, then five modules
    shares = [int(line.rsplit("|", 2)[1].strip(" %")) for line in functions[5:]]
    assert shares == sorted(shares, reverse=True) and sum(shares) <= 100


def test_the_graph_buffer_benchmark_reports_each_point() -> None:
    """At tiny sizes: a median per part and the ratios against the step (`fill_buffers` alone, since
    it reads the record; `forward_inputs` + `pad` together); on meta, `fill_buffers` launches its
    copies and fills in one upload and allocates nothing, `pad` allocates."""
    point = measure_graph_buffers(3, 8, 4, 5, 64)
    assert point["bucket"] == 4
    assert point["fill_ratio"] == pytest.approx(point["fill_us"] / point["decode_sampled_us"])
    assert point["pad_ratio"] == pytest.approx(
        (point["forward_inputs_us"] + point["pad_us"]) / point["decode_sampled_us"]
    )
    work = count_graph_buffers(3, 4)
    assert (work["copies"], work["allocations"]) == (1, 0)
    assert 0 < work["kernels"] <= 6 and work["pad_allocations"] > 0


def test_the_engine_feed_benchmark_times_both_ways() -> None:
    """A tiny simulate fed through the buckets and through the baseline: both time a feed."""
    workload = WorkloadConfig(num_requests=4, arrival="all", prompt_len=(4, 8), output_len=(2, 4))
    config = SimulationConfig(workload=workload, cuda_graph_sizes=FEED_SIZES, oracle=False)
    for baseline in (True, False):
        feed_us, step_ms = run_engine_feed(config, baseline=baseline)
        assert feed_us > 0 and step_ms > 0


def test_the_check_cost_benchmark_times_the_check_beside_the_step() -> None:
    point = measure_check_cost(4, 16, steps=3, warmup=2)
    assert point["step_us"] > 0 and point["check_us"] > 0
    assert point["ratio"] == pytest.approx(point["check_us"] / point["step_us"])
