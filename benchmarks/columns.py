"""What a column set costs: the step with no columns, `Sampling` and eight columns, interleaved.

    python -m benchmarks.columns                 # sizes 1 8 64 256 1024, pages 1 16
    python -m benchmarks.columns --sizes 8 64 --repeats 200

The same step as `benchmarks.step` ((a) batchstate), run three times in one
process, step by step in rotating order: once with no columns (the
default), once with the standard `Sampling` set (five mirrored columns; each
request joins with its own parameters, built with `Sampling.of`, which the
extend phase includes), and once with `EightColumns` (eight mirrored
columns of float32, int32 and int64, built with `build_columns` from host
lists). It prints the step medians, their ratios to no columns, and the
host-to-device copies and device kernels per step counted on the meta
device.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Final

import torch

from benchmarks.impl_batchstate import BatchstateStep
from benchmarks.measure import count_work, time_config
from benchmarks.scenario import Config, Implementation, Plan

__all__ = ["main", "run"]

VARIANTS: Final[tuple[Callable[[Plan], Implementation], ...]] = (
    BatchstateStep,
    functools.partial(BatchstateStep, columns="sampling"),
    functools.partial(BatchstateStep, columns="eight"),
)
_NAMES: Final = ("batchstate", "batchstate+sampling", "batchstate+eight")


def run(sizes: Sequence[int], pages: Sequence[int], repeats: int, warmup: int) -> list[str]:
    """One markdown row per (page size, batch size)."""
    rows = [
        "| page | batch | no columns µs | `Sampling` µs | ratio | 8 columns µs | ratio"
        " | copies per step (none / sampling / 8) | kernels per step (none / sampling / 8) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for page_size in pages:
        for batch_size in sizes:
            config = Config(batch_size, page_size)
            timings = time_config(config, repeats, warmup, VARIANTS)
            plain, sampled, eight = (
                statistics.median(timings[name]["step"]) / 1e3 for name in _NAMES
            )
            work = count_work(config, 4, VARIANTS)
            copies = " / ".join(f"{work[name]['step']['copies']:.0f}" for name in _NAMES)
            kernels = " / ".join(f"{work[name]['step']['kernels']:.0f}" for name in _NAMES)
            rows.append(
                f"| {page_size} | {batch_size} | {plain:.0f} | {sampled:.0f}"
                f" | {sampled / plain:.2f} | {eight:.0f} | {eight / plain:.2f}"
                f" | {copies} | {kernels} |"
            )
            print(rows[-1], flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=300, help="timed steps per point")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps per point first")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as benchmarks.step: tiny host ops are erratic on a thread pool
    rows = run(args.sizes, args.pages, args.repeats, args.warmup)
    print()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
