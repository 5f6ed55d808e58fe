"""What `check_pools` costs an engine, against the production step it checks.

Runs the production step (`benchmarks.production_plan`: prefix cache on,
chunked prefill, overlap; one request finishes and one arrives every step)
and after each step calls `check_pools(pools, [running])`, both timed, in the
same run. Prints each one's median and the ratio check / step per batch size.

    python -m benchmarks.check_cost [--sizes 8 64 256 1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from batchstate import check_pools
from benchmarks.production import run_turn
from benchmarks.production_batchstate import BatchstateProduction
from benchmarks.production_plan import make_production_plan

__all__ = ["main", "measure"]


def measure(batch_size: int, page_size: int, steps: int, warmup: int) -> dict[str, Any]:
    """Median µs of one production step and of `check_pools` after it, and their ratio."""
    plan = make_production_plan(batch_size, page_size, warmup + steps)
    impl = BatchstateProduction(plan)
    clock = time.perf_counter_ns
    step_ns: list[int] = []
    check_ns: list[int] = []
    for index, turn in enumerate(plan.turns):
        t0 = clock()
        run_turn(impl, turn)
        t1 = clock()
        check_pools(impl.pools, [impl.running])
        t2 = clock()
        if index >= warmup:
            step_ns.append(t1 - t0)
            check_ns.append(t2 - t1)
    step, check = statistics.median(step_ns) / 1e3, statistics.median(check_ns) / 1e3
    return {
        "batch_size": batch_size,
        "page_size": page_size,
        "step_us": step,
        "check_us": check,
        "ratio": check / step,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--pages", type=int, nargs="+", default=[16])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per point")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per point first")
    args = parser.parse_args(argv)
    print("| page | rows | step µs | check_pools µs | check / step |")
    print("|---:|---:|---:|---:|---:|")
    for page_size in args.pages:
        for size in args.sizes:
            point = measure(size, page_size, args.steps, args.warmup)
            print(
                f"| {page_size} | {size} | {point['step_us']:.0f} | {point['check_us']:.0f}"
                f" | {point['ratio']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
