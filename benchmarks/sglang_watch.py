"""What `Watch` and `audit` cost per SGLang decode step, at batch 8, 64 and 256.

SGLang's own step here is its scheduler bookkeeping on CPU (`prepare_for_decode`,
the result processing with a fake model, `filter_batch`): no forward pass, so the
ratios are upper bounds of what a real deployment pays (its step also runs a model).
Each configuration decodes the same seeded batch three ways in one run: bare, under
`Watch` (an audit after every lifecycle call), and bare plus one `audit` per step.

    python -m benchmarks.sglang_watch [--steps 20]
"""

from __future__ import annotations

import argparse
import random
import time
import warnings
from collections.abc import Callable

from batchstate.sglang import Watch, audit, cpu_topology
from batchstate.sglang.drive import Driver

BATCHES = (8, 64, 256)


def _decoding(batch: int, seed: int = 0) -> Driver:
    """A driver whose running batch holds `batch` requests, past their prefill."""
    driver = Driver(page_size=1, kv_tokens=batch * 200, rows=batch, context=256, seed=seed)
    rng = random.Random(seed)
    shared = [rng.randrange(100, 30000) for _ in range(32)]
    for _ in range(batch):
        driver.submit(shared + [rng.randrange(100, 30000) for _ in range(16)], 200)
    for _ in range(batch):  # admission reserves room for half of each request's output
        if not driver.waiting:
            return driver
        driver.step()
    raise RuntimeError(f"{len(driver.waiting)} requests still waiting after {batch} steps")


def _per_step(driver: Driver, steps: int, extra: Callable[[Driver], object]) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        driver.step()
        extra(driver)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> None:
    """Print each batch size's per-step times and the ratios to SGLang's own step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    print(
        "| batch | SGLang step (ms) | under Watch (ms) | Watch ratio | + audit (ms) | audit ratio |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    with cpu_topology():
        for batch in BATCHES:
            bare = _per_step(_decoding(batch), args.steps, lambda d: None)
            with Watch():
                watched = _per_step(_decoding(batch), args.steps, lambda d: None)
            audited = _per_step(_decoding(batch), args.steps, lambda d: audit(d.running))
            print(
                f"| {batch} | {bare * 1e3:.2f} | {watched * 1e3:.2f} | {watched / bare:.1f}x "
                f"| {audited * 1e3:.2f} | {audited / bare:.1f}x |"
            )


if __name__ == "__main__":
    main()
