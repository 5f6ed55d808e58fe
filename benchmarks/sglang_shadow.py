"""What `Shadow` costs per SGLang decode step, at batch 8, 64 and 256.

SGLang's own step here is its scheduler bookkeeping on CPU (`filter_batch`,
`check_decode_mem`, `prepare_for_decode`, the result processing with a fake
model): no forward pass, so the ratio is an upper bound of what a real
deployment pays (its step also runs a model). Each batch size decodes the same
seeded batch three ways, interleaved step by step in one process (who goes first
rotates): bare, under a `Shadow` comparing after every call, and under a
`Shadow(full_check_every=N)`, in blocks of 8 steps per side. Each shadow is
attached from before its driver's first request (setup, the prefills, is not
timed) and only while its own driver steps (attached again for each of its
blocks), so it sees every call of its driver and none of the others'. Each step is
timed on the thread's CPU clock (`time.thread_time_ns`: time other processes
take from this one is not counted), with the garbage collector off; a figure is
the median over the timed steps, a ratio is the shadowed median over the bare.

    python -m benchmarks.sglang_shadow [--steps 64] [--every 16] [--sizes 8 64 256]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings
from typing import NamedTuple

from batchstate.sglang import Shadow, cpu_topology
from batchstate.sglang.drive import Driver
from benchmarks.sglang_watch import BATCHES, _decoding


class Row(NamedTuple):
    """Median ms per step: bare, under a full shadow, under a sampled one; divergences."""

    batch: int
    bare_ms: float
    shadow_ms: float
    sampled_ms: float
    divergences: int


def measure(batch: int, steps: int, every: int, block: int = 8) -> Row:
    """Decode `batch` requests three ways, interleaved in blocks of `block` steps (one
    untimed block each first); about `steps` timed steps each."""
    sides: list[tuple[Driver, Shadow | None]] = [(_decoding(batch), None)]
    for every_nth in (1, every):
        with Shadow(on_divergence="log", full_check_every=every_nth) as watching:
            sides.append((_decoding(batch), watching))  # attached while it admits, prefills
    spans: list[list[int]] = [[] for _ in sides]
    clock = time.thread_time_ns
    gc.collect()
    gc.disable()  # a collection lands on whichever side happens to allocate past the mark
    try:
        for turn in range(1 + -(-steps // block)):
            for at in range(len(sides)):  # who goes first rotates
                which = (turn + at) % len(sides)
                driver, shadow = sides[which]
                if shadow is not None:
                    shadow.attach()
                for _ in range(block):
                    start = clock()
                    driver.step()
                    span = clock() - start
                    if turn > 0:
                        spans[which].append(span)
                if shadow is not None:
                    shadow.detach()
                gc.collect()
    finally:
        gc.enable()
    bare, full, sampled = (statistics.median(s) / 1e6 for s in spans)
    divergences = sum(len(s.divergences) for _, s in sides if s is not None)
    return Row(batch, bare, full, sampled, divergences)


def main(argv: list[str] | None = None) -> None:
    """Print each batch size's per-step times and the ratios to SGLang's own step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="timed steps per configuration")
    parser.add_argument("--every", type=int, default=16, help="the sampled shadow's N")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(BATCHES))
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    print(
        "| batch | SGLang step (ms) | under Shadow (ms) | Shadow ratio "
        f"| full_check_every={args.every} (ms) | sampled ratio | divergences |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with cpu_topology():
        for batch in args.sizes:
            row = measure(batch, args.steps, args.every)
            print(
                f"| {batch} | {row.bare_ms:.2f} | {row.shadow_ms:.2f} "
                f"| {row.shadow_ms / row.bare_ms:.2f}x | {row.sampled_ms:.2f} "
                f"| {row.sampled_ms / row.bare_ms:.2f}x | {row.divergences} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
