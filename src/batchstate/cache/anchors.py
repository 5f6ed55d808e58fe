"""What the prefix cache keeps beside full-attention pages on hybrid pools: tails at anchors.

A request that reads a cached prefix of `n` tokens instead of computing it
needs more than the prefix's full-attention pages: the window layers' KV
of positions `[n - window + 1, n)` (its window *tail*) and the recurrent
layers' state after token `n - 1`. The cache keeps both only at some
prefix ends, its *anchors*: an extend row that computes past a page
boundary `c` publishes one at `c` (its last), the window tail copied into
window pages of the cache's own and the state written into a state slot
of the cache's own by the forward itself (a checkpoint); a finished row
whose tokens end on a page boundary keeps its own tail and state as one
at its end (`HybridPools.give_back`), if it grew since it was admitted:
only then are that tail and state known written (an `admit_prefilled` row released
before its transfer, or a resumed row before its forward, keeps none). A match is
usable only up to the longest anchor at or before the full-attention
match: a prefix whose tail is gone is never read as if it were whole.

A row that resumes from an anchor copies the anchor's tail and state into
its own window pages and state slot before its forward: it never reads
the cache's afterwards. So an anchor is locked only from a new row's
match until that row's copies ran (`pending`, per request slot, from
its admission until the row grows again or leaves); any other anchor
may be evicted, least recently used first, under window or state
pressure (or when the cache evicts the full-attention pages it ends),
which leaves its full-attention pages cached but no match ending there
(SGLang's tombstone).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final, NamedTuple, final

import attrs
from immutables import Map

from batchstate.cache.radix import Tokens

__all__ = ["NO_ANCHORS", "HybridCache", "ResumePoint", "SlotCopies", "tail_start"]


def tail_start(end: int, window: int, page_size: int) -> int:
    """The first position of the window tail a row resuming at `end` reads (a page start)."""
    return max(end - window + 1, 0) // page_size * page_size


class ResumePoint(NamedTuple):
    """A cached prefix end a request may resume from: its window tail and its state.

    `window_pages`: the cache's window pages holding positions
    `[tail_start(end), end)` (none without window layers); `state`: the
    cache's state slot holding the state after the prefix (0 without
    recurrent layers); `locks`: new rows that resume from it, until their copies ran.
    """

    window_pages: tuple[int, ...]
    state: int
    used: int
    locks: int


class SlotCopies(NamedTuple):
    """A request slot's copies its next forward performs: the anchors it resumes from, publishes.

    `resume`: the anchor the row's cached prefix ends at, copied into its
    own window pages and state slot before the forward (() for none);
    `publish`: the anchor the forward fills, its window tail copied from
    the row's and its state checkpointed after its last token (() for none).
    """

    resume: Tokens
    publish: Tokens


@final
@attrs.frozen(eq=False, repr=False)
class HybridCache:
    """The anchors of a hybrid model's prefix cache and the copies rows have pending, as a value."""

    anchors: Map[Tokens, ResumePoint]
    lengths: Map[int, int]  # anchor length -> how many anchors have it: what a match looks at
    # request slot -> the copies its next forward performs; every row has an entry from its
    # admission until it grows again (its forward or transfer ran) or leaves
    pending: Map[int, SlotCopies]
    clock: int
    num_evicted: int  # anchors evicted since the pools were made: a running total

    @property
    def num_window_pages(self) -> int:
        """Window pages the anchors hold."""
        return sum(len(anchor.window_pages) for anchor in self.anchors.values())

    @property
    def num_states(self) -> int:
        """State slots the anchors hold."""
        return sum(1 for anchor in self.anchors.values() if anchor.state)

    def evictable(self) -> tuple[int, int]:
        """(window pages, state slots) of anchors no pending copy names: what eviction may free."""
        pages = states = 0
        for anchor in self.anchors.values():
            if not anchor.locks:
                pages += len(anchor.window_pages)
                states += 1 if anchor.state else 0
        return pages, states

    def protected(self) -> tuple[int, int]:
        """(window pages, state slots) of anchors a new row resumes from: what eviction keeps."""
        pages, states = self.evictable()
        return self.num_window_pages - pages, self.num_states - states

    def longest(self, tokens: Tokens, limit: int) -> int:
        """The longest anchor that is a prefix of `tokens`, at most `limit` long (0: none)."""
        for length in sorted(self.lengths.keys(), reverse=True):
            if length <= limit and tokens[:length] in self.anchors:
                return length
        return 0

    def hold(self, prefix: Tokens) -> HybridCache:
        """One more new row reads the anchor `prefix`: locked, from its match to its copies."""
        clock = self.clock + 1
        anchor = self.anchors[prefix]
        anchors = self.anchors.set(prefix, anchor._replace(used=clock, locks=anchor.locks + 1))
        return HybridCache(anchors, self.lengths, self.pending, clock, self.num_evicted)

    def admit(self, slots: Iterable[int]) -> HybridCache:
        """New rows in `slots`: their memory is unwritten until their forward or transfer ran."""
        pending = self.pending.mutate()
        for slot in slots:
            pending[slot] = _NO_COPIES
        return HybridCache(
            self.anchors, self.lengths, pending.finish(), self.clock, self.num_evicted
        )

    def resume(self, slot: int, prefix: Tokens) -> HybridCache:
        """The row in `slot` resumes from the anchor `prefix` (held): its copies are pending."""
        before = self.pending.get(slot, _NO_COPIES)
        pending = self.pending.set(slot, before._replace(resume=prefix))
        return HybridCache(self.anchors, self.lengths, pending, self.clock, self.num_evicted)

    def add_anchor(
        self, slot: int, prefix: Tokens, window_pages: tuple[int, ...], state: int
    ) -> HybridCache:
        """A new anchor `prefix`, which the forward of the row in `slot` fills.

        Not locked: evicting it later drops the pending publish with it (any
        later forward runs after the one that fills it, on the same stream).
        """
        kept = self.keep_anchor(prefix, window_pages, state)
        before = self.pending.get(slot, _NO_COPIES)
        pending = self.pending.set(slot, before._replace(publish=prefix))
        return HybridCache(kept.anchors, kept.lengths, pending, kept.clock, self.num_evicted)

    def keep_anchor(self, prefix: Tokens, window_pages: tuple[int, ...], state: int) -> HybridCache:
        """A new anchor `prefix` from a finished row's own window tail and state (no copy)."""
        clock = self.clock + 1
        anchors = self.anchors.set(prefix, ResumePoint(window_pages, state, clock, 0))
        lengths = self.lengths.set(len(prefix), self.lengths.get(len(prefix), 0) + 1)
        return HybridCache(anchors, lengths, self.pending, clock, self.num_evicted)

    def copies_ran(self, slots: Iterable[int]) -> HybridCache:
        """The pending copies of `slots` ran (their rows grew again, or left): anchors unlocked."""
        pending, anchors = self.pending.mutate(), self.anchors.mutate()
        for slot in slots:
            copies = pending.get(slot)
            if copies is None:
                continue
            del pending[slot]
            if copies.resume:
                anchor = anchors[copies.resume]
                anchors[copies.resume] = anchor._replace(locks=anchor.locks - 1)
        return HybridCache(
            anchors.finish(), self.lengths, pending.finish(), self.clock, self.num_evicted
        )

    def evict(
        self, num_pages: int, num_states: int, *, keep: Callable[[Tokens], bool] | None = None
    ) -> tuple[HybridCache, list[int], list[int]]:
        """Drop unlocked anchors, least recently used first, until enough pages and states are out.

        With `keep`, drop instead every unlocked anchor `keep` refuses (its
        full-attention pages were evicted). Returns the cache and the window
        pages and state slots freed.
        """
        if keep is None:
            order = sorted(
                (anchor.used, prefix) for prefix, anchor in self.anchors.items() if not anchor.locks
            )
        else:
            order = [
                (0, prefix)
                for prefix, anchor in self.anchors.items()
                if not anchor.locks and not keep(prefix)
            ]
        anchors, lengths = self.anchors.mutate(), self.lengths.mutate()
        pages: list[int] = []
        states: list[int] = []
        gone: set[Tokens] = set()
        for _, prefix in order:
            if keep is None and len(pages) >= num_pages and len(states) >= num_states:
                break
            anchor = anchors[prefix]
            del anchors[prefix]
            left = lengths[len(prefix)] - 1
            if left:
                lengths[len(prefix)] = left
            else:
                del lengths[len(prefix)]
            pages.extend(anchor.window_pages)
            if anchor.state:
                states.append(anchor.state)
            gone.add(prefix)
        pending = self.pending
        if gone and pending:  # the rows that were to fill them fill nothing (still pending)
            pending = Map(
                {
                    slot: copies._replace(publish=()) if copies.publish in gone else copies
                    for slot, copies in pending.items()
                }
            )
        cache = HybridCache(
            anchors.finish(), lengths.finish(), pending, self.clock, self.num_evicted + len(gone)
        )
        return cache, pages, states

    def __repr__(self) -> str:
        return (
            f"HybridCache(anchors={len(self.anchors)}, window_pages={self.num_window_pages},"
            f" states={self.num_states})"
        )


_NO_COPIES: Final = SlotCopies((), ())
NO_ANCHORS: Final = HybridCache(Map(), Map(), Map(), 0, 0)
