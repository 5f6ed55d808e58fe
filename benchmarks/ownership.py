"""The cost of the ownership checks, against the decode step that pays for them.

Each decode (and mix, verify) compares every row's slot generation with the
pools' (one host gather and byte compare, beside the length check it already
had) and checks that the pools are the newest (one attribute compare). This
times those checks alone and one whole `decode` on the same batch, in the
same run, interleaved, and reports the ratio.

    python -m benchmarks.ownership [--rows 1 64 512] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch

from batchstate import Decoding, Pools, Req, decode, extend, idle, make_pools
from batchstate.pools.pools import expect_pools

__all__ = ["main", "measure"]


def _batch(num_rows: int) -> tuple[Decoding, Pools]:
    pools = make_pools(num_rows, 4096, num_rows * 4096, torch.device("cpu"), page_size=16)
    reqs = [Req(rid, (1,) * 64) for rid in range(num_rows)]
    batch, pools = extend(idle("cpu"), reqs, pools).unwrap()
    return decode(batch, pools).unwrap()


def _best(call: Callable[[], object], repeats: int) -> float:
    # Best of `repeats` single calls, in microseconds: the least disturbed run.
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        call()
        best = min(best, time.perf_counter_ns() - start)
    return best / 1000


def measure(num_rows: int, repeats: int) -> tuple[float, float, float]:
    """The checks' and one decode's best times (µs) for `num_rows` rows, and their ratio."""
    batch, pools = _batch(num_rows)
    rows = batch.rows
    slots, gens = rows.req_pool_indices.host, rows.gens

    def checks() -> bool:
        expect_pools(pools)  # as decode makes it: the type, then the lineage stamp
        # The generation check as decode makes it: a gather, then a byte compare.
        return pools.slot_gens[slots].tobytes() == gens.tobytes()

    def step() -> object:
        # Pools are linear: each decode goes on from the last one's batch and pools.
        nonlocal batch, pools
        batch, pools = decode(batch, pools).unwrap()
        return batch

    check_us = decode_us = float("inf")
    for _ in range(4):  # interleaved, so that both see the same machine state
        check_us = min(check_us, _best(checks, repeats // 4))
        decode_us = min(decode_us, _best(step, min(repeats // 4, 256)))
        slots, gens = batch.rows.req_pool_indices.host, batch.rows.gens
    return check_us, decode_us, check_us / decode_us


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args(argv)
    print(f"{'rows':>6} {'checks µs':>10} {'decode µs':>10} {'ratio':>7}")
    for num_rows in args.rows:
        check_us, decode_us, ratio = measure(num_rows, args.repeats)
        print(f"{num_rows:>6} {check_us:>10.2f} {decode_us:>10.1f} {ratio:>7.1%}")


if __name__ == "__main__":
    main()
