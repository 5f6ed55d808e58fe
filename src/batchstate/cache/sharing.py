"""How rows share KV pages through the prefix cache: lock a prefix, give back.

The pools call these with the cache on; each takes the cache and the
host table and returns a new cache, never changing what it was given.
A row's cached prefix (`prefixes[slot]`, whole pages) is what it reads
from the cache and keeps locked; its pages past it are private to it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from immutables import MapMutation

from batchstate.base.mirrored import HostArray, frozen
from batchstate.cache.prefix_cache import PrefixCache, Tokens

__all__ = [
    "give_back",
    "lanes",
    "lock_matched",
    "lock_prefixes",
    "match_prefix",
    "prefix_cells",
]


@functools.cache
def lanes(page_size: int) -> HostArray:
    """Offsets of the tokens within a page, read-only int64 `[page_size]`; shared, never written."""
    return frozen(np.arange(page_size, dtype=np.int64))


def lock_prefixes(
    cache: PrefixCache, token_lists: Sequence[Tokens]
) -> tuple[PrefixCache, list[int], list[HostArray]]:
    """Each prompt's longest cached prefix that leaves a token to compute, locked.

    Every prompt is matched against `cache` as given: prompts of one
    transition do not share the pages they compute (they are not cached
    until it returns).
    """
    matches = [match_prefix(cache, tokens) for tokens in token_lists]
    lengths = [length for length, _ in matches]
    return lock_matched(cache, token_lists, lengths), lengths, [pages for _, pages in matches]


def match_prefix(cache: PrefixCache, tokens: Tokens) -> tuple[int, HostArray]:
    """A prompt's longest cached prefix that leaves a token to compute: its length and pages."""
    # Leave the last token to compute: the forward samples after it.
    usable = (len(tokens) - 1) // cache.page_size * cache.page_size
    return cache.match(tokens[:usable])


def lock_matched(
    cache: PrefixCache, token_lists: Sequence[Tokens], lengths: Sequence[int]
) -> PrefixCache:
    """The cache with each prompt's matched prefix (`lengths[i]` tokens, cached) locked."""
    for tokens, length in zip(token_lists, lengths, strict=True):
        if length:
            cache = cache.lock(tuple(tokens), length)
    return cache


def give_back(
    cache: PrefixCache,
    table: npt.NDArray[np.int32],
    prefixes: MapMutation[int, Tokens],
    owned: Sequence[tuple[int, int]],
    token_lists: Sequence[Tokens] | None,
) -> tuple[PrefixCache, HostArray]:
    """Release `owned` (slot, tokens) rows: unlock, cache their whole pages, list the rest.

    Returns the cache and the pages to free: those whose tokens the cache
    held already past the row's own prefix, and each row's partly filled
    last page. `prefixes` (the caller's mutation of the pools' map) loses
    the slots in place.

    Raises:
        ValueError: `token_lists` has another number of rows, or a row's
            tokens do not start with its cached prefix.
    """
    if token_lists is not None and len(token_lists) != len(owned):
        raise ValueError(f"tokens for {len(token_lists)} rows, {len(owned)} rows left")
    page_size = cache.page_size
    rows: list[tuple[Tokens, Tokens]] = []
    for index, (slot, _) in enumerate(owned):
        prefix = prefixes.get(slot, ())
        tokens = prefix if token_lists is None else tuple(token_lists[index])
        if tokens[: len(prefix)] != prefix:
            raise ValueError(f"slot {slot}: its tokens do not start with its cached prefix")
        rows.append((prefix, tokens))
    freed: list[HostArray] = []
    for (slot, num_tokens), (prefix, tokens) in zip(owned, rows, strict=True):
        pages = table[slot, :num_tokens:page_size].astype(np.int64) // page_size
        if prefix:
            del prefixes[slot]
        full = min(len(tokens), num_tokens) // page_size * page_size
        cache, present = cache._release(prefix, tokens[:full], pages[: full // page_size])
        # Pages the cache holds already past the row's own prefix: computed twice, free one.
        freed += [
            pages[len(prefix) // page_size : present // page_size],
            pages[full // page_size :],
        ]
    return cache, frozen(np.concatenate(freed))


def prefix_cells(
    prefix_rows: Sequence[tuple[int, HostArray]],
    page_size: int,
    cells: tuple[HostArray, HostArray, npt.NDArray[np.int32]],
) -> tuple[HostArray, HostArray, npt.NDArray[np.int32]]:
    """The table cells (slot, position, location) of each row's cached prefix, then `cells`.

    `prefix_rows` holds (slot, the cached pages the row reads) per row.
    """
    offsets = lanes(page_size)
    slot_parts, position_parts, loc_parts = [], [], []
    for slot, pages in prefix_rows:
        locs = (pages[:, None] * page_size + offsets).ravel()
        slot_parts.append(np.full(locs.shape[0], slot, dtype=np.int64))
        position_parts.append(np.arange(locs.shape[0], dtype=np.int64))
        loc_parts.append(locs.astype(np.int32))
    token_slots, positions, locs32 = cells
    return (
        np.concatenate((*slot_parts, token_slots)),
        np.concatenate((*position_parts, positions)),
        np.concatenate((*loc_parts, locs32)),
    )
