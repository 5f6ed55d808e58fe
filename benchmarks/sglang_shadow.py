"""What `Shadow` costs per SGLang decode step, at batch 8, 64 and 256.

SGLang's own step here is its scheduler bookkeeping on CPU (`prepare_for_decode`,
the result processing with a fake model, `filter_batch`): no forward pass, so the
ratio is an upper bound of what a real deployment pays (its step also runs a
model). Each configuration decodes the same seeded batch twice in one run: bare,
and with a `Shadow` attached from before the first request (setup is not timed).

    python -m benchmarks.sglang_shadow [--steps 20]
"""

from __future__ import annotations

import argparse
import time
import warnings

from batchstate.sglang import Shadow, cpu_topology
from benchmarks.sglang_watch import BATCHES, _decoding


def _per_step(batch: int, steps: int, *, shadowed: bool) -> tuple[float, int]:
    shadow = Shadow(on_divergence="log").attach() if shadowed else None
    try:
        driver = _decoding(batch)
        start = time.perf_counter()
        for _ in range(steps):
            driver.step()
        elapsed = (time.perf_counter() - start) / steps
    finally:
        if shadow is not None:
            shadow.detach()
    return elapsed, 0 if shadow is None else len(shadow.divergences)


def main(argv: list[str] | None = None) -> None:
    """Print each batch size's per-step times and the ratio to SGLang's own step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    print("| batch | SGLang step (ms) | under Shadow (ms) | Shadow ratio | divergences |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    with cpu_topology():
        for batch in BATCHES:
            bare, _ = _per_step(batch, args.steps, shadowed=False)
            shadowed, divergences = _per_step(batch, args.steps, shadowed=True)
            print(
                f"| {batch} | {bare * 1e3:.2f} | {shadowed * 1e3:.2f} | {shadowed / bare:.1f}x "
                f"| {divergences} |"
            )


if __name__ == "__main__":
    main()
