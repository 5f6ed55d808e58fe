"""Prefix cache cost per request against cached size: `python -m benchmarks.prefix_cache`.

Fills a cache with conversations of `--length` random tokens until it holds
10^3 .. 10^6 tokens, then times, per request of `--length` tokens that
shares half its tokens with a cached one: `match` (the lookup), a lock and
unlock of the hit (what a prefill reading it and its release add), and an
insert of the new half (what publishing or a release adds). Host work only.
Prints a Markdown table (see docs/prefix-cache.md).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from batchstate.cache.prefix_cache import PrefixCache


def _best_us(work: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def measure(cached_tokens: int, length: int, page_size: int, repeats: int) -> tuple[float, ...]:
    """(nodes, match µs, lock + unlock µs, insert µs) with `cached_tokens` tokens cached."""
    rng = random.Random(0)
    cache, page = PrefixCache.empty(page_size), 1
    stored = []
    while cache.num_tokens < cached_tokens:
        tokens = tuple(rng.randrange(1, 32000) for _ in range(length))
        cache, _ = cache._insert(tokens, range(page, page + length // page_size))
        page += length // page_size
        stored.append(tokens)
    half = length // 2 // page_size * page_size
    request = stored[len(stored) // 2][:half] + tuple(
        rng.randrange(1, 32000) for _ in range(length - half)
    )
    match = _best_us(lambda: cache.match(request), repeats)
    hit, _ = cache.match(request)
    lock = _best_us(lambda: cache.lock(request, hit).unlock(request, hit), repeats)
    pages = range(page, page + length // page_size)
    insert = _best_us(lambda: cache._insert(request, pages), repeats)
    return float(len(cache)), match, lock, insert


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024, help="tokens per request")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**3, 10**4, 10**5, 10**6])
    args = parser.parse_args()
    print(f"request of {args.length} tokens, half of them cached; page size {args.page_size}")
    print("| cached tokens | nodes | match µs | lock + unlock µs | insert µs |")
    print("|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        nodes, match, lock, insert = measure(size, args.length, args.page_size, args.repeats)
        print(f"| {size:,} | {nodes:,.0f} | {match:.1f} | {lock:.1f} | {insert:.1f} |")


if __name__ == "__main__":
    main()
