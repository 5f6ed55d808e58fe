"""Run a checked config: this module loads torch and the engine."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from batchstate import InvariantViolation
from batchstate.cli._codes import FAILED, OK, PROG, USAGE
from batchstate.cli._output import failed_check, print_summary
from batchstate.engine import (
    DataParallelConfig,
    EngineError,
    RankFailed,
    SimulationConfig,
    launch,
    launched_by_torchrun,
    plot_run,
    progress_for,
    render_dp_summary,
    render_summary,
    run_launched,
    summarize,
    summarize_dp,
)
from batchstate.engine import simulate as run_simulation

__all__ = ["simulate", "simulate_dp", "warn_if_ranks_outnumber_cores"]


def simulate(config: SimulationConfig, args: argparse.Namespace) -> int:
    """One process's run: the summary on stdout, the exit code returned."""
    if config.device == "cpu":
        # A tiny model on a shared machine: extra intra-op threads only contend.
        torch.set_num_threads(1)
    progress = progress_for(sys.stderr, enabled=not (args.json or args.quiet))
    try:
        run = run_simulation(config, progress)
    except (InvariantViolation, EngineError) as error:
        kind = "invariant failed" if isinstance(error, InvariantViolation) else "engine failed"
        print(f"{PROG}: {kind}: {error}", file=sys.stderr)
        return FAILED
    finally:
        progress.close()
    summary = summarize(run)
    print_summary(summary, render_summary, as_json=args.json)
    if args.plot is not None:
        try:
            plot_run(run, args.plot)
        except (OSError, ValueError) as error:  # checked up front; the disk can still refuse
            print(f"{PROG}: error: cannot write the plot: {error}", file=sys.stderr)
            return USAGE
    if not summary.ok:
        print(f"{PROG}: failed {failed_check(summary)}", file=sys.stderr)
        return FAILED
    return OK


def simulate_dp(config: SimulationConfig, dp: DataParallelConfig, args: argparse.Namespace) -> int:
    """A data-parallel run (spawned here, or this process's rank under torchrun)."""
    show = not (args.json or args.quiet) and sys.stderr.isatty()
    try:
        if launched_by_torchrun():
            run = run_launched(config, dp, show_progress=show)
        else:
            run = launch(config, dp, show_progress=show)
    except RankFailed as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return FAILED
    if run is None:  # another rank of a torchrun launch: rank 0 reports
        return OK
    summary = summarize_dp(run)
    print_summary(summary, render_dp_summary, as_json=args.json)
    if not summary.ok:
        print(
            f"{PROG}: failed on {summary.num_ranks} ranks: oracle {summary.oracle}",
            file=sys.stderr,
        )
        return FAILED
    return OK


def cores() -> int:
    """The cores this process may run on (a container or taskset may allow fewer)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def warn_if_ranks_outnumber_cores(ranks: int) -> None:
    """Warn on stderr when ranks (which step in lockstep) would share cores."""
    available = cores()
    if ranks > 2 * available:
        print(
            f"{PROG}: warning: --dp {ranks} starts {ranks} processes on {available} cores;"
            " the ranks step together, so each step waits for them all: expect it to be slow",
            file=sys.stderr,
            flush=True,
        )
