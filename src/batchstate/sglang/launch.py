"""Run SGLang with a `Watch` (or, with --shadow, a `Shadow`) in every process, or
(with --drive) with batchstate driving its scheduler: `python -m batchstate.sglang.launch ARGS`.

`ARGS` are `sglang.launch_server`'s own. Nothing in SGLang is edited: the launcher
starts `python -m sglang.launch_server ARGS` with a `sitecustomize` on PYTHONPATH
that attaches a `Watch` in each process once SGLang's `schedule_batch` is imported
(a `Shadow` once its `scheduler` is: it also wraps the cache calls imported there).
A `sitecustomize` of your own later on the path is shadowed while it runs.

With --drive the server arguments are checked first (`check_drive`): a version or
configuration drive mode does not run is refused in one line, exit status 2, before
anything starts; in the scheduler's process a `Drive` attaches to the scheduler as it
starts (batchstate.sglang.driven).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from batchstate.sglang._hook import (
    ENV_ATTACH,
    ENV_DRIVE,
    ENV_FULL_CHECK_EVERY,
    ENV_MODE,
    ENV_TRACE_DIR,
)

SITE = Path(__file__).parent / "_site"


def environment(
    mode: str,
    trace_dir: Path,
    base: dict[str, str],
    attach: str = "watch",
    full_check_every: int = 1,
) -> dict[str, str]:
    """`base` plus what turns the watch (`attach="shadow"`: the shadow, comparing rows in
    full at every `full_check_every`th call) on in the processes started with it."""
    path = os.pathsep.join(p for p in (str(SITE), base.get("PYTHONPATH", "")) if p)
    turned_on = {ENV_MODE: mode, ENV_TRACE_DIR: str(trace_dir), ENV_ATTACH: attach}
    turned_on[ENV_FULL_CHECK_EVERY] = str(full_check_every)
    return {**base, **turned_on, "PYTHONPATH": path}


def _positive(text: str) -> int:
    # Checked here, where a bad value is a usage error, not in the scheduler's start-up.
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Start the module (SGLang's server by default) under the watch; its exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m batchstate.sglang.launch", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--watch-log", action="store_true", help="log divergences instead of raising"
    )
    parser.add_argument(
        "--shadow",
        action="store_true",
        help="attach a Shadow (every call replayed in batchstate) instead of a Watch",
    )
    parser.add_argument(
        "--shadow-full-check-every",
        type=_positive,
        default=None,
        metavar="N",
        help="with --shadow: compare the rows request by request at every Nth batch call "
        "(and every extend); the others still replayed, their counts compared (default 1)",
    )
    parser.add_argument(
        "--drive",
        action="store_true",
        help="drive the scheduler with batchstate (its batch state and memory are "
        "batchstate values); checked before the server starts; no watch is attached",
    )
    parser.add_argument("--watch-trace-dir", type=Path, default=Path("."), help="where traces go")
    parser.add_argument("--watch-module", default="sglang.launch_server", help="the module to run")
    known, rest = parser.parse_known_args(argv)
    if known.shadow_full_check_every is not None and not known.shadow:
        parser.error("--shadow-full-check-every needs --shadow")
    if known.drive:
        if known.shadow or known.watch_log:
            parser.error("--drive runs without a watch or shadow: give it alone")
        refused = _refused(rest)
        if refused:
            print(refused, file=sys.stderr)
            return 2
        path = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, ENV_DRIVE: "1", "PYTHONPATH": path}
        return subprocess.call([sys.executable, "-m", known.watch_module, *rest], env=env)
    mode = "log" if known.watch_log else "raise"
    attach = "shadow" if known.shadow else "watch"
    every = known.shadow_full_check_every or 1
    env = environment(mode, known.watch_trace_dir, dict(os.environ), attach, every)
    return subprocess.call([sys.executable, "-m", known.watch_module, *rest], env=env)


def _refused(server_args: list[str]) -> str:
    # Drive's check of `sglang.launch_server`'s own arguments: its one line, or "".
    from batchstate.sglang._stubs import install_stubs
    from batchstate.sglang.driven.support import DriveRefused, check_drive

    install_stubs()
    from sglang.srt.server_args import prepare_server_args

    try:
        check_drive(prepare_server_args(server_args))
    except DriveRefused as refused:
        return str(refused)
    return ""


if __name__ == "__main__":
    raise SystemExit(main())
