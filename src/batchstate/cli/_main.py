"""`main`: parse, check (no torch yet), then run."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from batchstate.cli._checks import checked_run
from batchstate.cli._codes import PROG, USAGE
from batchstate.cli._parser import build_parser
from batchstate.cli._replay import replay_command

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (see `EXIT_CODES`).

    Every option is parsed and checked before torch and the engine load, so a
    usage error (exit 2) comes back at once.
    """
    command_line = build_parser()
    try:
        args = command_line.parse_args(argv)
    except SystemExit as done:  # argparse printed its one-line error, the help or the version
        return done.code if isinstance(done.code, int) else USAGE
    if args.command is None:
        command_line.print_help(sys.stderr)
        return USAGE
    if args.command == "replay":
        return replay_command(args.trace)
    try:
        config, dp = checked_run(args)
    except (ValueError, ImportError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE
    # Loads torch and the engine: only once the options are checked.
    from batchstate.cli._run import (  # noqa: PLC0415
        simulate,
        simulate_dp,
        warn_if_ranks_outnumber_cores,
    )
    from batchstate.engine import launched_by_torchrun  # noqa: PLC0415

    if dp is None:
        return simulate(config, args)
    if not launched_by_torchrun():
        warn_if_ranks_outnumber_cores(dp.ranks)
    code = simulate_dp(config, dp, args)
    if launched_by_torchrun():
        # End this rank without interpreter teardown: torch's distributed threads
        # can abort it there (SIGABRT after the work is done, about one run in
        # four here), which torchrun would report as a failed rank.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
