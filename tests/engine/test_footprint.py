"""A run's memory estimate bounds what it allocates; the command refuses runs that cannot fit."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Final

import pytest
import torch

import batchstate.cli._checks
import batchstate.cli._run
import batchstate.engine
from batchstate import GraphBuffers, Pools
from batchstate.cli import main
from batchstate.engine import (
    EngineConfig,
    SimulationConfig,
    WorkloadConfig,
    footprint,
    make_kv_cache,
    make_model,
    simulate,
)
from batchstate.engine.footprint import Footprint, estimate

GIB: Final = 1 << 30
_POOL_PARTS: Final = (
    "the request-to-token table",
    "the table's device side",
    "the free page list",
    "the free slot list",
    "the KV cache",
)


def _pool_bytes(pools: Pools) -> int:
    """What make_pools and make_kv_cache really allocated, host and device sides."""
    return sum(
        array.nbytes
        for array in (
            pools.table.host,
            pools.table.device,
            pools.page_list._buffer,
            pools.slot_list._buffer,
            pools.slot_tokens,
        )
    )


def _parts(estimated: Footprint, names: tuple[str, ...]) -> int:
    return sum(part.bytes for part in estimated.parts if part.what in names)


@pytest.mark.parametrize(
    "config",
    [
        SimulationConfig(),
        SimulationConfig(num_kv_tokens=8192, max_reqs=200, max_context_len=4096),
        SimulationConfig(num_kv_tokens=65536, page_size=1, engine=EngineConfig(max_running=4)),
    ],
)
def test_the_pool_parts_bound_what_the_pools_and_kv_cache_allocate(
    config: SimulationConfig,
) -> None:
    pools = config.make_pools(torch.device("cpu"))
    assert isinstance(pools, Pools)
    cache = make_kv_cache(make_model(config.model), pools)
    allocated = _pool_bytes(pools) + cache.k.nbytes + cache.v.nbytes
    estimated = _parts(estimate(config), _POOL_PARTS)
    assert allocated <= estimated <= 2 * allocated


@pytest.mark.parametrize(
    ("workload", "max_running"),
    [
        (WorkloadConfig(num_requests=300), 32),
        (WorkloadConfig(num_requests=300, prompt_len=(48, 48), output_len=(48, 48)), 32),
        (WorkloadConfig(num_requests=60, prompt_len=(48, 48), output_len=(48, 48)), 1),
    ],
)
def test_the_request_part_bounds_what_a_run_holds(
    workload: WorkloadConfig, max_running: int
) -> None:
    """tracemalloc's peak over a whole run (bookkeeping on meta), within 4x of the estimate."""
    config = SimulationConfig(
        workload=workload,
        engine=EngineConfig(max_running=max_running),
        num_kv_tokens=4096,
        device="meta",
    )
    simulate(SimulationConfig(workload=WorkloadConfig(num_requests=2), device="meta"))  # warm
    tracemalloc.start()
    try:
        simulate(config)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    estimated = _parts(estimate(config), ("the requests and their tokens",))
    assert peak <= estimated <= 4 * peak


def test_each_rank_holds_a_whole_run_and_a_process() -> None:
    one, four = estimate(SimulationConfig()), estimate(SimulationConfig(), ranks=4)
    assert four.host_bytes == 4 * one.host_bytes + 4 * footprint.PROCESS_BYTES


def test_meta_allocates_no_table_device_side_nor_kv_cache() -> None:
    parts = {part.what for part in estimate(SimulationConfig(device="meta")).parts}
    assert parts.isdisjoint({"the table's device side", "the KV cache"})


def test_available_memory_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  2048 kB\nMemAvailable:  1024 kB\n")
    assert footprint.available_memory(meminfo) == 1024 * 1024
    fallback = footprint.available_memory(tmp_path / "missing")  # sysconf, or None
    assert fallback is None or fallback > 0


@pytest.fixture
def eight_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with 8 GiB available, where no run may start (each must be refused first)."""

    def must_not_run(*_: object) -> None:
        raise AssertionError("the simulation ran")

    monkeypatch.setattr(footprint, "available_memory", lambda: 8 * GIB)
    monkeypatch.setattr(batchstate.engine, "simulate", must_not_run)
    monkeypatch.setattr(batchstate.cli._run, "simulate_dp", must_not_run)


@pytest.mark.usefixtures("eight_gib")
@pytest.mark.parametrize(
    ("args", "what", "option"),
    [
        (["--kv-tokens", "99999999999984"], "the KV cache", "--kv-tokens"),
        (
            # --max-running is at most --kv-tokens; on meta the KV cache allocates nothing.
            ["--max-running", "100000000", "--kv-tokens", "100000000", "--device", "meta"],
            "the request-to-token table",
            "--max-running",
        ),
        (["--max-reqs", "100000000"], "the request-to-token table", "--max-reqs"),
        (["--max-context-len", "100000000"], "the request-to-token table", "--max-context-len"),
        (["--requests", "3000000"], "the requests and their tokens", "--requests"),
        (["--prompt-len", "20000", "20000", "--kv-tokens", "40960"], "the oracle", "--prompt-len"),
        (["--dp", "64"], "the rank processes", "--dp"),
    ],
)
def test_a_run_too_big_for_the_machine_is_refused_in_one_line(
    args: list[str], what: str, option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchstate simulate: error: the run may need ")
    assert f"({what}" in err and "more than the 8.0 GiB available here" in err
    assert err.endswith(f": lower {option}\n") and err.count("\n") == 1


@pytest.mark.usefixtures("eight_gib")
def test_more_requests_than_one_run_holds_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--requests", "100000000", "--device", "meta"]) == 2
    assert capsys.readouterr().err == (
        "batchstate simulate: error: --requests 100000000 is above 10000000,"
        " the most one run holds: lower --requests\n"
    )


def test_the_default_run_is_small() -> None:
    assert estimate(SimulationConfig()).host_bytes < 64 << 20


def test_a_cuda_run_is_checked_against_the_free_device_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = SimulationConfig(device="cuda", num_kv_tokens=1 << 24)  # 16 GiB of KV
    monkeypatch.setattr(footprint, "available_memory", lambda: 64 * GIB)
    monkeypatch.setattr(batchstate.cli._checks, "cuda_free_bytes", lambda: 8 * GIB)
    with pytest.raises(ValueError, match=r"of cuda memory \(the KV cache\), more than the 8.0 GiB"):
        batchstate.cli._checks.check_footprint(config, 1)
    monkeypatch.setattr(batchstate.cli._checks, "cuda_free_bytes", lambda: 32 * GIB)
    batchstate.cli._checks.check_footprint(config, 1)  # fits


@pytest.mark.parametrize(("ranks", "warned"), [(4, False), (5, True), (64, True)])
def test_many_more_ranks_than_cores_get_one_warning_line(
    ranks: int, warned: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Above twice the cores a run starts, after one stderr line that says why it is slow."""
    monkeypatch.setattr(footprint, "available_memory", lambda: 64 * GIB)
    monkeypatch.setattr(batchstate.cli._run, "cores", lambda: 2)
    monkeypatch.setattr(batchstate.cli._run, "simulate_dp", lambda *_: 0)
    assert main(["simulate", "--dp", str(ranks)]) == 0
    err = capsys.readouterr().err
    expected = (
        f"batchstate simulate: warning: --dp {ranks} starts {ranks} processes on 2 cores;"
        " the ranks step together, so each step waits for them all: expect it to be slow\n"
    )
    assert err == (expected if warned else "")


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_bucket_parts_are_every_bucket_a_run_may_allocate(page_size: int) -> None:
    """Per captured size, a decode bucket and an extend bucket per row count below it (up
    to --max-running), with their input ids: the estimate is their bytes exactly, and a
    whole run holds less."""
    config = SimulationConfig(
        workload=WorkloadConfig(num_requests=24),
        engine=EngineConfig(max_running=3),
        page_size=page_size,
        cuda_graph_sizes=(1, 4, 16),
        oracle=False,
    )
    pools = config.make_pools(torch.device("cpu"))
    max_pages = -(-pools.max_context_len // page_size)
    every = [
        GraphBuffers.for_decode(torch.device("cpu"), page_size, t, max_pages) for t in (1, 4, 16)
    ]
    every += [
        GraphBuffers.for_extend(torch.device("cpu"), page_size, rows, t, max_pages)
        for t in (4, 16)
        for rows in range(1, min(t - 1, 3) + 1)
    ]
    estimated = estimate(config)
    device = _parts(estimated, ("the captured buckets' buffers",))
    ids = sum(8 * buffers.tokens for buffers in every)  # each bucket's input ids, int64
    assert device == sum(buffers.nbytes for buffers in every) + ids
    staging = _parts(estimated, ("the captured buckets' staging bytes",))
    assert staging == sum(buffers.staging.nbytes for buffers in every)
    run = simulate(config)
    assert run.feeder is not None and run.feeder.buckets.buffers
    held = run.feeder.buckets.buffers.values()
    assert sum(buffers.nbytes + 8 * buffers.tokens for buffers in held) <= device
