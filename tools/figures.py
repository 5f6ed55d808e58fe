"""Regenerate the numbers that docs/engine.md, docs/prefix-cache.md and README.md publish.

Each figure is the `--json` summary of the `batchstate simulate` command printed
beside it, run here; wall times depend on the machine, so the machine is printed
first. Step, batch and retraction counts do not (the same seed replays the same run).

    python tools/figures.py                              # every run figure
    python tools/figures.py --plot docs/engine-run.png   # and redraw the default run's plot
    python tools/figures.py --suite                      # and time the test suite
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Final, TypeAlias

Numbers: TypeAlias = dict[str, object]

PRESSURE: Final = "--kv-tokens 512 --new-token-ratio 0 --headroom-pages 0 --requests 128"
SHARED: Final = "--requests 128 --shared-prefix 4 64 0.8 --follow-ups 0.3"
# docs/prefix-cache.md, "A burst on a cold cache": bursts of 32 sharing a 256-token prompt.
BURST: Final = (
    "--requests 128 --arrival burst --burst-size 32 --shared-prefix 1 256 1.0"
    " --prompt-len 8 32 --output-len 16 64 --max-running 64 --max-prefill-tokens 16384"
    " --chunk-size 0"
)


def machine() -> str:
    """The cores this process may use, the Python and the torch it runs."""
    import torch  # noqa: PLC0415  (only to print its version)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cores} cores ({platform.processor() or platform.machine()}),"
        f" Python {platform.python_version()}, torch {torch.__version__}"
    )


def simulate(options: str) -> tuple[Numbers, float]:
    """The `--json` summary of `batchstate simulate OPTIONS`, and the command's wall time."""
    argv = [sys.executable, "-m", "batchstate", "simulate", *shlex.split(options)]
    start = time.perf_counter()
    done = subprocess.run(
        [*argv, "--json", "--no-progress"], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"batchstate simulate {options} failed:\n{done.stderr}")
    summary = json.loads(done.stdout)
    assert isinstance(summary, dict)
    return summary, wall


def _line(options: str, what: str) -> None:
    print(f"- `{f'batchstate simulate {options}'.strip()}`")
    print(f"  {what}")


def run_figures(plot: str | None) -> None:
    """Print each published run figure beside its command."""
    default = "--plot " + plot if plot else ""
    summary, wall = simulate(default)
    _line(
        default,
        f"{summary['steps']} steps ({summary['extend_steps']} extend,"
        f" {summary['decode_steps']} decode), {summary['mean_batch_size']:.1f} rows per"
        f" forward on average ({summary['max_batch_size']} at most), KV"
        f" {100 * float(str(summary['mean_kv_use'])):.0f}% on average; engine loop"
        f" {summary['wall_s']:.2f} s, oracle {summary['oracle_s']:.2f} s, whole command"
        f" {wall:.1f} s; oracle {summary['oracle']}",
    )
    figures: Sequence[tuple[str, Callable[[Numbers], str]]] = (
        ("--device meta", _steps),
        ("--device meta --no-prefix-cache", _steps),
        ("--mixed", lambda s: f"{s['mixed_steps']} mixed steps of {s['steps']}"),
        (
            "--cuda-graph-sizes 1 2 4 8 16 32 64",
            lambda s: (
                f"{s['padded_rows_per_step']:.2f} rows and"
                f" {s['padded_tokens_per_step']:.2f} tokens of padding per forward"
            ),
        ),
        (PRESSURE, _retractions),
        ("--sampling mixed", lambda s: f"{s['sampling']}; oracle {s['oracle']}"),
        (f"{PRESSURE} --sampling mixed --chunk-size 0 --no-overlap --page-size 1", _retractions),
        (f"{PRESSURE} --sampling mixed --chunk-size 0 --no-overlap", _retractions),
        (f"{PRESSURE} --sampling mixed", _retractions),
        ("--shared-prefix 4 32 0.5 --follow-ups 0.3 --kv-tokens 2048", _hits),
        (SHARED, _hits),
        (f"{SHARED} --no-prefix-cache", _hits),
        (f"{BURST} --kv-tokens 8192 --device meta", _burst(8192)),
        (f"{BURST} --kv-tokens 4096 --device meta", _burst(4096)),
        (f"{BURST} --kv-tokens 8192", _burst(8192)),
        ("--attention paged --no-oracle", _step_time),
        ("--attention ragged --no-oracle", _step_time),
    )
    for options, describe in figures:
        summary, wall = simulate(options)
        _line(options, f"{describe(summary)}; whole command {wall:.1f} s")


def _steps(s: Numbers) -> str:
    return f"{s['steps']} steps, {s['mean_batch_size']:.1f} rows per forward on average"


def _retractions(s: Numbers) -> str:
    return f"{s['retractions']} retractions, {s['steps']} steps; oracle {s['oracle']}"


def _hits(s: Numbers) -> str:
    return (
        f"{s['cache_hits']}/{s['extended_requests']} prefills hit; {s['prefill_computed']}"
        f" tokens computed, {s['prefill_cached']} read from the cache; {s['chunks']} chunks;"
        f" {s['evicted_pages']} pages evicted; oracle {s['oracle']}"
    )


def _burst(kv_tokens: int) -> Callable[[Numbers], str]:
    def describe(s: Numbers) -> str:
        peak = round(float(str(s["peak_kv_use"])) * kv_tokens)
        return (
            f"{s['steps']} steps ({s['extend_steps']} extend), peak {peak} KV tokens in use,"
            f" {s['mean_batch_size']:.1f} rows per forward on average, {s['prefill_computed']}"
            f" prefill tokens computed, {s['duplicate_tokens_freed']} duplicate tokens freed;"
            f" oracle {s['oracle']}"
        )

    return describe


def _step_time(s: Numbers) -> str:
    # The engine loop's time per step: the forward and the bookkeeping around it.
    return f"{s['steps']} steps, {s['step_ms']:.2f} ms per step, engine loop {s['wall_s']:.2f} s"


def time_suite() -> None:
    """Wall time of the whole suite, and of the subset without the slow tests."""
    for argv in (["pytest", "-q"], ["pytest", "-q", "-m", "not slow"]):
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
        print(f"- `{' '.join(argv)}`: {time.perf_counter() - start:.0f} s ({tail})")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", help="redraw the default run's plot to this path")
    parser.add_argument("--suite", action="store_true", help="also time the test suite")
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    run_figures(args.plot)
    if args.suite:
        time_suite()


if __name__ == "__main__":
    main()
