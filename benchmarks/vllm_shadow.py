"""What `batchstate.vllm.Shadow` costs per vLLM v1 decode step, at batch 8 and 62.

vLLM's own step here is its real scheduler on a CPU (`schedule()` and
`update_from_output()` with a fake model runner's output): no forward pass, so the
ratio is an upper bound of what a deployment pays (its step also runs a model).
Each configuration decodes the same batch three times in one run: bare, with a
`Shadow` on the scheduler, and with the shadow also checking a `Worker`'s
`InputBatch` (whose own update is then counted in both the bare and the checked
step, so the third ratio is the check's). Setup (admitting and prefilling the
batch) is not timed.

    python -m benchmarks.vllm_shadow [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import time
import warnings
from typing import Any

from batchstate.vllm import Shadow
from batchstate.vllm.drive import SchedulerShape, fake_output, make_request, make_scheduler
from batchstate.vllm.worker import Worker

BATCHES = (8, 62)


def _decoding(batch: int) -> Any:
    shape = SchedulerShape(
        num_blocks=batch * 40, max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=4096
    )
    scheduler = make_scheduler(shape)
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(1, 1000) for _ in range(200)]
        scheduler.add_request(make_request(f"r{i}", prompt, 4000))
    return scheduler


def _per_step(batch: int, steps: int, *, shadowed: bool, worker: bool) -> tuple[float, int]:
    scheduler = _decoding(batch)
    shadow = Shadow(scheduler, on_divergence="log").attach() if shadowed else None
    runner = Worker(scheduler) if worker else None
    rng = random.Random(0)

    def step() -> None:
        output = scheduler.schedule()
        if runner is not None:
            runner.update(output)
            if shadow is not None:
                shadow.check_input_batch(runner.batch, output)
        model_output = fake_output(scheduler, output, rng)
        if runner is not None:
            runner.sampled(model_output)
        scheduler.update_from_output(output, model_output)

    step()  # the prefill: every request admitted, not timed
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = (time.perf_counter() - start) / steps
    if shadow is not None:
        shadow.detach()
    return elapsed, 0 if shadow is None else len(shadow.divergences)


def main(argv: list[str] | None = None) -> None:
    """Print each batch size's per-step times and the ratios to vLLM's own step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    print(
        "| batch | vLLM step (ms) | under Shadow (ms) | ratio | step + InputBatch (ms) "
        "| checked too (ms) | ratio | divergences |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in BATCHES:
        bare, _ = _per_step(batch, args.steps, shadowed=False, worker=False)
        shadowed, found = _per_step(batch, args.steps, shadowed=True, worker=False)
        runner, _ = _per_step(batch, args.steps, shadowed=False, worker=True)
        checked, more = _per_step(batch, args.steps, shadowed=True, worker=True)
        print(
            f"| {batch} | {bare * 1e3:.2f} | {shadowed * 1e3:.2f} | {shadowed / bare:.1f}x "
            f"| {runner * 1e3:.2f} | {checked * 1e3:.2f} | {checked / runner:.1f}x "
            f"| {found + more} |"
        )


if __name__ == "__main__":
    main()
