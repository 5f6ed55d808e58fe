"""The `batchstate` command: `batchstate simulate` runs the reference engine on a workload."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, NamedTuple, NoReturn, TypeAlias

import attrs

from batchstate._version import __version__

# The engine, and torch with it (seconds to import), load only once a run is
# parsed and checked: the help, the version and usage errors stay fast.
if TYPE_CHECKING:
    from batchstate import SamplingParams
    from batchstate.engine import SimulationConfig
    from batchstate.engine._data_parallel import DataParallelConfig
    from batchstate.engine._report import Summary

__all__ = ["EXIT_CODES", "main"]

OK, FAILED, USAGE = 0, 1, 2
EXIT_CODES: Final = (
    (OK, "the run finished and every check passed"),
    (
        FAILED,
        "a check failed (the oracle, an invariant, pool conservation or device reads),"
        " or a data-parallel rank failed",
    ),
    (
        USAGE,
        "a usage error: a missing command, a bad or contradictory option, a bad --plot path,"
        " a run too big for this machine's memory",
    ),
)
_EPILOG: Final = "exit status:\n" + "\n".join(f"  {code}  {what}" for code, what in EXIT_CODES)
_PROG: Final = "batchstate simulate"
# The choices of the engine's options, written here so that parsing imports no
# engine; tests/test_cli.py checks they are the engine's own.
_ARRIVALS: Final = ("all", "uniform", "poisson", "burst")
_SAMPLING_MIXES: Final = ("greedy", "mixed", "fixed")
_DEVICES: Final = ("cpu", "meta", "cuda")
_BACKENDS: Final = ("gloo", "nccl")
_Add: TypeAlias = Callable[..., argparse.Action]  # an argument group's add_argument


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, not usage plus a line."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: error: {message}\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Adds `(default: X)` to an option's help, unless it says its default itself.

    Flags and options whose default is computed (None) say nothing or say it
    in words, so each option shows its default once.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (
            "(default" in help_text
            or action.default in (None, argparse.SUPPRESS)
            or action.nargs == 0  # a flag: its name says what it changes
        ):
            return help_text
        return f"{help_text} (default: %(default)s)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (see `EXIT_CODES`)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # argparse printed its one-line error, the help or the version
        return done.code if isinstance(done.code, int) else USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return USAGE
    from batchstate.engine._launch import launched_by_torchrun  # noqa: PLC0415  (see the top)
    from batchstate.engine._plot import check_plot_path  # noqa: PLC0415

    try:
        config = _config(args)
        config.validate()
        dp = _data_parallel(args)
        if dp is not None:
            dp.validate(config)
        if args.plot is not None:
            if dp is not None:
                raise ValueError("--plot draws one process's run: it does not take --dp")
            check_plot_path(args.plot)
        _check_footprint(config, 1 if dp is None else dp.ranks)
    except (ValueError, ImportError) as error:
        print(f"{_PROG}: error: {error}", file=sys.stderr)
        return USAGE
    if dp is not None and not launched_by_torchrun():
        _warn_if_ranks_outnumber_cores(dp.ranks)
    if dp is None:
        return _simulate(config, args)
    code = _simulate_dp(config, dp, args)
    if launched_by_torchrun():
        # End this rank without interpreter teardown: torch's distributed threads
        # can abort it there (SIGABRT after the work is done, about one run in
        # four here), which torchrun would report as a failed rank.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _check_footprint(config: SimulationConfig, ranks: int) -> None:
    """Raise `ValueError` (one line, naming the option to lower) for a run that cannot fit."""
    from batchstate.engine._footprint import (  # noqa: PLC0415  (see the top)
        MAX_REQUESTS,
        available_memory,
        estimate,
        format_bytes,
    )

    requests = config.workload.num_requests
    if requests > MAX_REQUESTS:
        raise ValueError(
            f"--requests {requests} is above {MAX_REQUESTS}, the most one run holds:"
            " lower --requests"
        )
    footprint = estimate(config, ranks)
    available = available_memory()
    if available is not None and footprint.host_bytes > available:
        part = footprint.largest(on_device=False)
        raise ValueError(
            f"the run may need {format_bytes(footprint.host_bytes)} of memory"
            f" ({part.what}: {format_bytes(part.bytes)}), more than the"
            f" {format_bytes(available)} available here: lower {part.option}"
        )
    if footprint.device_bytes:
        free = _cuda_free_bytes()
        need = estimate(config).device_bytes  # each rank on a device of its own
        if need > free:
            part = footprint.largest(on_device=True)
            raise ValueError(
                f"the run may need {format_bytes(need)} of cuda memory ({part.what}),"
                f" more than the {format_bytes(free)} free: lower {part.option}"
            )


def _cuda_free_bytes() -> int:
    import torch  # noqa: PLC0415  (see the top)

    free, _ = torch.cuda.mem_get_info()
    return free


def _cores() -> int:
    # The cores this process may run on (a container or taskset may allow fewer).
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _warn_if_ranks_outnumber_cores(ranks: int) -> None:
    # Ranks step in lockstep: with more ranks than cores, every step waits on the slowest share.
    cores = _cores()
    if ranks > 2 * cores:
        print(
            f"{_PROG}: warning: --dp {ranks} starts {ranks} processes on {cores} cores;"
            " the ranks step together, so each step waits for them all: expect it to be slow",
            file=sys.stderr,
            flush=True,
        )


def _data_parallel(args: argparse.Namespace) -> DataParallelConfig | None:
    from batchstate.engine._data_parallel import DataParallelConfig  # noqa: PLC0415
    from batchstate.engine._launch import launched_by_torchrun  # noqa: PLC0415
    from batchstate.engine._ranks import Fault  # noqa: PLC0415

    # --dp N spawns N ranks; under torchrun, this process is one of them.
    ranks = args.dp
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if ranks not in (None, world):
            raise ValueError(f"--dp {ranks}, but torchrun started {world} ranks")
        ranks = world
    if ranks is None:
        for option, value in (("--dp-backend", args.dp_backend), ("--dp-fault", args.dp_fault)):
            if value is not None:
                raise ValueError(f"{option} needs --dp")
        return None
    fault = None if args.dp_fault is None else Fault(*args.dp_fault)
    return DataParallelConfig(ranks, args.dp_backend, args.dp_timeout, fault)


def _simulate_dp(config: SimulationConfig, dp: DataParallelConfig, args: argparse.Namespace) -> int:
    from batchstate.engine._dp_report import render_dp_summary, summarize_dp  # noqa: PLC0415
    from batchstate.engine._launch import (  # noqa: PLC0415
        RankFailed,
        launch,
        launched_by_torchrun,
        run_launched,
    )

    show = not (args.json or args.quiet) and sys.stderr.isatty()
    try:
        if launched_by_torchrun():
            run = run_launched(config, dp, show_progress=show)
        else:
            run = launch(config, dp, show_progress=show)
    except RankFailed as error:
        print(f"{_PROG}: {error}", file=sys.stderr)
        return FAILED
    if run is None:  # another rank of a torchrun launch: rank 0 reports
        return OK
    summary = summarize_dp(run)
    if args.json:
        print(json.dumps({**attrs.asdict(summary), "ok": summary.ok}, indent=2))
    else:
        print(render_dp_summary(summary), flush=True)
    if not summary.ok:
        print(
            f"{_PROG}: failed on {summary.num_ranks} ranks: oracle {summary.oracle}",
            file=sys.stderr,
        )
        return FAILED
    return OK


def _simulate(config: SimulationConfig, args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415  (see the top)

    from batchstate import InvariantViolation  # noqa: PLC0415
    from batchstate.engine import EngineError, simulate  # noqa: PLC0415
    from batchstate.engine._plot import plot_run  # noqa: PLC0415
    from batchstate.engine._progress import Progress  # noqa: PLC0415
    from batchstate.engine._report import render_summary, summarize  # noqa: PLC0415

    if config.device == "cpu":
        # A tiny model on a shared machine: extra intra-op threads only contend.
        torch.set_num_threads(1)
    show = not (args.json or args.quiet) and sys.stderr.isatty()
    progress = Progress(sys.stderr, enabled=show)
    try:
        run = simulate(config, progress)
    except (InvariantViolation, EngineError) as error:
        kind = "invariant failed" if isinstance(error, InvariantViolation) else "engine failed"
        print(f"{_PROG}: {kind}: {error}", file=sys.stderr)
        return FAILED
    finally:
        progress.close()
    summary = summarize(run)
    if args.json:
        print(json.dumps({**attrs.asdict(summary), "ok": summary.ok}, indent=2))
    else:
        print(render_summary(summary), flush=True)
    if args.plot is not None:
        try:
            plot_run(run, args.plot)
        except (OSError, ValueError) as error:  # checked up front; the disk can still refuse
            print(f"{_PROG}: error: cannot write the plot: {error}", file=sys.stderr)
            return USAGE
    if not summary.ok:
        print(f"{_PROG}: failed {_failed_check(summary)}", file=sys.stderr)
        return FAILED
    return OK


def _failed_check(summary: Summary) -> str:
    if summary.oracle_passed is False:
        return f"the oracle: {summary.oracle}"
    if not summary.pools_conserved:
        return f"pool conservation: {summary.pools}"
    return f"device reads: {summary.device_reads} on the decode path, expected none"


_FIXED_OPTIONS: Final = (
    ("temperature", "--temperature"),
    ("top_p", "--top-p"),
    ("top_k", "--top-k"),
    ("min_p", "--min-p"),
)


def _fixed_sampling(args: argparse.Namespace) -> SamplingParams:
    from batchstate.engine import WorkloadConfig  # noqa: PLC0415  (see the top)

    # --temperature and the filters set `--sampling fixed`; with another mix they would be ignored.
    given = {name: getattr(args, name) for name, _ in _FIXED_OPTIONS}
    named = [option for name, option in _FIXED_OPTIONS if given[name] is not None]
    if named and args.sampling != "fixed":
        raise ValueError(
            f"{named[0]} sets the parameters of --sampling fixed, not --sampling {args.sampling}"
        )
    changes = {name: value for name, value in given.items() if value is not None}
    return attrs.evolve(WorkloadConfig().fixed_sampling, **changes)


def _config(args: argparse.Namespace) -> SimulationConfig:
    from batchstate.engine import EngineConfig, SimulationConfig, WorkloadConfig  # noqa: PLC0415

    workload = WorkloadConfig(
        num_requests=args.requests,
        arrival=args.arrival,
        arrival_rate=args.arrival_rate,
        burst_size=args.burst_size,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        seed=args.seed,
        shared_prefixes=args.shared_prefix[0],
        shared_prefix_len=args.shared_prefix[1],
        shared_fraction=args.shared_prefix[2],
        follow_ups=args.follow_ups,
        prebuilt=args.prebuilt,
        sampling=args.sampling,
        fixed_sampling=_fixed_sampling(args),
    )
    engine = EngineConfig(
        max_running=args.max_running,
        max_prefill_tokens=args.max_prefill_tokens,
        new_token_ratio=args.new_token_ratio,
        headroom_pages=args.headroom_pages,
        check_every=args.check_every,
        audit_every=args.audit_every,
        chunk_size=args.chunk_size,
        mixed=args.mixed,
        overlap=args.overlap,
        speculative=args.speculative,
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
        prefix_cache=not args.no_prefix_cache,
        cuda_graph_sizes=tuple(args.cuda_graph_sizes or ()),
    )


def _number(text: str) -> int | float:
    # `--shared-prefix 4 64 0.5`: two counts and a share.
    try:
        return int(text)
    except ValueError:
        return float(text)


def _parser() -> _Parser:
    parser = _Parser(
        prog="batchstate",
        description="batchstate's command line: run its reference serving engine and check it.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    sim = commands.add_parser(
        "simulate",
        help="run the reference engine on a generated workload and check it",
        description=(
            "Run the reference continuous-batching engine on a seeded workload, check\n"
            "its tokens against the oracle, and print a summary."
        ),
        epilog=_EPILOG,
        formatter_class=_HelpFormatter,
    )
    _add_workload_options(sim.add_argument_group("workload").add_argument)
    _add_sampling_options(sim.add_argument_group("sampling").add_argument)
    _add_engine_options(sim.add_argument_group("engine and pools").add_argument)
    _add_data_parallel_options(sim.add_argument_group("data parallel").add_argument)
    _add_output_options(sim.add_argument_group("checks and output").add_argument)
    return parser


def _add_workload_options(add: _Add) -> None:
    add("--requests", type=int, default=256, metavar="N", help="requests in the workload")
    add("--arrival", choices=_ARRIVALS, default="poisson", help="how requests arrive over steps")
    add("--arrival-rate", type=float, default=2.0, metavar="R", help="requests per engine step")
    add(
        "--burst-size",
        type=int,
        default=32,
        metavar="N",
        help="requests per burst, for --arrival burst",
    )
    add(
        "--prompt-len",
        type=int,
        nargs=2,
        default=[8, 48],
        metavar=("MIN", "MAX"),
        help="prompt tokens, drawn uniformly from MIN..MAX (default: 8 48)",
    )
    add(
        "--output-len",
        type=int,
        nargs=2,
        default=[4, 48],
        metavar=("MIN", "MAX"),
        help="most tokens to generate, drawn from MIN..MAX; the end token stops one early"
        " (default: 4 48)",
    )
    add("--seed", type=int, default=0, help="seed of the workload and of meta's tokens")
    add(
        "--shared-prefix",
        type=_number,
        nargs=3,
        default=[0, 32, 0.0],
        metavar=("COUNT", "LEN", "FRACTION"),
        help="COUNT distinct prefixes of LEN tokens; a FRACTION of the requests start with one"
        " (default: 0 32 0.0, none)",
    )
    add(
        "--follow-ups",
        type=float,
        default=0.0,
        metavar="F",
        help="share of requests that are a second turn of an earlier one: its prompt and"
        " answer, then new tokens",
    )
    add(
        "--prebuilt",
        type=float,
        default=0.0,
        metavar="F",
        help="share of first turns prefilled elsewhere (disaggregated prefill): they arrive"
        " with their prompt's KV and first token, and this engine decodes them",
    )


def _add_sampling_options(add: _Add) -> None:
    add(
        "--sampling",
        choices=_SAMPLING_MIXES,
        default="greedy",
        help="how requests sample: greedy (the most likely token); mixed (each request draws"
        " its own: a quarter greedy, the rest a temperature of 0.6-1.2 with or without top-k,"
        " top-p and min-p); fixed (every request as --temperature, --top-p, --top-k, --min-p)."
        " Each sampled request has its own seed",
    )
    add(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="--sampling fixed: logits are divided by T; 0 is greedy (default: 1.0)",
    )
    add(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="--sampling fixed: keep the most likely tokens whose probability reaches P"
        " (default: 1.0, all)",
    )
    add(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="--sampling fixed: keep the K most likely tokens; 0 keeps all (default: 0)",
    )
    add(
        "--min-p",
        type=float,
        default=None,
        metavar="P",
        help="--sampling fixed: drop tokens less likely than P times the most likely"
        " (default: 0.0)",
    )


def _add_engine_options(add: _Add) -> None:
    add(
        "--device",
        choices=_DEVICES,
        default="cpu",
        help="cpu or cuda run the tiny model and the oracle; meta runs the bookkeeping only",
    )
    add("--max-running", type=int, default=32, metavar="N", help="requests running at once")
    add(
        "--max-reqs",
        type=int,
        default=None,
        metavar="N",
        help="request slots in the pools, at least --max-running (default: --max-running)",
    )
    add("--kv-tokens", type=int, default=1024, metavar="N", help="KV cache tokens in the pool")
    add("--page-size", type=int, default=16, metavar="N", help="KV tokens per page")
    add(
        "--max-context-len",
        type=int,
        default=None,
        metavar="N",
        help="width of the request-to-token table (default: longest prompt + longest output)",
    )
    add("--max-prefill-tokens", type=int, default=1024, metavar="N", help="input ids per extend")
    add(
        "--new-token-ratio",
        type=float,
        default=0.3,
        metavar="R",
        help="share of a request's output budget reserved when it is admitted",
    )
    add("--headroom-pages", type=int, default=1, metavar="N", help="pages reserved per admission")
    add(
        "--no-prefix-cache",
        action="store_true",
        help="give finished requests' KV back instead of caching it for later prefixes",
    )
    add(
        "--chunk-size",
        type=int,
        default=32,
        metavar="N",
        help="prompt tokens per step; longer prompts are prefilled in chunks; 0: whole prompts",
    )
    add(
        "--mixed",
        action="store_true",
        help="run prompt chunks beside the running decode rows, in one forward; without it a"
        " step with chunks is a prefill step of its own, as in SGLang",
    )
    add(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="read each step's sampled tokens before building the next; without it they"
        " stay on the device and finishes are checked one step late",
    )
    add(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="draft K tokens per decode step with a draft model (the target's first layer) and"
        " verify them with the target; 0: no speculation. A speculative step reads its tokens"
        " before the next is built, so overlap has no effect on it",
    )
    add(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="captured CUDA-graph sizes, increasing: every forward is padded to the next one"
        " (tokens; rows for decode), on the CPU too; larger forwards run unpadded"
        " (default: none, no padding)",
    )


def _add_data_parallel_options(add: _Add) -> None:
    add(
        "--dp",
        type=int,
        default=None,
        metavar="N",
        help="run N data-parallel ranks (processes, or torchrun's): each owns its pools and"
        " batch, attention runs per rank and the MLPs are shared (default: one process;"
        " under torchrun, its world size)",
    )
    add(
        "--dp-backend",
        choices=_BACKENDS,
        default=None,
        help="collectives of the shared layers (default: gloo on cpu, nccl on cuda)",
    )
    add(
        "--dp-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a collective may wait before every rank stops",
    )
    add(
        "--dp-fault",
        type=_fault,
        default=None,
        metavar="RANK:STEP[:hang]",
        help="test the fault path: rank RANK raises in step STEP (with :hang, stops answering"
        " there), and every rank must stop (default: no fault)",
    )


class _FaultArgs(NamedTuple):
    """`--dp-fault`, parsed: the engine's `Fault` is built from it for the run."""

    rank: int
    step: int
    hang: bool


def _fault(text: str) -> _FaultArgs:
    # RANK:STEP raises there; RANK:STEP:hang stops answering there.
    parts = text.split(":")
    hang = parts[2:] == ["hang"]
    try:
        if len(parts) == 2 or hang:
            return _FaultArgs(int(parts[0]), int(parts[1]), hang)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected RANK:STEP or RANK:STEP:hang, got {text!r}")


def _plot_path(text: str) -> Path:
    # Path("") is Path("."), the current folder: say what was given instead.
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty; give a file name such as run.png")
    return Path(text)


def _add_output_options(add: _Add) -> None:
    add("--no-oracle", action="store_true", help="skip the oracle (meta never runs it)")
    add(
        "--check-every",
        type=int,
        default=100,
        metavar="N",
        help="check invariants every N steps; 0: at the end only",
    )
    add(
        "--audit-every",
        type=int,
        default=16,
        metavar="N",
        help="count decode-path device reads every N steps; 0: never",
    )
    add("--json", action="store_true", help="print the summary as JSON on stdout")
    add(
        "--plot",
        type=_plot_path,
        default=None,
        metavar="PATH",
        help="also plot the run to PATH, in the format its extension names (png, svg, pdf, ...);"
        " needs matplotlib",
    )
    add(
        "-q",
        "--quiet",
        "--no-progress",
        dest="quiet",
        action="store_true",
        help="no progress bars on stderr (there are none when stderr is not a terminal)",
    )


if __name__ == "__main__":
    sys.exit(main())
