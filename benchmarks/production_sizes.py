"""Every transition at production size: `python -m benchmarks.production_sizes`.

Page size 1, a table 131,072 tokens wide, 1,024 running requests holding
over a million KV tokens (1,023 prompts of `--prompt` tokens and one of
`--long` tokens, near the context), device tensors on `meta` by default
(`--device cpu` puts them in host memory too: about 0.5 GB more for the
table). One pass runs, timed one by one: `extend` of the batch, `decode`,
`split` + `release` of one row, `extend` of one new request + `merge`,
`decode_sampled`, `verify`, `verify_ahead`, `exact_window`, `sync` (host
counts, no read), `forward_inputs` of a decode and of a verify window,
`fill_buffers` of a decode bucket of 1,024 rows and of a verify bucket, `pad`.
Prints µs per transition, then host and device memory: the table's two
sides, the pools' free lists, the graph buffers, and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

import numpy as np
import torch

from batchstate import (
    GraphBuffers,
    Pools,
    Req,
    Sampled,
    decode,
    decode_sampled,
    exact_window,
    extend,
    fill_buffers,
    finish_mixed,
    forward_inputs,
    idle,
    make_pools,
    merge,
    pad,
    release,
    split,
    sync,
    verify,
    verify_ahead,
)
from benchmarks.counting import count_allocations

CONTEXT: Final = 131_072
ROWS: Final = 1_024
_T = TypeVar("_T")


def _timed(times: dict[str, float], name: str, work: Callable[[], _T]) -> _T:
    start = time.perf_counter()
    result = work()
    times[name] = (time.perf_counter() - start) * 1e6
    return result


def run(device: torch.device, prompt: int = 1_000, long: int = 131_000) -> dict[str, object]:
    """One pass of every transition at production size; µs per transition and memory.

    A pass at 8 rows runs first, untimed: first calls import and cache
    (torch's meta kernels among them).
    """
    _pass(device, 8, 64, 64, 256)
    return _pass(device, ROWS, prompt, long, CONTEXT)


def _pass(  # one variable per record of the pass
    device: torch.device, rows: int, prompt: int, long: int, context: int
) -> dict[str, object]:
    kv_tokens = (rows - 1) * prompt + long + 64 * rows + 2 * prompt
    pools = make_pools(rows + 2, context, kv_tokens, device, page_size=1)
    body = tuple(range(1, prompt + 1))
    reqs = [Req(rid, body) for rid in range(rows - 1)]
    reqs.append(Req(rows - 1, tuple(range(1, long + 1))))
    times: dict[str, float] = {}
    extended, pools = _timed(
        times, "extend 1,024", lambda: extend(idle(device), reqs, pools).unwrap()
    )
    decoding, pools = _timed(times, "decode", lambda: decode(extended, pools).unwrap())
    keep = list(range(1, rows))
    (kept, left) = _timed(times, "split", lambda: split(decoding, keep))
    pools = _timed(times, "release", lambda: release(left, kept, pools).unwrap())
    one, pools = _timed(
        times, "extend 1", lambda: extend(idle(device), [Req(ROWS, body)], pools).unwrap()
    )
    running = _timed(times, "merge", lambda: merge(kept, one))
    tokens = torch.zeros(rows, dtype=torch.int64, device=device)
    sampled = Sampled.of(running.rows, tokens)
    mixed, pools = _timed(
        times, "decode_sampled", lambda: decode_sampled(running, sampled, pools).unwrap()
    )
    decode_inputs = _timed(
        times, "forward_inputs (decode)", lambda: forward_inputs(mixed, pools.table, 1)
    )
    # FA3's page table is as wide as the context; FlashInfer's kv_indices need only the pool's
    # pages and the padded rows' (a page shared by two rows through the cache counts twice:
    # a forward past the capacity is a DoesNotFit, nothing written).
    capacity = pools.num_pages + rows
    decode_bucket = GraphBuffers.allocate(
        device, 1, rows=rows, tokens=rows, max_pages=context, kv_capacity=capacity
    )
    with count_allocations() as allocated:
        _timed(
            times,
            "fill_buffers (decode bucket)",
            lambda: fill_buffers(decode_bucket, mixed, pools.table).unwrap(),
        )
    _timed(times, "pad", lambda: pad(decode_inputs, [rows]).unwrap())
    stepped, pools = decode(finish_mixed(mixed).running, pools).unwrap()
    drafts = np.full(rows, 3, dtype=np.int64)
    window, pools = _timed(times, "verify", lambda: verify(stepped, drafts, pools).unwrap())
    _timed(
        times,
        "forward_inputs (verify)",
        lambda: forward_inputs(window, pools.table, 1, slot_tokens=pools.slot_tokens),
    )
    verify_bucket = GraphBuffers.allocate(
        device, 1, rows=rows, tokens=4 * rows, max_pages=context, kv_capacity=capacity
    )
    _timed(
        times,
        "fill_buffers (verify bucket)",
        lambda: fill_buffers(
            verify_bucket, window, pools.table, slot_tokens=pools.slot_tokens
        ).unwrap(),
    )
    counts = torch.ones(rows, dtype=torch.int32, device=device)
    opened, pools = _timed(
        times, "verify_ahead", lambda: verify_ahead(window, counts, drafts, pools).unwrap()
    )
    host_counts = np.ones(rows, dtype=np.int64)
    window, pools = _timed(times, "exact_window", lambda: exact_window(opened, host_counts, pools))
    synced, pools = _timed(times, "sync", lambda: sync(window, host_counts, pools))
    return {
        "times": times,
        "rows": len(synced.rows),
        "kv_tokens_held": int(pools.slot_tokens.sum()),
        "longest": int(synced.rows.max_seq_len),
        "memory": _memory(pools, decode_bucket, verify_bucket),
        "fill_allocations": list(allocated),
        "inputs_width": int(decode_inputs.page_table.device.shape[1]),
        "bucket_width": int(decode_bucket.page_table.shape[1]),
        "pools": pools,
        "running": synced,
    }


def _memory(pools: Pools, *buckets: GraphBuffers) -> dict[str, int]:
    table = pools.table
    return {
        "table host (per token)": table.host.nbytes,
        "table host (per page, page size 16)": table.host.nbytes // 16,
        "table device": table.device.numel() * table.device.element_size(),
        "free lists host": pools.free_pages.nbytes + pools.slot_tokens.nbytes,
        "graph buffers device": sum(bucket.nbytes for bucket in buckets),
        "peak RSS": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point: print both tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="meta")
    parser.add_argument("--prompt", type=int, default=1_000)
    parser.add_argument("--long", type=int, default=131_000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run(torch.device(args.device), args.prompt, args.long)
    print(
        f"{result['rows']} running requests, {result['kv_tokens_held']:,} KV tokens held, the"
        f" longest {result['longest']:,} of {CONTEXT:,}; page size 1, device {args.device}"
    )
    print("| transition | µs |\n|---|---:|")
    times = result["times"]
    assert isinstance(times, dict)
    for name, micros in times.items():
        print(f"| {name} | {micros:,.0f} |")
    print("\n| memory | MB |\n|---|---:|")
    memory = result["memory"]
    assert isinstance(memory, dict)
    for name, size in memory.items():
        print(f"| {name} | {size / 1e6:,.1f} |")


if __name__ == "__main__":
    main()
