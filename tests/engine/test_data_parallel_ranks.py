"""Data-parallel runs on real processes (gloo on the CPU): every rank steps, idle ones included."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from typing import Final

import pytest

from batchstate.cli import main
from batchstate.engine import (
    DataParallelConfig,
    DataParallelRun,
    EngineConfig,
    ModelConfig,
    SimulationConfig,
    WorkloadConfig,
    launch,
)

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

QUIET: Final = ["--no-progress", "--kv-tokens", "512"]


def _check_every_rank(run: DataParallelRun) -> None:
    # Every request ran on exactly one rank and matched the oracle; every rank
    # took part in every step and left its pools as it found them.
    assert run.oracle is not None and run.oracle.passed, run.oracle
    assert sorted(run.outputs) == sorted(spec.rid for spec in run.specs)
    assert sum(len(rank.outputs) for rank in run.ranks) == len(run.specs)
    for rank in run.ranks:
        assert rank.busy_steps + rank.idle_steps == run.steps
        assert rank.pools_conserved, rank.pools
        assert not rank.device_reads


def _timed_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, float]:
    # `batchstate simulate ARGS`: its exit status, its stderr, and how long it took.
    start = time.monotonic()
    code = main(["simulate", *args, *QUIET])
    return code, capsys.readouterr().err, time.monotonic() - start


def test_four_ranks_extend_decode_prebuilt_and_idle_in_one_step_and_match_the_oracle() -> None:
    """Whole-prompt extends, decodes and prebuilt arrivals: ranks differ in phase in one step."""
    config = SimulationConfig(
        workload=WorkloadConfig(
            num_requests=24, arrival_rate=0.3, output_len=(4, 24), prebuilt=0.3
        ),
        engine=EngineConfig(audit_every=4),
        num_kv_tokens=512,
    )
    run = launch(config, DataParallelConfig(4), show_progress=False)
    _check_every_rank(run)
    assert run.phase_mixes.get("decode+extend+idle", 0) > 0, run.phase_mixes
    assert any("prebuilt" in mix for mix in run.phase_mixes), run.phase_mixes
    assert all(rank.outputs for rank in run.ranks)  # least-loaded routing used every rank
    assert all(rank.audited_steps for rank in run.ranks if rank.busy_steps >= 4)


def test_a_rank_whose_requests_all_finish_keeps_stepping_idle() -> None:
    """Overlapped mixed steps, sampled tokens: the first rank to finish joins every later step."""
    config = SimulationConfig(
        workload=WorkloadConfig(num_requests=4, arrival="all", output_len=(2, 40),
                                sampling="mixed", seed=3),
        engine=EngineConfig(chunk_size=16, mixed=True, overlap=True),
        num_kv_tokens=512,
    )  # fmt: skip
    run = launch(config, DataParallelConfig(2), show_progress=False)
    _check_every_rank(run)
    early = min(run.ranks, key=lambda rank: rank.busy_steps)
    assert early.outputs and 0 < early.busy_steps < run.steps
    assert early.idle_steps == run.steps - early.busy_steps


def test_two_ranks_with_the_ragged_kernel_match_the_oracle() -> None:
    """The ragged kernel on ranks (chunked, mixed, overlapped, prefix cache on): each rank's
    forwards read their prefix before they write the step's KV, and the oracle stays exact."""
    config = SimulationConfig(
        workload=WorkloadConfig(num_requests=8, arrival="all", output_len=(2, 24), seed=5),
        engine=EngineConfig(chunk_size=16, mixed=True, overlap=True),
        model=ModelConfig(attention="ragged"),
        num_kv_tokens=512,
    )
    run = launch(config, DataParallelConfig(2), show_progress=False)
    _check_every_rank(run)
    assert all(rank.outputs for rank in run.ranks)


def test_more_ranks_than_requests_is_valid_and_the_extra_ranks_step_idle(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One request on four ranks: three ranks are idle from the first step to the last."""
    assert main(["simulate", "--dp", "4", "--requests", "1", "--json", *QUIET]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["num_ranks"] == 4 and summary["num_finished"] == 1
    assert summary["oracle_passed"] is True
    working = [rank for rank in summary["ranks"] if rank["requests"]]
    assert len(working) == 1 and working[0]["busy_steps"] == summary["steps"] > 0
    for rank in summary["ranks"]:
        if not rank["requests"]:
            assert (rank["busy_steps"], rank["idle_steps"]) == (0, summary["steps"])
    assert summary["idle_steps"] == 3 * summary["steps"]


def test_a_rank_that_raises_stops_every_rank_with_its_name_and_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No hang: the others fail in their next collective; the message names the first rank."""
    code, err, elapsed = _timed_main(["--dp", "3", "--requests", "12", "--dp-fault", "1:4",
                                      "--dp-timeout", "120"], capsys)  # fmt: skip
    assert code == 1
    assert "rank 1 failed: InjectedFault: injected in step 4; ranks 0, 2 stopped with it" in err
    assert "Traceback" not in err
    # Well inside the collective timeout: nobody waited for it. Start-up alone took
    # 27 s beside another test worker on two busy cores.
    assert elapsed < 90
    assert not multiprocessing.active_children()  # every rank process has ended


def test_a_rank_that_stops_answering_is_killed_after_the_timeout_and_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A hang, not a crash: the others time out in their collective; the silent rank is killed."""
    code, err, elapsed = _timed_main(["--dp", "2", "--requests", "6", "--dp-fault", "1:3:hang",
                                      "--dp-timeout", "3"], capsys)  # fmt: skip
    assert code == 1
    assert "rank 1 stopped answering and was killed; rank 0 timed out waiting" in err
    assert not multiprocessing.active_children()
    assert elapsed < 90  # the timeout and the grace period, plus start-up (31 s on busy cores)


def test_torchrun_launches_the_same_ranks() -> None:
    """Each torchrun process is one rank (read from the environment); rank 0 prints the summary."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "-m", "batchstate", "simulate", "--requests", "8", "--json",
         *QUIET],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["ok"] and summary["num_ranks"] == 2 and summary["num_finished"] == 8
