"""The reference engine's feed with captured sizes: `python -m benchmarks.engine_feed`.

Runs `simulate` on the CPU (the tiny model, oracle off) with
`--cuda-graph-sizes 1 2 4 8 16 32 64`, alternately two ways, the same
seeded workload each time: the engine's path, each padded forward
written into its bucket's `GraphBuffers` by `fill_buffers` (its input ids into the
bucket's ids buffer), and the baseline it replaced,
`pad(forward_inputs(...))` and `pad_tokens` into fresh tensors (swapped
in for `Buckets.fill` and `Buckets.pad_ids`). Prints, for each, the median µs of a padded forward's
feed and the median ms of a step (each the median over the repeats), and
the ratios against the baseline measured in the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Final
from unittest import mock

import attrs
import torch

from batchstate import Padded, Pools, forward_inputs, pad
from batchstate.engine import Feeder, SimulationConfig, WorkloadConfig, simulate
from batchstate.engine._buckets import Buckets

SIZES: Final = (1, 2, 4, 8, 16, 32, 64)


def padded_afresh(self: Buckets, batch: Any, pools: Pools, size: int) -> Padded:
    """The baseline: the forward's inputs built afresh, then padded to `size`."""
    return pad(forward_inputs(batch, pools.table, pools.page_size), [size]).unwrap()


def ids_afresh(self: Buckets, padded: Padded, input_ids: torch.Tensor) -> torch.Tensor:
    """The baseline's input ids: padded into a fresh tensor."""
    return padded.pad_tokens(input_ids)


def run_once(config: SimulationConfig, *, baseline: bool) -> tuple[float, float]:
    """One run: the median µs of a padded forward's feed, and the median ms of a step."""
    feeds: list[float] = []
    inputs = Feeder.inputs

    def timed(self: Feeder, batch: Any, pools: Pools) -> Any:
        start = time.perf_counter()
        fed = inputs(self, batch, pools)
        if isinstance(fed, Padded):
            feeds.append(time.perf_counter() - start)
        return fed

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(Feeder, "inputs", timed))
        if baseline:
            patches.enter_context(mock.patch.object(Buckets, "fill", padded_afresh))
            patches.enter_context(mock.patch.object(Buckets, "pad_ids", ids_afresh))
        run = simulate(config)
    return statistics.median(feeds) * 1e6, statistics.median(run.trace.step_s) * 1e3


def main() -> None:
    """Alternate the two ways `--repeats` times and print a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    workload = attrs.evolve(WorkloadConfig(), num_requests=args.requests)
    config = SimulationConfig(workload=workload, cuda_graph_sizes=SIZES, oracle=False)
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for baseline in (True, False):
            results[baseline].append(run_once(config, baseline=baseline))
    feed = {way: statistics.median(r[0] for r in runs) for way, runs in results.items()}
    step = {way: statistics.median(r[1] for r in runs) for way, runs in results.items()}
    print("| feed | µs per padded forward | ms per step (median) |")
    print("|---|---|---|")
    print(f"| pad(forward_inputs) (baseline) | {feed[True]:.0f} | {step[True]:.2f} |")
    print(f"| fill into the bucket | {feed[False]:.0f} | {step[False]:.2f} |")
    print(f"| fill / baseline | {feed[False] / feed[True]:.2f} | {step[False] / step[True]:.2f} |")


if __name__ == "__main__":
    main()
