"""A step's inputs written into captured-graph buffers: `python -m benchmarks.graph_buffers`.

For each batch size, a steady overlap decode loop on the CPU: each step
runs the transition (`decode_sampled`, fed the last step's tokens), then,
timed in the same step on its result: `fill_buffers` of one decode bucket's
buffers (allocated once, before the loop) straight from the record, and
for comparison `forward_inputs` then `pad` (fresh tensors, the page table
as wide as the table); then `finish_mixed` and the next step. Each figure is the
median over the steps; the ratios are against that step's
`decode_sampled`. Then, on `meta`, the kernels, copies and allocations of
one `fill_buffers`. Prints Markdown tables (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Final

import torch

from batchstate import (
    GraphBuffers,
    Req,
    Sampled,
    captured_size,
    decode,
    decode_sampled,
    extend,
    fill_buffers,
    filter_batch,
    finish_mixed,
    forward_inputs,
    idle,
    make_pools,
    pad,
)
from benchmarks.counting import count_allocations, count_device_work

_CAPTURED: Final = tuple(1 << shift for shift in range(14))  # 1 .. 8192


def measure(
    batch_size: int, prompt: int, page_size: int, steps: int, context: int
) -> dict[str, float]:
    """Median µs of each part of a decode step at one batch size, on the CPU."""
    device = torch.device("cpu")
    slots, width = batch_size + 2, max(context, prompt + steps + 8)
    row_pages = -(-(prompt + steps + 8) // page_size)
    pools = make_pools(slots, width, slots * row_pages * page_size, device, page_size)
    reqs = [Req(rid, tuple(range(1, prompt + 1))) for rid in range(batch_size)]
    extended, pools = extend(idle(device), reqs, pools).unwrap()
    decoding, pools = decode(extended, pools).unwrap()
    running = filter_batch(decoding, list(range(batch_size)))
    size = captured_size(_CAPTURED, batch_size).unwrap()
    buffers = GraphBuffers.for_decode(device, page_size, size, row_pages)
    tokens = torch.zeros(batch_size, dtype=torch.int64)
    times: dict[str, list[float]] = {"step": [], "fill": [], "inputs": [], "pad": []}
    for _ in range(steps):
        sampled = Sampled.of(running.rows, tokens)
        start = time.perf_counter()
        mixed, pools = decode_sampled(running, sampled, pools).unwrap()
        stepped = time.perf_counter()
        fill_buffers(buffers, mixed, pools.table).unwrap()
        filled = time.perf_counter()
        inputs = forward_inputs(mixed, pools.table, page_size)
        built = time.perf_counter()
        pad(inputs, _CAPTURED).unwrap()
        padded = time.perf_counter()
        running = finish_mixed(mixed).running
        for name, (a, b) in {
            "step": (start, stepped),
            "fill": (stepped, filled),
            "inputs": (filled, built),
            "pad": (built, padded),
        }.items():
            times[name].append((b - a) * 1e6)
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "batch_size": batch_size,
        "bucket": size,
        "decode_sampled_us": median["step"],
        "forward_inputs_us": median["inputs"],
        "fill_us": median["fill"],
        "pad_us": median["pad"],
        "fill_ratio": median["fill"] / median["step"],
        "pad_ratio": (median["inputs"] + median["pad"]) / median["step"],
    }


def count(batch_size: int, page_size: int) -> dict[str, int]:
    """Kernels, host-to-device copies and allocations of one `fill_buffers`, on meta."""
    meta = torch.device("meta")
    pools = make_pools(batch_size + 1, 256, (batch_size + 1) * 256, meta, page_size)
    reqs = [Req(rid, tuple(range(1, 40))) for rid in range(batch_size)]
    extended, pools = extend(idle(meta), reqs, pools).unwrap()
    decoding, pools = decode(extended, pools).unwrap()
    buffers = GraphBuffers.for_decode(meta, page_size, batch_size + 1, -(-256 // page_size))
    with count_device_work() as work, count_allocations() as made:
        fill_buffers(buffers, decoding, pools.table).unwrap()
    with count_allocations() as padded:
        pad(forward_inputs(decoding, pools.table, page_size), _CAPTURED).unwrap()
    return {
        "kernels": work.kernels,
        "copies": work.copies,
        "allocations": len(made),
        "pad_allocations": len(padded),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point: print both tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--context", type=int, default=4096, help="the table's width, tokens")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"page size {args.page_size}, prompts of {args.prompt} tokens, a table {args.context}"
        f" tokens wide, median of {args.steps} steps"
    )
    print(
        "| batch | bucket | decode_sampled µs | fill µs | forward_inputs µs | pad µs"
        " | fill / step | (inputs + pad) / step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        point = measure(size, args.prompt, args.page_size, args.steps, args.context)
        print(
            f"| {size} | {point['bucket']} | {point['decode_sampled_us']:.1f}"
            f" | {point['fill_us']:.1f} | {point['forward_inputs_us']:.1f}"
            f" | {point['pad_us']:.1f} | {point['fill_ratio']:.2f} | {point['pad_ratio']:.2f} |",
            flush=True,
        )
    print()
    print("| page size | fill: kernels | fill: copies | fill: allocations | pad: allocations |")
    print("|---:|---:|---:|---:|---:|")
    for page_size in (1, args.page_size):
        work = count(8, page_size)
        print(
            f"| {page_size} | {work['kernels']} | {work['copies']} | {work['allocations']}"
            f" | {work['pad_allocations']} |"
        )


if __name__ == "__main__":
    main()
