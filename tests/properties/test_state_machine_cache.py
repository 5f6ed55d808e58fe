"""A model-based state machine over pools with the prefix cache on: shared prefixes, evictions.

Prompts are drawn from a few fixed prefixes plus short random tails, so
that requests share cached pages often. The rules: `extend` (new requests,
retracted ones admitted again, held chunks continued), `decode`, `split`
and `release` with each row's prompt and generated tokens, `mix` with a
chunk budget (partial rows held as `Chunked` and continued later),
retraction (a running row released, its prompt and generated tokens
admitted again), `release` of a held chunk, and `flush`.

A plain-Python model predicts each outcome: which slots (handed out from
the front of the free list, freed ones to its back), each row's tokens and
length, the prefix each new request reads from the cache (its longest
whole-page prefix among the cache's entries, leaving a token to compute),
and the first `Failure` with its exact value (pages needed against free
plus evictable pages, less those the admission itself locks). It also
stands in for the forward: every KV location a transition hands out
(`out_cache_loc`) is "written" with the tokens up to its position; where
the cache held a page's tokens already, the row's cells there must point
at the cache's page, and its own page is retired, read by no one. After every step, each live
row and chunk must read, at every position, KV written for exactly its
own tokens (a page shared through the cache holds the same tokens for
every reader), no page a live row reads may be free or evictable, and
every cached page must hold the tokens of its cache key. `check_pools`,
`check_batch` and `check_leaks` run after every step too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from returns.result import Failure, Success

from batchstate import (
    Batch,
    Chunked,
    ContextTooLong,
    Decoding,
    EmptyExtend,
    EmptyPrompt,
    Filtered,
    Idle,
    NoChunkBudget,
    OutOfKVTokens,
    OutOfReqSlots,
    Req,
    Sampled,
    check_batch,
    check_forward,
    check_leaks,
    check_pools,
    decode,
    decode_sampled,
    extend,
    filter_batch,
    finish_mixed,
    flush,
    idle,
    make_pools,
    merge,
    mix,
    release,
    split,
    sync,
    verify,
)
from tests.properties.test_state_machine import run_timed
from tests.strategies import CPU, FAST, LONG, assert_unchanged, keep_patterns, snapshot, tile

MAX_EXAMPLES: Final = 2000 if LONG else 20 if FAST else 120

# Three fixed prefixes that prompts start from, long enough for any context.
_BASES: Final = tuple(tuple(10 + (7 * base + 3 * j) % 5 for j in range(64)) for base in range(3))

# Hypothesis favours bounds of integer ranges: a sampled list keeps the odds as written.
_ONE_IN_TWENTY: Final = st.sampled_from([False] * 19 + [True])

_counts: dict[str, int] = {}
_failures: dict[str, int] = {}


def _count(name: str, by: int = 1) -> None:
    _counts[name] = _counts.get(name, 0) + by


@attrs.define
class _Row:
    """A running row in the model: its request, slot, and every token with KV (prompt + output)."""

    req: Req
    slot: int
    tokens: list[int]


@attrs.frozen
class _Shape:
    max_reqs: int
    max_context_len: int
    num_pages: int
    page_size: int


@st.composite
def _shapes(draw: st.DrawFn) -> _Shape:
    page_size = draw(st.sampled_from([1, 2, 4]))
    max_context_len = draw(st.integers(4, 24))
    pages_per_row = -(-max_context_len // page_size)
    # Mostly room for a row or a few, so that the cache fills and evicts; sometimes less.
    num_pages = draw(st.one_of(st.integers(pages_per_row, 3 * pages_per_row), st.integers(0, 4)))
    return _Shape(draw(st.integers(1, 5)), max_context_len, num_pages, page_size)


@st.composite
def _prompts(draw: st.DrawFn, max_context_len: int) -> tuple[int, ...]:
    """A fixed prefix cut anywhere, then a short random tail: often shared, sometimes too long."""
    if draw(_ONE_IN_TWENTY):
        return ()  # now and then an empty prompt
    base = _BASES[draw(st.integers(0, len(_BASES) - 1))]
    cut = draw(st.integers(1, max(1, max_context_len - 2)))  # room to decode, mostly
    tail = draw(st.lists(st.integers(0, 2), max_size=3))
    return base[:cut] + tuple(tail)


def _generated(tokens: Sequence[int]) -> int:
    # The token a row samples next: a function of its length, so equal prompts generate alike.
    return len(tokens) % 3


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class CacheMachine(RuleBasedStateMachine):
    """Pools with the prefix cache on, the running batch, held chunks, and their model."""

    def __init__(self) -> None:
        super().__init__()
        self.shape = _Shape(1, 4, 0, 1)
        self.pools = make_pools(1, 4, 0, CPU, prefix_cache=True)
        self.running: Batch = idle(CPU)
        self.rows: list[_Row] = []
        self.held: list[Chunked] = []  # between chunks: slot and KV kept
        self.waiting: list[Req] = []  # retracted: prompt + generated, admitted again later
        self.free_slots: list[int] = []
        self.kv: dict[int, tuple[int, ...]] = {}  # KV location -> the tokens up to its position
        self.next_rid = 0

    # ---- the model ----------------------------------------------------------------------

    def _fresh_rid(self) -> int:
        self.next_rid += 1
        return self.next_rid

    def _entries(self) -> dict[tuple[int, ...], tuple[int, int]]:
        return self.pools.cache.entries()

    def _match(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """The model's cache hit: whole pages among the cache's entries, a token left to compute."""
        page_size, entries = self.shape.page_size, self._entries()
        usable = (len(tokens) - 1) // page_size * page_size
        length, pages = 0, []
        while length + page_size <= usable and tuple(tokens[: length + page_size]) in entries:
            length += page_size
            pages.append(entries[tuple(tokens[:length])][0])
        return length, pages

    def _available(self, locked: set[int]) -> int:
        """Pages an allocation may take once the admission has locked `locked`."""
        entries = self._entries()
        evictable = {page for page, locks in entries.values() if not locks}
        free = len(self.pools.free_pages) + len(self.pools.retired)  # retired: free next
        return free + len(evictable - locked)

    def _write(self, slot: int, tokens: Sequence[int], start: int, end: int) -> list[int]:
        """The forward's KV writes for positions [start, end) of a row; their locations."""
        locs: list[int] = self.pools.table.host[slot, start:end].tolist()
        for position, loc in enumerate(locs, start):
            self.kv[loc] = tuple(tokens[: position + 1])
        return locs

    def _write_at(
        self, locs: list[int], slot: int, tokens: Sequence[int], start: int, end: int
    ) -> None:
        """The forward's KV writes at `locs` (its `out_cache_loc`) for positions [start, end).

        The table's cells there are `locs`, but where the row reads the cache's copy of
        a page it computed (the cache held it already): there they are the cache's page.
        """
        page_size, table = self.shape.page_size, self.pools.table.host
        prefix = len(self.pools.prefixes.get(slot, ()))
        for position, loc in enumerate(locs, start):
            self.kv[loc] = tuple(tokens[: position + 1])
        for position, loc in enumerate(locs, start):
            cell = int(table[slot, position])
            if cell != loc:
                assert position < prefix, f"slot {slot}: cell {position} moved off its own page"
                key = tuple(tokens[: position // page_size * page_size + page_size])
                assert cell // page_size == self._entries()[key][0], "moved to another page"
                _count("cells moved onto the cache's copy")
        assert end == start + len(locs)

    def _live(self) -> list[tuple[int, tuple[int, ...]]]:
        # (slot, tokens with KV) of every row and chunk that holds memory.
        rows = [(row.slot, tuple(row.tokens)) for row in self.rows]
        chunks = [(chunk.slot, chunk.req.input_ids[: chunk.cached]) for chunk in self.held]
        return rows + chunks

    def _assert_failed(self, result: object, expected: object, before: object) -> None:
        assert isinstance(result, Failure), f"expected Failure({expected!r}), got {result}"
        assert result.failure() == expected, f"expected {expected!r}, got {result.failure()!r}"
        name = type(expected).__name__
        _failures[name] = _failures.get(name, 0) + 1
        assert_unchanged(before, (self.pools, self.running), "pools and batch after a Failure")

    def _assert_published(self, slot: int, tokens: Sequence[int]) -> None:
        # After a prefill or chunk: the row reads all its whole pages from the cache (its
        # own, published, or the cache's copy of them).
        page_size = self.shape.page_size
        prefix = self.pools.prefixes.get(slot, ())
        full = len(tokens) // page_size * page_size
        assert prefix == tuple(tokens[:full]), f"slot {slot} reads {len(prefix)} of {full}"
        _count("published")

    def _assert_cached(self, tokens: Sequence[int]) -> None:
        page_size, entries = self.shape.page_size, self._entries()
        for end in range(page_size, len(tokens) + 1, page_size):
            assert tuple(tokens[:end]) in entries, f"{end} released tokens not cached"

    def _base(self) -> Decoding | Filtered | Idle:
        running = self.running
        assert isinstance(running, Decoding | Filtered | Idle)
        return running

    def _as_filtered(self) -> Filtered | Idle:
        # mix takes Filtered or Idle: a Decoding batch goes on as all of its rows.
        running = self._base()
        if isinstance(running, Decoding):
            return filter_batch(running, list(range(len(self.rows))))
        return running

    def _bad_prompt(self, items: Sequence[Req | Chunked]) -> object | None:
        """The first request with nothing left to compute or longer than the table, in order."""
        for item in items:
            req, cached = (item.req, item.cached) if isinstance(item, Chunked) else (item, 0)
            if len(req.input_ids) <= cached:
                return EmptyPrompt(req.rid, len(req.input_ids), cached)
            if len(req.input_ids) > self.shape.max_context_len:
                return ContextTooLong(req.rid, len(req.input_ids), self.shape.max_context_len)
        return None

    def _too_long(self, rows: Sequence[_Row]) -> ContextTooLong | None:
        """A decode's refusal: the first longest row has no room for one more token."""
        lens = [len(row.tokens) for row in rows]
        if not lens or max(lens) < self.shape.max_context_len:
            return None
        rid = rows[lens.index(max(lens))].req.rid
        return ContextTooLong(rid, max(lens) + 1, self.shape.max_context_len)

    def _predict_admit(self, items: Sequence[Req | Chunked]) -> tuple[object | None, list[int]]:
        """The first failure `extend` returns (None: success), and each row's prefix."""
        shape = self.shape
        if not items:
            return EmptyExtend(), []
        bad = self._bad_prompt(items)
        if bad is not None:
            return bad, []
        new = [item for item in items if isinstance(item, Req)]
        if len(new) > len(self.free_slots):
            return OutOfReqSlots(len(new), len(self.free_slots)), []
        prefixes, needed, locked = [], 0, set[int]()
        for item in items:
            if isinstance(item, Chunked):
                prefix, length = item.cached, len(item.req.input_ids)
                needed += _pages(length, shape.page_size) - _pages(prefix, shape.page_size)
            else:
                prefix, pages = self._match(item.input_ids)
                locked.update(pages)
                needed += _pages(len(item.input_ids), shape.page_size) - len(pages)
            prefixes.append(prefix)
        available = self._available(locked)
        if needed > available:
            return OutOfKVTokens(needed, available, shape.page_size), []
        return None, prefixes

    # ---- rules --------------------------------------------------------------------------

    @initialize(shape=_shapes())
    def start(self, shape: _Shape) -> None:
        """Fresh pools with the prefix cache on; an Idle batch."""
        self.shape = shape
        self.pools = make_pools(
            shape.max_reqs,
            shape.max_context_len,
            shape.num_pages * shape.page_size,
            CPU,
            shape.page_size,
            prefix_cache=True,
        )
        self.free_slots = list(range(1, shape.max_reqs + 1))
        _count("examples")

    @rule(
        data=st.data(),
        num_new=st.integers(1, 3),  # `mix` reaches EmptyExtend; here it would only waste steps
        num_waiting=st.integers(0, 2),
        chunk_picks=st.lists(st.integers(0, 7), max_size=2, unique=True),
    )
    def admit(
        self, *, data: st.DataObject, num_new: int, num_waiting: int, chunk_picks: list[int]
    ) -> None:
        """Extend retracted and new requests and held chunks; the rows join the running batch."""
        waiting = self.waiting[:num_waiting]
        fresh = [
            Req(self._fresh_rid(), data.draw(_prompts(self.shape.max_context_len), label="prompt"))
            for _ in range(num_new)
        ]
        picks = sorted({pick % len(self.held) for pick in chunk_picks}) if self.held else []
        chunks = [self.held[pick] for pick in picks]
        items: list[Req | Chunked] = [*waiting, *fresh, *chunks]
        self._extend(items)

    def _extend(self, items: Sequence[Req | Chunked]) -> tuple[int, ...] | None:
        # Extend `items` against the model; on success the rows run. Their prefixes, or None.
        before = snapshot((self.pools, self.running))
        result = extend(idle(CPU), items, self.pools)
        expected, prefixes = self._predict_admit(items)
        if expected is not None:
            self._assert_failed(result, expected, before)
            return None
        assert isinstance(result, Success), f"expected Success, got {result}"
        batch, pools = result.unwrap()
        check_forward(batch, pools)  # no cell a row reads as its prefix is one it writes
        _count("evicted pages", pools.cache.num_evicted - self.pools.cache.num_evicted)
        new_slots = iter(self.free_slots)
        slots = [item.slot if isinstance(item, Chunked) else next(new_slots) for item in items]
        reqs = [item.req if isinstance(item, Chunked) else item for item in items]
        num_new = sum(isinstance(item, Req) for item in items)
        assert batch.rows.req_pool_indices.host.tolist() == slots
        assert batch.rows.seq_lens.host.tolist() == [len(req.input_ids) for req in reqs]
        assert batch.prefix_lens.tolist() == list(prefixes), f"cache hits {batch.prefix_lens}"
        assert batch.rows.reqs == tuple(reqs)
        ids = [i for req, p in zip(reqs, prefixes, strict=True) for i in req.input_ids[p:]]
        assert batch.input_ids.device.tolist() == ids
        self.pools = pools
        locs: list[int] = batch.out_cache_loc.device.tolist()
        at = 0
        for req, slot, prefix in zip(reqs, slots, prefixes, strict=True):
            own = locs[at : at + len(req.input_ids) - prefix]
            self._write_at(own, slot, req.input_ids, prefix, len(req.input_ids))
            at += len(own)
            self._assert_published(slot, req.input_ids)
        assert at == len(locs)
        self.free_slots = self.free_slots[num_new:]
        self.waiting = [req for req in self.waiting if req not in items]
        self.held = [chunk for chunk in self.held if chunk not in items]
        self.rows += [
            _Row(req, slot, list(req.input_ids)) for req, slot in zip(reqs, slots, strict=True)
        ]
        self.running = merge(self._base(), filter_batch(batch, list(range(len(reqs)))))
        _count("extends")
        hits = [p for p, item in zip(prefixes, items, strict=True) if isinstance(item, Req)]
        _count("hit tokens", sum(hits))
        _count("chunks continued", len(items) - num_new)
        return tuple(prefixes)

    @precondition(lambda self: bool(self.rows))
    @rule()
    def step_decode(self) -> None:
        """Decode every row: one more KV location each, evicting when free pages run short."""
        shape, running = self.shape, self._base()
        assert not isinstance(running, Idle)
        before = snapshot((self.pools, self.running))
        result = decode(running, self.pools)
        too_long = self._too_long(self.rows)
        if too_long is not None:
            self._assert_failed(result, too_long, before)
            return
        lens = [len(row.tokens) for row in self.rows]
        needed = sum(1 for length in lens if length % shape.page_size == 0)
        available = self._available(set())
        if needed > available:
            self._assert_failed(result, OutOfKVTokens(needed, available, shape.page_size), before)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        evicted = self.pools.cache.num_evicted
        batch, self.pools = result.unwrap()
        check_forward(batch, self.pools)
        _count("evicted pages", self.pools.cache.num_evicted - evicted)
        locs = []
        for row in self.rows:
            row.tokens.append(_generated(row.tokens))
            locs += self._write(row.slot, row.tokens, len(row.tokens) - 1, len(row.tokens))
        assert batch.out_cache_loc.device.tolist() == locs
        self.running = batch
        _count("decodes")

    @precondition(lambda self: bool(self.rows) and isinstance(self.running, Decoding))
    @rule(
        drafts=st.lists(st.integers(0, 4), min_size=1, max_size=8),
        share=st.sampled_from([0.0, 0.5, 1.0]),
    )
    def speculate(self, drafts: list[int], share: float) -> None:
        """Open a verify window over the decode batch, then sync a random accepted count per
        row: drafts' KV reserved (evicting when short), rejected drafts' pages freed."""
        running, shape = self.running, self.shape
        assert isinstance(running, Decoding)
        lens = [len(row.tokens) for row in self.rows]
        counts = [
            min(drafts[i % len(drafts)], shape.max_context_len - length)
            for i, length in enumerate(lens)
        ]
        before = snapshot((self.pools, self.running))
        result = verify(running, counts, self.pools)
        needed = sum(
            _pages(n + d, shape.page_size) - _pages(n, shape.page_size)
            for n, d in zip(lens, counts, strict=True)
        )
        available = self._available(set())
        if needed > available:
            self._assert_failed(result, OutOfKVTokens(needed, available, shape.page_size), before)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        window, pools = result.unwrap()
        check_forward(window, pools)
        took = [int(count * share) for count in counts]  # none, half or all accepted
        synced, self.pools = sync(window, np.array(took, dtype=np.int64), pools)
        for row, count in zip(self.rows, took, strict=True):
            start = len(row.tokens)
            for _ in range(count):  # the drafts the target agreed with: its own tokens
                row.tokens.append(_generated(row.tokens))
            self._write(row.slot, row.tokens, start, start + count)
        assert synced.rows.seq_lens.host.tolist() == [len(row.tokens) for row in self.rows]
        self.running = synced
        _count("speculative windows")
        _count("accepted drafts", sum(took))

    @precondition(lambda self: bool(self.rows) and isinstance(self.running, Filtered))
    @rule()
    def overlap_decode(self) -> None:
        """Decode fed the last forward's tokens on the device (`decode_sampled`): one more KV
        location per row, as `decode` gives it, and the tokens taken from the device."""
        running, shape = self.running, self.shape
        assert isinstance(running, Filtered)
        tokens = torch.tensor([_generated(row.tokens) for row in self.rows], dtype=torch.int64)
        before = snapshot((self.pools, self.running))
        result = decode_sampled(running, Sampled.of(running.rows, tokens), self.pools)
        too_long = self._too_long(self.rows)
        lens = [len(row.tokens) for row in self.rows]
        needed = sum(1 for length in lens if length % shape.page_size == 0)
        available = self._available(set())
        if too_long is not None:
            self._assert_failed(result, too_long, before)
            return
        if needed > available:
            self._assert_failed(result, OutOfKVTokens(needed, available, shape.page_size), before)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        mixed, self.pools = result.unwrap()
        check_forward(mixed, self.pools)
        assert mixed.input_ids.device.tolist() == tokens.tolist()
        for row in self.rows:
            row.tokens.append(_generated(row.tokens))
            self._write(row.slot, row.tokens, len(row.tokens) - 1, len(row.tokens))
        self.running = finish_mixed(mixed).running
        _count("overlap decodes")

    @precondition(lambda self: bool(self.rows))
    @rule(pattern=keep_patterns(), with_tokens=st.booleans())
    def finish(self, pattern: tuple[bool, ...], with_tokens: bool) -> None:
        """Split rows off and release them, caching their prompt and output (or their prompt)."""
        running = self._base()
        assert not isinstance(running, Idle)
        keep = tile(pattern, len(self.rows))
        kept, left = split(running, keep)
        gone = [row for position, row in enumerate(self.rows) if position not in keep]
        tokens = [list(row.tokens) for row in gone] if with_tokens else None
        result = release(left, kept, self.pools, tokens)
        assert isinstance(result, Success), f"expected Success, got {result}"
        self.pools = result.unwrap()
        for row in gone:
            cached = row.tokens if with_tokens else row.req.input_ids[: len(row.tokens)]
            self._assert_cached(cached)
        self.free_slots += [row.slot for row in gone]
        self.rows = [self.rows[position] for position in keep]
        self.running = kept
        _count("released rows", len(gone))

    @precondition(lambda self: bool(self.rows))
    @rule(pick=st.integers(0, 7), at_once=st.booleans())
    def retract(self, pick: int, at_once: bool) -> None:
        """Release a running row with its tokens; admit its prompt and output again: a cache hit."""
        running = self._base()
        assert not isinstance(running, Idle)
        position = pick % len(self.rows)
        row = self.rows[position]
        keep = [other for other in range(len(self.rows)) if other != position]
        kept, left = split(running, keep)
        result = release(left, kept, self.pools, [row.tokens])
        assert isinstance(result, Success), f"expected Success, got {result}"
        self.pools, self.running = result.unwrap(), kept
        self.rows.pop(position)
        self.free_slots.append(row.slot)
        self._assert_cached(row.tokens)
        again = Req(row.req.rid, tuple(row.tokens))
        usable = (len(again.input_ids) - 1) // self.shape.page_size * self.shape.page_size
        assert self._match(again.input_ids)[0] == usable, "a retracted row's KV is not cached"
        _count("retractions")
        if not at_once:
            self.waiting.append(again)
            return
        prefixes = self._extend([again])
        if prefixes is None:
            self.waiting.append(again)
        else:
            assert prefixes == (usable,)
            _count("retraction hits")

    @rule(
        data=st.data(),
        num_new=st.integers(0, 2),
        chunk_picks=st.lists(st.integers(0, 7), max_size=2, unique=True),
        budget=st.sampled_from([0, 1, 2, 3, 5, 8, 16]),
        with_running=st.booleans(),
        new_first=st.booleans(),
    )
    def mixed_step(
        self,
        *,
        data: st.DataObject,
        num_new: int,
        chunk_picks: list[int],
        budget: int,
        with_running: bool,
        new_first: bool,
    ) -> None:
        """Mix held chunks and new prompts under a budget with the running rows; finish_mixed.

        `new_first`: the new prompts go before the held chunks (a new request sharing a
        chunk's prompt publishes in the same forward as the chunk continues)."""
        running = self._as_filtered()
        base = running if with_running else idle(CPU)
        decode_rows = self.rows if with_running else []
        admit = self._admitted(data, num_new, chunk_picks, new_first=new_first)
        tokens = [_generated(row.tokens) for row in decode_rows]
        before = snapshot((self.pools, self.running))
        result = mix(base, admit, budget, self.pools, tokens)
        expected, taken = self._predict_mix(admit, budget, decode_rows)
        if expected is not None:
            self._assert_failed(result, expected, before)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        mixed, pools = result.unwrap()
        check_forward(mixed, pools)
        _count("evicted pages", pools.cache.num_evicted - self.pools.cache.num_evicted)
        self.pools = pools
        # The model: extend rows first (chunks keep their slots), then the decode rows.
        new_slots = iter(self.free_slots)
        extend_rows: list[tuple[Req, int, int, int]] = []  # req, slot, prefix, end
        for item, (prefix, take) in zip(admit, taken, strict=False):
            req, slot = (item.req, item.slot) if isinstance(item, Chunked) else (item, 0)
            extend_rows.append((req, slot or next(new_slots), prefix, prefix + take))
        num_new_taken = sum(isinstance(item, Req) for item in admit[: len(taken)])
        assert mixed.num_extend_rows == len(extend_rows)
        assert mixed.rows.req_pool_indices.host.tolist() == [
            slot for _, slot, _, _ in extend_rows
        ] + [row.slot for row in decode_rows]
        assert mixed.prefix_lens.tolist() == [p for _, _, p, _ in extend_rows] + [
            len(row.tokens) for row in decode_rows
        ]
        out = mixed.out_cache_loc.device.tolist()
        at = 0
        for req, slot, prefix, end in extend_rows:
            self._write_at(out[at : at + end - prefix], slot, req.input_ids, prefix, end)
            at += end - prefix
            self._assert_published(slot, req.input_ids[:end])
        locs: list[int] = out[:at]
        for row in decode_rows:
            row.tokens.append(_generated(row.tokens))
            locs += self._write(row.slot, row.tokens, len(row.tokens) - 1, len(row.tokens))
        assert out == locs
        settled, held = finish_mixed(mixed)
        cut = [(req, slot, end) for req, slot, _, end in extend_rows if end < len(req.input_ids)]
        done = [(req, slot) for req, slot, _, end in extend_rows if end == len(req.input_ids)]
        assert [(c.req.rid, c.slot, c.cached) for c in held] == [
            (req.rid, slot, end) for req, slot, end in cut
        ]
        spent = [item for item in admit[: len(taken)] if isinstance(item, Chunked)]
        self.held = [chunk for chunk in self.held if chunk not in spent] + list(held)
        self.free_slots = self.free_slots[num_new_taken:]
        finished = [_Row(req, slot, list(req.input_ids)) for req, slot in done]
        if with_running:
            self.running, self.rows = settled, decode_rows + finished
        else:
            self.running, self.rows = merge(running, settled), self.rows + finished
        _count("mixed steps")
        _count("chunks continued", len(spent))
        _count("chunks held", len(held))

    def _admitted(
        self, data: st.DataObject, num_new: int, chunk_picks: list[int], *, new_first: bool
    ) -> list[Req | Chunked]:
        # Held chunks (picked) and new prompts (drawn), the new ones first or last.
        picks = sorted({pick % len(self.held) for pick in chunk_picks}) if self.held else []
        held: list[Req | Chunked] = [self.held[pick] for pick in picks]
        new: list[Req | Chunked] = [
            Req(self._fresh_rid(), data.draw(_prompts(self.shape.max_context_len), label="prompt"))
            for _ in range(num_new)
        ]
        return [*new, *held] if new_first else [*held, *new]

    def _predict_mix(
        self, admit: Sequence[Req | Chunked], budget: int, decode_rows: Sequence[_Row]
    ) -> tuple[object | None, list[tuple[int, int]]]:
        """`mix`'s first failure (None: success), and (prefix, tokens computed) per row taken."""
        shape = self.shape
        refusal: object | None
        if budget < 1:
            refusal = NoChunkBudget(budget)
        elif not admit and not decode_rows:
            refusal = EmptyExtend()
        else:
            refusal = self._bad_prompt(admit)
            if refusal is None:
                refusal = self._too_long(decode_rows)
        if refusal is not None:
            return refusal, []
        lens = [len(row.tokens) for row in decode_rows]
        taken: list[tuple[int, int]] = []
        locked: set[int] = set()
        needed, num_new, left = 0, 0, budget
        for item in admit:
            if not left:
                break
            if isinstance(item, Chunked):
                req, prefix = item.req, item.cached
            else:
                req, (prefix, pages) = item, self._match(item.input_ids)
                locked.update(pages)
                num_new += 1
            take = min(len(req.input_ids) - prefix, left)
            left -= take
            needed += _pages(prefix + take, shape.page_size) - _pages(prefix, shape.page_size)
            taken.append((prefix, take))
        if num_new > len(self.free_slots):
            return OutOfReqSlots(num_new, len(self.free_slots)), []
        needed += sum(1 for length in lens if length % shape.page_size == 0)
        available = self._available(locked)
        if needed > available:
            return OutOfKVTokens(needed, available, shape.page_size), []
        return None, taken

    @precondition(lambda self: bool(self.held))
    @rule(pick=st.integers(0, 7), with_tokens=st.booleans())
    def release_chunk(self, pick: int, with_tokens: bool) -> None:
        """Give up a held chunk: its whole computed pages stay cached."""
        chunk = self.held.pop(pick % len(self.held))
        tokens = [chunk.req.input_ids] if with_tokens else None
        result = release(chunk, self._base(), self.pools, tokens)
        assert isinstance(result, Success), f"expected Success, got {result}"
        self.pools = result.unwrap()
        self._assert_cached(chunk.req.input_ids[: chunk.cached])
        self.free_slots.append(chunk.slot)
        _count("chunks released")

    @precondition(lambda self: self.pools.cache.num_evictable > 0)
    @rule()
    def flush_cache(self) -> None:
        """Evict every page no live row reads: only live rows' pages stay out of the free list."""
        evictable, evicted = self.pools.cache.num_evictable, self.pools.cache.num_evicted
        self.pools = flush(self.pools)
        assert self.pools.cache.num_evictable == 0
        assert self.pools.cache.num_evicted == evicted + evictable
        page_size, table = self.shape.page_size, self.pools.table.host
        live = {
            int(page)
            for slot, tokens in self._live()
            for page in table[slot, : len(tokens) : page_size] // page_size
        }
        every = set(range(1, self.shape.num_pages + 1))
        assert every - set(self.pools.free_pages.tolist()) == live
        _count("flushes")

    # ---- checks -------------------------------------------------------------------------

    @invariant()
    def holds_everything(self) -> None:
        """The library's checks, then the model's slots, lengths, pages and KV contents."""
        _count("steps")
        pools, page_size = self.pools, self.shape.page_size
        check_batch(self.running, compare_device=True)
        check_pools(pools, [self.running], compare_device=True)
        check_leaks(pools, [self.running, *self.held])
        rows = self.running.rows
        assert rows.rids.tolist() == [row.req.rid for row in self.rows]
        assert rows.req_pool_indices.host.tolist() == [row.slot for row in self.rows]
        assert rows.seq_lens.host.tolist() == [len(row.tokens) for row in self.rows]
        assert pools.free_slots.tolist() == self.free_slots
        live = self._live()
        owned = dict.fromkeys(range(1, self.shape.max_reqs + 1), 0)
        owned.update((slot, len(tokens)) for slot, tokens in live)
        assert pools.slot_tokens[1:].tolist() == list(owned.values()), "slots owned"
        entries = pools.cache.entries()
        free = set(pools.free_pages.tolist())
        retired = set(pools.retired.tolist())
        evictable = {page for page, locks in entries.values() if not locks}
        table = pools.table.host
        for slot, tokens in live:
            prefix = pools.prefixes.get(slot, ())
            assert prefix == tokens[: len(prefix)], f"slot {slot} reads another row's prefix"
            pages = set((table[slot, : len(tokens) : page_size] // page_size).tolist())
            assert not pages & free, f"slot {slot} reads free pages {sorted(pages & free)}"
            assert not pages & retired, f"slot {slot} reads retired pages {sorted(pages & retired)}"
            assert not pages & evictable, f"slot {slot} reads evictable {sorted(pages & evictable)}"
            locs = table[slot, : len(tokens)].tolist()
            for position, loc in enumerate(locs):
                assert self.kv.get(loc) == tokens[: position + 1], (
                    f"slot {slot} reads, at position {position}, KV of other tokens"
                )
        for key, (page, _) in entries.items():
            first = len(key) - page_size
            for lane in range(page_size):
                assert self.kv.get(page * page_size + lane) == key[: first + lane + 1], (
                    f"cached page {page} holds KV of other tokens than its key"
                )
        _count("cached pages seen", len(entries))
        _count("shared pages seen", sum(1 for _, locks in entries.values() if locks > 1))


def test_state_machine_with_the_prefix_cache() -> None:
    """No sequence of transitions over shared pages breaks an invariant or the model."""
    _counts.clear()
    _failures.clear()
    elapsed = run_timed(CacheMachine, MAX_EXAMPLES)
    print(
        f"\ncache state machine: {_counts} in {elapsed:.1f} s"
        f" ({'long' if LONG else 'CI'} profile); failures seen: {_failures}"
    )
    assert _counts["steps"] > _counts["examples"], "the machine ran no steps"
    if FAST:
        return  # the mutation profile's budget is too small to reach everything
    reached = (
        "hit tokens", "evicted pages", "retraction hits", "chunks continued", "chunks held",
        "speculative windows", "accepted drafts", "overlap decodes",
    )  # fmt: skip
    for what in (*reached, "shared pages seen", "flushes"):
        assert _counts.get(what), f"never reached: {what}"
    expected = {"OutOfKVTokens", "OutOfReqSlots", "ContextTooLong", "EmptyPrompt"}
    assert expected <= set(_failures), f"never reached: {expected - set(_failures)}"
