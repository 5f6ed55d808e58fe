"""What a driven SGLang scheduler step costs against stock SGLang's, at batch 8, 64,
256 and 1024.

Both sides run SGLang 0.5.23's real scheduler loop (`SchedulerLoop`: its own
`get_next_batch_to_run`, `run_batch`, `process_batch_result`, the overlap scheduler,
radix cache and chunked prefill on, pages of 16) with the fake model worker, one of
them driven by batchstate (`Drive`). Each batch size admits the same seeded requests
on both sides (distinct 32-token prompts, every request decoding to the end of the
run; the prefills are not timed), then decodes them interleaved in blocks of 8 steps
(who goes first rotates). A step's bookkeeping is its time on the thread's CPU clock
(`time.thread_time_ns`) less the fake model's forward, with the garbage collector
off; a figure is the median over the timed steps, the ratio driven over stock.

    python -m benchmarks.sglang_drive [--steps 64] [--sizes 8 64 256 1024]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import warnings
from typing import Any, NamedTuple

from batchstate.sglang import cpu_topology
from batchstate.sglang.driven.drive import Drive
from batchstate.sglang.scheduler_loop import SchedulerLoop

BATCHES = (8, 64, 256, 1024)
PROMPT = 32
PAGE = 16


class Row(NamedTuple):
    """Median bookkeeping ms per decode step: stock SGLang, driven; rows decoded."""

    batch: int
    stock_ms: float
    driven_ms: float
    rows: int


class _Timed:
    """A loop whose fake forward's thread time is kept apart from the step's."""

    def __init__(self, batch: int, steps: int, driven: bool, seed: int) -> None:
        new_tokens = steps + 64
        self.loop = SchedulerLoop(
            page_size=PAGE,
            kv_tokens=batch * (PROMPT + new_tokens + 2 * PAGE),
            rows=batch,
            context=PROMPT + new_tokens + 2 * PAGE,
            overlap=True,
        )
        self.drive = Drive(self.loop.scheduler).attach() if driven else None
        self.model_ns = 0
        forward = self.loop.worker.forward_batch_generation

        def timed(batch: Any, **kwargs: object) -> object:
            start = time.thread_time_ns()
            try:
                return forward(batch, **kwargs)
            finally:
                self.model_ns += time.thread_time_ns() - start

        self.loop.worker.forward_batch_generation = timed  # type: ignore[method-assign]
        rng = random.Random(seed)
        for _ in range(batch):
            self.loop.submit([rng.randrange(100, 30000) for _ in range(PROMPT)], new_tokens)
        while (
            len(self.loop.scheduler.running_batch.reqs) < batch or self.loop.scheduler.waiting_queue
        ):
            self.loop.step()

    def step(self) -> int:
        """One step's bookkeeping, in ns of thread time."""
        before = self.model_ns
        start = time.thread_time_ns()
        self.loop.step()
        return time.thread_time_ns() - start - (self.model_ns - before)


def measure(batch: int, steps: int, block: int = 8) -> Row:
    """Decode `batch` requests on both sides, interleaved in blocks of `block` steps (one
    untimed block each first); about `steps` timed steps each."""
    sides = [_Timed(batch, steps, driven, seed=batch) for driven in (False, True)]
    spans: list[list[int]] = [[], []]
    gc.collect()
    gc.disable()  # a collection lands on whichever side happens to allocate past the mark
    try:
        for turn in range(1 + -(-steps // block)):
            for at in range(2):
                which = (turn + at) % 2
                for _ in range(block):
                    span = sides[which].step()
                    if turn > 0:
                        spans[which].append(span)
                gc.collect()
    finally:
        gc.enable()
    rows = len(sides[1].loop.scheduler.running_batch.reqs)
    for side in sides:
        if side.drive is not None:
            side.drive.detach()
    stock, driven = (statistics.median(s) / 1e6 for s in spans)
    return Row(batch, stock, driven, rows)


def main(argv: list[str] | None = None) -> None:
    """Print each batch size's bookkeeping per step and the driven/stock ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="timed steps per side")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(BATCHES))
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    print("| batch | stock SGLang step (ms) | driven step (ms) | driven / stock |")
    print("| ---: | ---: | ---: | ---: |")
    for batch in args.sizes:
        with cpu_topology(
            max_running_requests=batch,
            chunked_prefill_size=4096,
            page_size=PAGE,
            pp_max_micro_batch_size=batch,
        ):
            row = measure(batch, args.steps)
        print(
            f"| {batch} | {row.stock_ms:.2f} | {row.driven_ms:.2f} "
            f"| {row.driven_ms / row.stock_ms:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
