"""Where (a)'s step time goes: per phase, then per function, in microseconds per step.

Runs batchstate's plain step (see `benchmarks.scenario`) alone, first
untimed, then timed per phase (median of the steps, no profiler), then
under `cProfile`, whose own-time figures are scaled to one step. The
profiler slows every Python call, so its column says where time goes, not
how much there is: the "µs per step" column is the profiled own time
divided by the steps, and the "share" column its fraction of the profiled
step.

    python -m benchmarks.profile [--sizes 8 64] [--page 1] [--steps 3000] [--top 12]
    python -m benchmarks.profile --production [--sizes 8 64 256]

`--production` profiles the production cycle instead (`benchmarks.production_plan`:
prefix cache, chunked prefill, overlap) with the standard `Sampling` columns, and
adds each source module's share of the cycle's own time.

To compare two versions of the library, run it once per checkout (with
`PYTHONPATH=<checkout>/src`).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.impl_batchstate import BatchstateStep
from benchmarks.measure import run_step, timed_step
from benchmarks.production import run_turn
from benchmarks.production_batchstate import BatchstateProduction
from benchmarks.production_plan import make_production_plan
from benchmarks.scenario import PHASES, Config, make_plan

__all__ = ["main", "profile_point", "profile_production"]


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
    title = f"batch {batch_size}, page {page_size}: median µs per phase: {phases}"
    return "\n".join([title, "", *_functions(profiler, num_steps, top)])


def profile_production(batch_size: int, page_size: int, num_turns: int, top: int) -> str:
    """The production cycle with `Sampling` columns: its median, the `top` functions by own
    time, and each module's share of the cycle, as Markdown."""
    plan = make_production_plan(batch_size, page_size, 3 * num_turns)
    impl = BatchstateProduction(plan, sampling=True)
    warm, timed, profiled = (plan.turns[k * num_turns : (k + 1) * num_turns] for k in range(3))
    for turn in warm:
        run_turn(impl, turn)
    cycles = []
    clock = time.thread_time_ns
    for turn in timed:
        start = clock()
        impl.decode()
        impl.prefill(turn)
        middle = clock()
        impl.forward(turn)  # the model's part: left out of the cycle and the profile
        resume = clock()
        impl.settle()
        impl.release(turn)
        impl.merge()
        cycles.append(middle - start + clock() - resume)
    profiler = cProfile.Profile()
    gc.collect()
    for turn in profiled:
        profiler.enable()
        impl.decode()
        impl.prefill(turn)
        profiler.disable()
        impl.forward(turn)
        profiler.enable()
        impl.settle()
        impl.release(turn)
        impl.merge()
        profiler.disable()
    title = (
        f"production, Sampling columns, batch {batch_size}, page {page_size}:"
        f" median cycle {statistics.median(cycles) / 1000:.0f} µs (thread CPU time)"
    )
    lines = [title, "", *_functions(profiler, num_turns, top), ""]
    lines += ["| module (own time, with the C calls it makes) | share |", "|---|---:|"]
    rows = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # untyped table
    total = sum(entry[2] for entry in rows.values())
    modules: dict[str, float] = {}
    for (file, _, _), entry in rows.items():
        # A C function's (numpy's, torch's) own time goes to the modules that called it.
        owners = [(file, entry[2])] if file != "~" else [(c[0], s[2]) for c, s in entry[4].items()]
        for owner, own in owners:
            modules[Path(owner).name] = modules.get(Path(owner).name, 0.0) + own
    for module, own in sorted(modules.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"| `{module}` | {own / total:.0%} |")
    return "\n".join(lines)


def _functions(profiler: cProfile.Profile, num_steps: int, top: int) -> list[str]:
    lines = ["| function (own time) | µs per step | share |", "|---|---:|---:|"]
    stats = pstats.Stats(profiler)
    rows = stats.stats  # type: ignore[attr-defined]  # pstats keeps its table untyped
    total = sum(entry[2] for entry in rows.values())
    ranked = sorted(rows.items(), key=lambda item: -item[1][2])[:top]
    for (file, line, name), entry in ranked:
        where = f"{Path(file).name}:{line} {name}" if line else name
        lines.append(f"| `{where}` | {entry[2] / num_steps * 1e6:.1f} | {entry[2] / total:.0%} |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Print the profile of each batch size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--page", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3000, help="steps per part")
    parser.add_argument("--top", type=int, default=12, help="functions to list")
    parser.add_argument("--production", action="store_true", help="the production cycle")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    point = profile_production if args.production else profile_point
    for size in args.sizes:
        print(point(size, args.page, args.steps, args.top), end="\n\n")
    print(f"in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
