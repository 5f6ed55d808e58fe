"""`batchstate replay TRACE`: a shadow's trace run through batchstate alone."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from batchstate.cli._codes import FAILED, OK, USAGE

__all__ = ["add_replay_command", "replay_command"]

REPLAY = "batchstate replay"


def add_replay_command(commands: argparse._SubParsersAction[Any]) -> None:
    """The `replay` subcommand: one argument, the trace file."""
    command = commands.add_parser(
        "replay",
        help="replay a trace written by batchstate.sglang.Shadow and name its first divergence",
        description=(
            "Run every SGLang call of a Shadow trace through batchstate alone and report the\n"
            "first step where SGLang's recorded state and batchstate's differ.\n"
            "Exit codes: 0 no divergence, 1 a divergence, 2 a usage error or a bad trace."
        ),
    )
    command.add_argument("trace", type=Path, metavar="TRACE", help="the trace (JSON lines)")


def replay_command(trace: Path) -> int:
    """Replay `trace` and print the outcome; the exit code."""
    if not trace.is_file():
        print(f"{REPLAY}: error: {trace}: no such file", file=sys.stderr)
        return USAGE
    from batchstate.sglang.replay import replay  # noqa: PLC0415  (loads torch)
    from batchstate.sglang.trace import TraceError  # noqa: PLC0415

    try:
        done = replay(trace)
    except TraceError as error:
        print(f"{REPLAY}: error: {error}", file=sys.stderr)
        return USAGE
    if done.mismatch is None:
        print(f"{trace}: {done.operations} operations replayed, no divergence")
        return OK
    print(f"{trace}: first divergence at {done.mismatch}")
    return FAILED
