"""Hybrid pools against full-attention pools: `python -m benchmarks.hybrid`.

For each batch size, a running batch of that many requests (prompts of
`--prompt` tokens) takes one decode step, timed in the same run on pools
made two ways: full attention only, and hybrid (a sliding window of
`--window` tokens and a recurrent state per request). Timed: the step's
transition (`decode`), and the step with its forward inputs (`decode`,
`forward_inputs`, and `hybrid_inputs` for the hybrid pools). The ratios are
hybrid over full attention. Then, on `meta`, the device kernels and copies
of one decode on each kind of pools. Last, the memory each kind holds at
the end of a long decode run: the window pages stay one window per row.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchstate import (
    FULL_ATTENTION,
    MemoryKinds,
    Pools,
    RecurrentState,
    Req,
    SlidingWindow,
    check_pools,
    decode,
    extend,
    filter_batch,
    forward_inputs,
    hybrid_inputs,
    idle,
    make_pools,
)
from benchmarks.counting import count_device_work

CPU = torch.device("cpu")


def hybrid_kinds(batch_size: int, window: int, page_size: int) -> MemoryKinds:
    """A window of `window` tokens (room for every row's prompt) and one state per row."""
    return MemoryKinds(
        (
            SlidingWindow(window, (batch_size + 2) * (window + 128 + 2 * page_size)),
            RecurrentState(state_size=4096, num_states=batch_size + 2),
        )
    )


def _running(
    batch_size: int, prompt: int, page_size: int, memory: MemoryKinds, device: torch.device
) -> tuple[Any, Pools]:
    slots, width = batch_size + 2, prompt + 128
    pools = make_pools(slots, width, slots * width, device, page_size, memory=memory)
    reqs = [Req(rid, tuple(range(1, prompt + 1))) for rid in range(batch_size)]
    extended, pools = extend(idle(device), reqs, pools).unwrap()
    decoding, pools = decode(extended, pools).unwrap()
    return filter_batch(decoding, list(range(batch_size))), pools


def _step(with_inputs: bool, hybrid: bool) -> Callable[[Any, Pools], object]:
    def step(running: Any, pools: Pools) -> object:
        decoding, after = decode(running, pools).unwrap()
        if with_inputs:
            inputs = forward_inputs(decoding, after.table, after.page_size)
            if hybrid:
                hybrid_inputs(inputs, after)
        return decoding

    return step


def _best_us(  # noqa: PLR0917  # one timing point: its sizes, its pools, what it times
    batch_size: int, prompt: int, page_size: int, memory: MemoryKinds, repeats: int, inputs: bool
) -> float:
    # Pools are linear: each timed step takes fresh records, built outside the timing.
    step = _step(inputs, memory.is_hybrid)
    best = float("inf")
    for _ in range(repeats):
        running, pools = _running(batch_size, prompt, page_size, memory, CPU)
        start = time.perf_counter()
        step(running, pools)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def measure(
    batch_size: int, prompt: int, page_size: int, window: int, repeats: int
) -> dict[str, float]:
    """µs of a decode step (alone, and with its inputs) on full-attention and hybrid pools."""
    hybrid = hybrid_kinds(batch_size, window, page_size)
    point: dict[str, float] = {"batch_size": batch_size}
    for inputs in (False, True):
        name = "step" if inputs else "decode"
        full_us = _best_us(batch_size, prompt, page_size, FULL_ATTENTION, repeats, inputs)
        hybrid_us = _best_us(batch_size, prompt, page_size, hybrid, repeats, inputs)
        point[f"{name}_full_us"] = full_us
        point[f"{name}_hybrid_us"] = hybrid_us
        point[f"{name}_ratio"] = hybrid_us / full_us
    return point


def count(batch_size: int, page_size: int, window: int) -> dict[str, dict[str, int]]:
    """Device kernels and host-to-device copies of one decode step, on meta, per kind of pools."""
    meta = torch.device("meta")
    counts = {}
    for name, memory in (("full", FULL_ATTENTION), ("hybrid", hybrid_kinds(8, window, page_size))):
        running, pools = _running(batch_size, 40, page_size, memory, meta)
        with count_device_work() as stepped:
            decoding, after = decode(running, pools).unwrap()
        with count_device_work() as built:
            inputs = forward_inputs(decoding, after.table, page_size)
            if memory.is_hybrid:
                hybrid_inputs(inputs, after)
        counts[name] = {
            "decode_kernels": stepped.kernels,
            "decode_copies": stepped.copies,
            "inputs_kernels": built.kernels,
            "inputs_copies": built.copies,
        }
    return counts


def long_run(num_reqs: int, prompt: int, steps: int, page_size: int, window: int) -> dict[str, int]:
    """Tokens each kind of memory holds after `steps` decode steps of `num_reqs` requests."""
    width = prompt + steps + 1
    memory = MemoryKinds(
        (
            SlidingWindow(window, num_reqs * (max(prompt, window) + 2 * page_size)),
            RecurrentState(state_size=4096, num_states=num_reqs),
        )
    )
    pools = make_pools(num_reqs, width, num_reqs * width, CPU, page_size, memory=memory)
    reqs = [Req(rid, tuple(range(1, prompt + 1))) for rid in range(num_reqs)]
    extended, pools = extend(idle(CPU), reqs, pools).unwrap()
    running, pools = decode(extended, pools).unwrap()
    for _ in range(steps - 1):
        running, pools = decode(running, pools).unwrap()
    check_pools(pools, [running])
    windows, states = pools.memory.windows[0], pools.memory.states[0]
    return {
        "tokens_per_row": int(running.rows.seq_lens.host[0]),
        "full_tokens": (pools.num_pages - len(pools.page_list)) * page_size,
        "window_tokens": (windows.num_pages - len(windows.page_list)) * page_size,
        "window_capacity": windows.num_pages * page_size,
        "states": memory.states[0].num_states - states.num_free,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point: print the three tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--steps", type=int, default=2048, help="decode steps of the long run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"page size {args.page_size}, prompts of {args.prompt} tokens, window {args.window},"
        f" best of {args.repeats}"
    )
    print("| batch | decode: full µs | hybrid µs | ratio | step: full µs | hybrid µs | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        point = measure(size, args.prompt, args.page_size, args.window, args.repeats)
        print(
            f"| {size} | {point['decode_full_us']:.1f} | {point['decode_hybrid_us']:.1f}"
            f" | {point['decode_ratio']:.2f} | {point['step_full_us']:.1f}"
            f" | {point['step_hybrid_us']:.1f} | {point['step_ratio']:.2f} |",
            flush=True,
        )
    print()
    print("| pools | decode: kernels | decode: copies | inputs: kernels | inputs: copies |")
    print("|---|---:|---:|---:|---:|")
    for name, work in count(8, args.page_size, args.window).items():
        print(
            f"| {name} | {work['decode_kernels']} | {work['decode_copies']}"
            f" | {work['inputs_kernels']} | {work['inputs_copies']} |"
        )
    print()
    held = long_run(16, args.prompt, args.steps, args.page_size, args.window)
    print(f"16 requests after {args.steps} decode steps ({held['tokens_per_row']} tokens each):")
    print("| memory | tokens held |")
    print("|---|---:|")
    print(f"| full-attention pages | {held['full_tokens']} |")
    print(f"| window pages (of {held['window_capacity']}) | {held['window_tokens']} |")
    print(f"| state slots | {held['states']} |")


if __name__ == "__main__":
    main()
