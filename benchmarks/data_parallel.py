"""Engine steps per second on 1, 2 and 4 data-parallel ranks: `python -m benchmarks.data_parallel`.

Runs one workload (the oracle off) in one process, the baseline, then on N
spawned ranks over gloo, and prints a Markdown table: steps with work,
steps/s and generated tokens/s of the engine loop, idle rank-steps, and
steps/s against the one-process run. On the CPU with a tiny model this
measures bookkeeping and collectives (an exchange and two collectives per
layer every step), not model speed: the forwards are microseconds.
"""

from __future__ import annotations

import argparse

import torch

from batchstate.engine import (
    DataParallelConfig,
    EngineConfig,
    SimulationConfig,
    WorkloadConfig,
    launch,
    simulate,
)


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    config = SimulationConfig(
        workload=WorkloadConfig(num_requests=args.requests),
        engine=EngineConfig(chunk_size=32, mixed=True),  # `--chunk-size 32 --mixed`
        oracle=False,
    )
    torch.set_num_threads(1)
    alone = simulate(config)
    base = len(alone.trace) / alone.wall_s
    print(f"{args.requests} requests, {torch.get_num_threads()} torch thread per process")
    print("| ranks | steps | steps/s | tokens/s | idle rank-steps | steps/s vs one process |")
    print("|---|---|---|---|---|---|")
    tokens = sum(map(len, alone.outputs.values()))
    rate = tokens / alone.wall_s
    print(f"| one process | {len(alone.trace)} | {base:.0f} | {rate:.0f} | - | 1.00 |")
    for ranks in args.ranks:
        run = launch(config, DataParallelConfig(ranks), show_progress=False)
        rate = run.steps / run.wall_s
        tokens = sum(map(len, run.outputs.values()))
        idle = sum(rank.idle_steps for rank in run.ranks)
        print(
            f"| {ranks} | {run.steps} | {rate:.0f} | {tokens / run.wall_s:.0f} | {idle} |"
            f" {rate / base:.2f} |"
        )


if __name__ == "__main__":
    main()
