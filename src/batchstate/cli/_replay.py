"""`batchstate replay TRACE`: a shadow's trace run through batchstate alone."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from batchstate.cli._codes import FAILED, OK, USAGE
from batchstate.errors import Error

__all__ = ["add_replay_command", "replay_command"]

REPLAY = "batchstate replay"
# The pools line's fields (batchstate.sglang.trace.PoolsConfig): each an integer.
POOLS_FIELDS = ("page_size", "kv_tokens", "rows", "context")
# A vLLM shadow's pools line (batchstate.vllm.trace.PoolsConfig), marked "engine": "vllm".
VLLM_POOLS_FIELDS = ("num_blocks", "block_size", "max_reqs", "context")


def add_replay_command(commands: argparse._SubParsersAction[Any]) -> None:
    """The `replay` subcommand: one argument, the trace file."""
    command = commands.add_parser(
        "replay",
        help=(
            "replay a trace written by batchstate.sglang.Shadow or batchstate.vllm.Shadow"
            " and name its first divergence"
        ),
        description=(
            "Run every engine call of a Shadow trace (SGLang's or vLLM's) through batchstate\n"
            "alone and report the first step where the engine's recorded state and\n"
            "batchstate's differ.\n"
            "Exit codes: 0 no divergence, 1 a divergence, 2 a usage error or a bad trace."
        ),
    )
    command.add_argument("trace", type=Path, metavar="TRACE", help="the trace (JSON lines)")


def replay_command(trace: Path) -> int:
    """Replay `trace` and print the outcome; the exit code.

    What is not a trace at all (no file, a folder, a binary file, a first line that
    is not the pools line) is refused before torch loads: a one-line usage error,
    exit 2. Exit 1 is a divergence, and only that.
    """
    try:
        engine = check_pools_line(read_trace_text(trace), trace)
    except NotATrace as error:
        print(f"{REPLAY}: error: {error}", file=sys.stderr)
        return USAGE
    from batchstate.sglang.replay import replay  # noqa: PLC0415  (loads torch)
    from batchstate.sglang.trace import TraceError  # noqa: PLC0415
    from batchstate.vllm.replay import replay as replay_vllm  # noqa: PLC0415
    from batchstate.vllm.trace import TraceError as VllmTraceError  # noqa: PLC0415

    try:
        done = replay_vllm(trace) if engine == "vllm" else replay(trace)
    except (TraceError, VllmTraceError, OSError, UnicodeDecodeError) as error:
        print(f"{REPLAY}: error: {_one_line(str(error))}", file=sys.stderr)
        return USAGE
    if done.mismatch is None:
        print(f"{trace}: {done.operations} operations replayed, no divergence")
        return OK
    print(f"{trace}: first divergence at {done.mismatch}")
    return FAILED


class NotATrace(Error, ValueError):
    """Why a file is not a trace, in one line that starts with its path."""


def read_trace_text(trace: Path) -> str:
    """The text of the file at `trace`.

    Raises:
        NotATrace: no such file, a folder, unreadable, or not UTF-8 text.
    """
    if trace.is_dir():
        raise NotATrace(f"{trace}: is a folder, not a trace file")
    if not trace.exists():
        raise NotATrace(f"{trace}: no such file")
    if not trace.is_file():
        raise NotATrace(f"{trace}: not a regular file")
    try:
        data = trace.read_bytes()
    except OSError as error:
        raise NotATrace(f"{trace}: cannot be read: {error.strerror or error}") from None
    binary = f"{trace}: a binary file, not a trace (JSON lines, UTF-8)"
    if b"\0" in data:
        raise NotATrace(binary)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise NotATrace(binary) from None


def check_pools_line(text: str, trace: Path) -> str:
    """Check the first line of `text`, the trace at `trace`, as a trace's pools line, as
    `batchstate.sglang.trace.read` (or, for a line marked `"engine": "vllm"`,
    `batchstate.vllm.trace.read`) reads it, which past it names the line of any error.
    Returns the engine: "vllm", or "sglang" where the line names none.

    Raises:
        NotATrace: the first line is missing, not JSON, or not the pools line.
    """
    first = text.split("\n", 1)[0].strip()
    if not first:
        empty = "empty file" if not text.strip() else "its first line is empty"
        raise NotATrace(f"{trace}: {empty}, not a trace: the first line must be the pools line")
    try:
        head = json.loads(first)
    except json.JSONDecodeError as error:
        where = f"{error.msg} at column {error.colno}"
        raise NotATrace(f"{trace}:1: not JSON ({where}): not a trace") from None
    if not isinstance(head, dict) or head.get("op") != "pools":
        raise NotATrace(f'{trace}:1: the first line must be the pools line, {{"op": "pools", ...}}')
    engine = "vllm" if head.get("engine") == "vllm" else "sglang"
    for field in VLLM_POOLS_FIELDS if engine == "vllm" else POOLS_FIELDS:
        if field not in head:
            raise NotATrace(f"{trace}:1: the pools line has no {field}")
        try:
            int(head[field])
        except (TypeError, ValueError, OverflowError):
            value = json.dumps(head[field])
            raise NotATrace(
                f"{trace}:1: the pools line's {field} is not an integer: {value}"
            ) from None
    return engine


def _one_line(message: str) -> str:
    return " ".join(message.split())
