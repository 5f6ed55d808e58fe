"""Starting the ranks: spawned on this machine, or one per process under torchrun.

A rank that fails reports which rank it is and what it raised, then exits;
the others fail in their next collective (at once when the failed process
is gone, after the process-group timeout when it hangs) and report that
they lost a peer. `launch` names the rank that failed first.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import time
from multiprocessing.context import SpawnProcess
from multiprocessing.queues import Queue
from typing import Final, final

import attrs
import torch
import torch.multiprocessing as mp

from batchstate.engine._data_parallel import DataParallelConfig, DataParallelRun, run_rank
from batchstate.engine._dp_config import launched_by_torchrun
from batchstate.engine._progress import Progress
from batchstate.engine._ranks import PeerLost, join_ranks
from batchstate.engine._simulate import SimulationConfig
from batchstate.errors import Error

__all__ = ["RankFailed", "launch", "launched_by_torchrun", "run_launched"]

_GRACE_S: Final = 5.0  # beyond the collective timeout, before a silent rank is stopped
_POLL_S: Final = 0.1


class RankFailed(Error, RuntimeError):
    """A rank raised or died; every rank has stopped. The message names the first to fail."""


@final
@attrs.frozen
class _Report:
    rank: int
    run: DataParallelRun | None = None  # rank 0's assembled run, on success
    error: str = ""  # what the rank raised, on failure
    lost_peer: bool = False  # it failed because another rank stopped


def launch(
    config: SimulationConfig, dp: DataParallelConfig, *, show_progress: bool
) -> DataParallelRun:
    """Spawn `dp.ranks` processes on this machine, run the workload over them, collect rank 0's run.

    With `show_progress`, rank 0 draws progress bars on the stderr it shares.

    Raises:
        RankFailed: a rank raised or died; every rank has been stopped.
    """
    context = mp.get_context("spawn")
    reports: Queue[_Report] = context.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, dp.ranks, init_method, config, dp, reports, show_progress),
            name=f"batchstate-rank-{rank}",
        )
        for rank in range(dp.ranks)
    ]
    for process in processes:
        process.start()
    try:
        heard = _collect(processes, reports, dp.timeout_s + _GRACE_S)
    finally:
        for process in processes:
            process.join(timeout=_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
    return _result(heard, processes)


def run_launched(
    config: SimulationConfig, dp: DataParallelConfig, *, show_progress: bool
) -> DataParallelRun | None:
    """Run this process's rank of a torchrun launch; rank 0 returns the run, the others None.

    Raises:
        RankFailed: this rank raised, or lost a peer (torchrun stops the others).
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != dp.ranks:
        raise RankFailed(f"--dp {dp.ranks} but torchrun started {world} ranks")
    local_rank = int(os.environ["LOCAL_RANK"])
    report = _run(rank, world, "env://", config, dp, show_progress, local_rank)
    if report.error:
        raise RankFailed(_describe([report]))
    return report.run


def _rank_main(  # noqa: PLR0917  # a spawned process's arguments, passed by position
    rank: int,
    world: int,
    init_method: str,
    config: SimulationConfig,
    dp: DataParallelConfig,
    reports: Queue[_Report],
    show_progress: bool,
) -> None:
    report = _run(rank, world, init_method, config, dp, show_progress, rank)
    reports.put(report)
    if report.error:
        # Flush the report, then leave at once: the process group's teardown
        # would wait on peers that are themselves failing.
        reports.close()
        reports.join_thread()
        os._exit(1)


def _run(  # noqa: PLR0917
    rank: int,
    world: int,
    init_method: str,
    config: SimulationConfig,
    dp: DataParallelConfig,
    show_progress: bool,
    local_rank: int,
) -> _Report:
    if config.device == "cpu":
        torch.set_num_threads(1)  # ranks share the machine's cores
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    progress = Progress(sys.stderr, enabled=show_progress and rank == 0)
    try:
        group = join_ranks(
            rank, world, dp.backend_on(config.device), device,
            init_method=init_method, timeout_s=dp.timeout_s,
        )  # fmt: skip
        run = run_rank(group, config, dp, progress)
    except Exception as error:  # every failure is reported, by rank
        return _Report(rank, error=f"{type(error).__name__}: {error}",
                       lost_peer=isinstance(error, PeerLost))  # fmt: skip
    finally:
        progress.close()
    return _Report(rank, run=run)


def _collect(
    processes: list[SpawnProcess], reports: Queue[_Report], patience_s: float
) -> dict[int, _Report]:
    # Wait for every rank's report; after the first failure, give the rest
    # `patience_s` to notice and report, then stop waiting for them.
    heard: dict[int, _Report] = {}
    failed_at: float | None = None
    while len(heard) < len(processes):
        try:
            report = reports.get(timeout=_POLL_S)
        except queue.Empty:
            for rank, process in enumerate(processes):
                if rank not in heard and process.exitcode not in (None, 0):
                    heard[rank] = _Report(rank, error=f"exited with code {process.exitcode}")
        else:
            heard[report.rank] = report
        if failed_at is None and any(report.error for report in heard.values()):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > patience_s:
            break
    return heard


def _result(heard: dict[int, _Report], processes: list[SpawnProcess]) -> DataParallelRun:
    failures = [report for report in heard.values() if report.error]
    silent = [rank for rank in range(len(processes)) if rank not in heard]
    if failures or silent:
        raise RankFailed(_describe(failures, silent))
    run = heard[0].run
    if run is None:
        raise RankFailed("rank 0 finished without a run")
    return run


def _describe(failures: list[_Report], silent: list[int] | None = None) -> str:
    # The first rank that failed on its own is the cause; the others lost it.
    # When every reporting rank lost a peer, the cause is a rank that went silent.
    silent = silent or []
    causes = [report for report in failures if not report.lost_peer]
    if not causes and silent:
        message = f"{_plural(silent)} stopped answering and {_was(silent)} killed"
        if failures:
            message += f"; {_plural([report.rank for report in failures])} timed out waiting"
        return message
    cause = min(causes or failures, key=lambda report: report.rank)
    message = f"rank {cause.rank} failed: {cause.error}"
    others = sorted(report.rank for report in failures if report is not cause)
    if others:
        message += f"; {_plural(others)} stopped with it"
    if silent:
        message += f"; {_plural(silent)} did not stop in time and {_was(silent)} killed"
    return message


def _plural(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def _was(ranks: list[int]) -> str:
    return "were" if len(ranks) > 1 else "was"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
