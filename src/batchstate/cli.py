"""The `batchstate` command: `batchstate simulate` runs the reference engine on a workload."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import attrs
import torch

from batchstate._errors import InvariantViolation
from batchstate.engine import (
    ARRIVALS,
    DEVICES,
    EngineConfig,
    EngineError,
    SimulationConfig,
    WorkloadConfig,
    simulate,
)
from batchstate.engine._plot import plot_run, require_matplotlib
from batchstate.engine._progress import Progress
from batchstate.engine._report import render_summary, summarize

__all__ = ["main"]

# Exit codes: 0 ok, 1 the run failed a check (oracle, invariant, leak), 2 bad arguments.
_FAILED, _USAGE = 1, 2


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, not usage plus a line."""

    def error(self, message: str) -> NoReturn:
        self.exit(_USAGE, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as done:  # argparse printed its one-line error, or the help
        return done.code if isinstance(done.code, int) else _USAGE
    prog = "batchstate simulate"
    try:
        config = _config(args)
        config.validate()
        if args.plot is not None:
            require_matplotlib()
    except (ValueError, ImportError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return _USAGE
    if config.device == "cpu":
        # A tiny model on a shared machine: extra intra-op threads only contend.
        torch.set_num_threads(1)
    progress = Progress(
        config.workload.num_requests,
        sys.stderr,
        enabled=not args.json and not args.no_progress and sys.stderr.isatty(),
    )
    try:
        run = simulate(config, progress.update)
    except (InvariantViolation, EngineError) as error:
        progress.close()
        kind = "invariant failed" if isinstance(error, InvariantViolation) else "engine failed"
        print(f"{prog}: {kind}: {error}", file=sys.stderr)
        return _FAILED
    progress.close()
    summary = summarize(run)
    if args.plot is not None:
        plot_run(run, args.plot)
    if args.json:
        print(json.dumps({**attrs.asdict(summary), "ok": summary.ok}, indent=2))
    else:
        print(render_summary(summary))
    if not summary.ok:
        failed = summary.oracle_passed is False
        what = f"the oracle: {summary.oracle}" if failed else f"pool conservation: {summary.pools}"
        print(f"{prog}: failed {what}", file=sys.stderr)
        return _FAILED
    return 0


def _config(args: argparse.Namespace) -> SimulationConfig:
    workload = WorkloadConfig(
        num_requests=args.requests,
        arrival=args.arrival,
        arrival_rate=args.arrival_rate,
        burst_size=args.burst_size,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        seed=args.seed,
    )
    engine = EngineConfig(
        max_running=args.max_running,
        max_prefill_tokens=args.max_prefill_tokens,
        new_token_ratio=args.new_token_ratio,
        headroom_pages=args.headroom_pages,
        check_every=args.check_every,
        audit_every=args.audit_every,
    )
    return SimulationConfig(
        workload=workload,
        engine=engine,
        max_reqs=args.max_reqs,
        num_kv_tokens=args.kv_tokens,
        page_size=args.page_size,
        max_context_len=args.max_context_len,
        device=args.device,
        oracle=not args.no_oracle,
    )


def _parser() -> _Parser:
    parser = _Parser(prog="batchstate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser(
        "simulate",
        help="run the reference engine on a generated workload",
        description="Run the reference continuous-batching engine and print a summary.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = sim.add_argument
    add("--requests", type=int, default=256, help="number of requests")
    add("--arrival", choices=ARRIVALS, default="poisson", help="arrival pattern")
    add("--arrival-rate", type=float, default=2.0, help="requests per engine step")
    add("--burst-size", type=int, default=32, help="requests per burst (--arrival burst)")
    add("--prompt-len", type=int, nargs=2, default=[8, 48], metavar=("MIN", "MAX"))
    add("--output-len", type=int, nargs=2, default=[4, 48], metavar=("MIN", "MAX"))
    add("--max-running", type=int, default=32, help="requests running at once")
    add("--max-reqs", type=int, default=None, help="request slots (default: --max-running)")
    add("--kv-tokens", type=int, default=1024, help="KV cache tokens in the pool")
    add("--page-size", type=int, default=16, help="KV tokens per page")
    add("--max-context-len", type=int, default=None, help="table width (default: longest)")
    add("--max-prefill-tokens", type=int, default=1024, help="input ids per extend")
    add("--new-token-ratio", type=float, default=0.3, help="share of output reserved at admission")
    add("--headroom-pages", type=int, default=1, help="pages reserved per request at admission")
    add("--seed", type=int, default=0, help="workload and sampling seed")
    add("--device", default="cpu", help=f"one of {', '.join(DEVICES)} (meta: no model)")
    add("--no-oracle", action="store_true", help="skip the oracle check")
    add("--check-every", type=int, default=100, help="check invariants every N steps (0: end only)")
    add("--audit-every", type=int, default=16, help="count device reads every N steps (0: never)")
    add("--json", action="store_true", help="print the summary as JSON")
    add("--plot", type=Path, default=None, metavar="FILE.png", help="plot the run to FILE.png")
    add("--no-progress", action="store_true", help="no progress bar")
    return parser


if __name__ == "__main__":
    sys.exit(main())
