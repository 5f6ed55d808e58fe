"""Reading a cached prefix on hybrid pools: matched to an anchor, resumed, published.

The pools' side of `_hybrid_cache`: a prompt's usable cached prefix is its
full-attention match cut back to the longest anchor (`usable_prefix`); a
new row that reads one resumes from that anchor (`resume_rows`); an extend
row that computes past a page boundary publishes an anchor there
(`publish_tails`). Full-attention pools pass through untouched. The
results are not committed: the transition that calls these commits its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from batchstate._mirrored import HostArray
from batchstate._pool_versions import next_version
from batchstate._prefix_cache import Tokens

if TYPE_CHECKING:
    from batchstate._pools import Pools

__all__ = ["hold_anchors", "publish_tails", "resume_rows", "usable_prefix"]


def usable_prefix(
    pools: Pools, tokens: Sequence[int], cap: int | None = None
) -> tuple[int, HostArray]:
    """A prompt's longest cached prefix it may read, leaving a token to compute: length, pages.

    At most `cap` tokens, whole pages, if given. On hybrid pools the
    full-attention match is cut back to the longest anchor at or before
    it: a prefix whose window tail or state the cache does not keep is
    never read (docs/hybrid.md).
    """
    cache = pools.cache
    ids = tuple(tokens)
    page_size = cache.page_size
    usable = (len(ids) - 1) // page_size * page_size
    if cap is not None:
        usable = min(usable, cap // page_size * page_size)
    if not pools.memory.kinds.is_hybrid:
        return cache.match(ids[:usable])
    matched, pages = cache._cached(ids[:usable])
    anchors = pools.memory.cached
    length = anchors.longest(ids, matched) if matched and anchors.anchors else 0
    return length, pages[: length // cache.page_size]


def hold_anchors(pools: Pools, token_lists: Sequence[Tokens], lengths: Sequence[int]) -> Pools:
    """The anchors new rows matched (`lengths[i]` tokens of `token_lists[i]`), locked.

    Before the rows take their slots: taking state slots may evict anchors,
    never one a row of the same transition resumes from.
    """
    if not pools.memory.kinds.is_hybrid or not any(lengths):
        return pools
    return next_version(pools, memory=pools.memory.hold(_read(token_lists, lengths)))


def resume_rows(
    pools: Pools, slots: Sequence[int], token_lists: Sequence[Tokens], lengths: Sequence[int]
) -> Pools:
    """New rows (their slots just taken) that read `lengths[i]` cached tokens resume there.

    Each such row's window start moves to its anchor's tail, and the anchor
    (held since the match) stays locked until the row's forward copied its
    tail and state.
    """
    rows = [(slot, len_) for slot, len_ in zip(slots, lengths, strict=True) if len_]
    if not rows or not pools.memory.kinds.is_hybrid:
        return pools
    reading = [slot for slot, _ in rows]
    memory = pools.memory.resume(reading, _read(token_lists, lengths), pools.page_size)
    return next_version(pools, memory=memory)


def _read(token_lists: Sequence[Tokens], lengths: Sequence[int]) -> list[Tokens]:
    # The cached prefixes new rows read (the anchors they resume from), rows reading none left out.
    return [
        tuple(tokens[:length])
        for tokens, length in zip(token_lists, lengths, strict=True)
        if length
    ]


def publish_tails(
    pools: Pools,
    slots: Sequence[int],
    token_lists: Sequence[Tokens],
    computed_from: Sequence[int],
) -> Pools:
    """An anchor at each extend row's last page boundary its forward computes, where there is room.

    `token_lists[i]`: the tokens the row in `slots[i]` holds KV for once the
    forward ran (cached already, whole pages); `computed_from[i]`: the first
    position it computes. The forward copies the row's window tail into
    the anchor's window pages and checkpoints its state after the boundary.
    """
    memory = pools.memory
    if not memory.kinds.is_hybrid or not pools.cache.enabled:
        return pools
    page_size = pools.page_size
    for slot, tokens, start in zip(slots, token_lists, computed_from, strict=True):
        end = len(tokens) // page_size * page_size
        if end <= start:
            continue  # no boundary in this forward: an earlier one published it
        prefix = tuple(tokens[:end])
        if prefix not in memory.cached.anchors:
            memory = memory.publish(slot, prefix)
    return pools if memory is pools.memory else next_version(pools, memory=memory)
