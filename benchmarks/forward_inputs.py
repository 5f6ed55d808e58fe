"""Cost of the forward inputs beside the step: `python -m benchmarks.forward_inputs`.

For each batch size, a running batch of that many requests (prompts of
`--prompt` tokens) is decoded once; then, timed in the same run and on the
same records: the step's transition (`decode`), `forward_inputs` of the
`Decoding` it returns, and `pad` of those inputs to the next power of two.
The ratios are against that `decode`. Then, on `meta`, the device kernels
and host-to-device copies of building and padding the inputs of a decode,
an extend and a mixed forward. Prints Markdown tables (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchstate import (
    ForwardPhase,
    Pools,
    Req,
    decode,
    extend,
    filter_batch,
    forward_inputs,
    idle,
    make_pools,
    mix,
    pad,
)
from benchmarks.counting import count_device_work

_CAPTURED = tuple(1 << shift for shift in range(14))  # 1 .. 8192


def _best_us(work: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def _best_decode_us(batch_size: int, prompt: int, page_size: int, repeats: int) -> float:
    # Pools are linear: each timed decode takes fresh records, built outside the timing.
    best = float("inf")
    for _ in range(repeats):
        running, pools = _running(batch_size, prompt, page_size, torch.device("cpu"))
        start = time.perf_counter()
        decode(running, pools).unwrap()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def _running(
    batch_size: int, prompt: int, page_size: int, device: torch.device
) -> tuple[Any, Pools]:
    # Two spare slots and room for 128 more tokens each: the meta counts admit into them.
    slots, width = batch_size + 2, prompt + 128
    pools = make_pools(slots, width, slots * width, device, page_size)
    reqs = [Req(rid, tuple(range(1, prompt + 1))) for rid in range(batch_size)]
    extended, pools = extend(idle(device), reqs, pools).unwrap()
    decoding, pools = decode(extended, pools).unwrap()
    return filter_batch(decoding, list(range(batch_size))), pools


def measure(batch_size: int, prompt: int, page_size: int, repeats: int) -> dict[str, float]:
    """µs of decode, forward_inputs and pad at one batch size, on the CPU, and their ratios."""
    running, pools = _running(batch_size, prompt, page_size, torch.device("cpu"))
    decoding, after = decode(running, pools).unwrap()
    inputs = forward_inputs(decoding, after.table, page_size)
    step = _best_decode_us(batch_size, prompt, page_size, repeats)
    build = _best_us(lambda: forward_inputs(decoding, after.table, page_size), repeats)
    padding = _best_us(lambda: pad(inputs, _CAPTURED), repeats)
    return {
        "batch_size": batch_size,
        "decode_us": step,
        "forward_inputs_us": build,
        "pad_us": padding,
        "inputs_ratio": build / step,
        "pad_ratio": padding / step,
    }


def count(page_size: int) -> dict[str, dict[str, int]]:
    """Kernels and copies of building and padding a forward's inputs, on meta, per forward kind."""
    meta = torch.device("meta")
    # Each forward from records of its own: a transition moves its pools on.
    running, pools = _running(8, 40, page_size, meta)
    decoding, after = decode(running, pools).unwrap()
    _, pools = _running(8, 40, page_size, meta)
    extended, cached = extend(idle(meta), [Req(100, tuple(range(1, 70)))], pools).unwrap()
    running, pools = _running(8, 40, page_size, meta)
    mixed, mixed_pools = mix(running, [Req(200, tuple(range(1, 50)))], 32, pools, [1] * 8).unwrap()
    cases: dict[str, tuple[ForwardPhase[Any], Pools]] = {
        "decode": (decoding, after),
        "extend": (extended, cached),
        "mixed": (mixed, mixed_pools),
    }
    counts = {}
    for name, (batch, held) in cases.items():
        with count_device_work() as built:
            inputs = forward_inputs(batch, held.table, page_size)
        with count_device_work() as padded:
            pad(inputs, _CAPTURED)
        counts[name] = {
            "build_kernels": built.kernels,
            "build_copies": built.copies,
            "pad_kernels": padded.kernels,
            "pad_copies": padded.copies,
        }
    return counts


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point: print both tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"page size {args.page_size}, prompts of {args.prompt} tokens, best of {args.repeats}")
    print("| batch | decode µs | forward_inputs µs | pad µs | inputs / decode | pad / decode |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        point = measure(size, args.prompt, args.page_size, args.repeats)
        print(
            f"| {size} | {point['decode_us']:.1f} | {point['forward_inputs_us']:.1f}"
            f" | {point['pad_us']:.1f} | {point['inputs_ratio']:.2f} | {point['pad_ratio']:.2f} |",
            flush=True,
        )
    print()
    print("| forward | page size | build: kernels | build: copies | pad: kernels | pad: copies |")
    print("|---|---:|---:|---:|---:|---:|")
    for page_size in (1, args.page_size):
        for name, work in count(page_size).items():
            print(
                f"| {name} | {page_size} | {work['build_kernels']} | {work['build_copies']}"
                f" | {work['pad_kernels']} | {work['pad_copies']} |"
            )


if __name__ == "__main__":
    main()
