"""Where (a)'s step time goes: per phase, then per function, in microseconds per step.

Runs batchstate's plain step (see `benchmarks.scenario`) alone, first
untimed, then timed per phase (median of the steps, no profiler), then
under `cProfile`, whose own-time figures are scaled to one step. The
profiler slows every Python call, so its column says where time goes, not
how much there is: the "µs per step" column is the profiled own time
divided by the steps, and the "share" column its fraction of the profiled
step.

    python -m benchmarks.profile [--sizes 8 64] [--page 1] [--steps 3000] [--top 12]

To compare two versions of the library, run it once per checkout (with
`PYTHONPATH=<checkout>/src`).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.impl_batchstate import BatchstateStep
from benchmarks.measure import run_step, timed_step
from benchmarks.scenario import PHASES, Config, make_plan

__all__ = ["main", "profile_point"]


def profile_point(batch_size: int, page_size: int, num_steps: int, top: int) -> str:
    """The phase medians and the `top` functions by own time, as Markdown."""
    plan = make_plan(Config(batch_size, page_size), 3 * num_steps)
    impl = BatchstateStep(plan)
    warm, timed, profiled = (plan.steps[k * num_steps : (k + 1) * num_steps] for k in range(3))
    for join in warm:
        run_step(impl, join)
    durations: dict[str, list[int]] = {phase: [] for phase in (*PHASES, "step")}
    for join in timed:
        timed_step(impl, join, durations)
    profiler = cProfile.Profile()
    profiler.enable()
    for join in profiled:
        run_step(impl, join)
    profiler.disable()
    phases = " | ".join(
        f"{phase} {statistics.median(durations[phase]) / 1000:.1f}" for phase in (*PHASES, "step")
    )
    lines = [
        f"batch {batch_size}, page {page_size}: median µs per phase: {phases}",
        "",
        "| function (own time) | µs per step | share |",
        "|---|---:|---:|",
    ]
    stats = pstats.Stats(profiler)
    rows = stats.stats  # type: ignore[attr-defined]  # pstats keeps its table untyped
    total = sum(entry[2] for entry in rows.values())
    ranked = sorted(rows.items(), key=lambda item: -item[1][2])[:top]
    for (file, line, name), entry in ranked:
        where = f"{Path(file).name}:{line} {name}" if line else name
        lines.append(f"| `{where}` | {entry[2] / num_steps * 1e6:.1f} | {entry[2] / total:.0%} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the profile of each batch size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--page", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3000, help="steps per part")
    parser.add_argument("--top", type=int, default=12, help="functions to list")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    for size in args.sizes:
        print(profile_point(size, args.page, args.steps, args.top), end="\n\n")
    print(f"in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
