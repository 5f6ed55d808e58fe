"""A model-based state machine for the prefix cache: cached extends, decodes and releases.

A plain-Python model (a dict from every cached page-aligned prefix to its
page, and the rows locking each) predicts every hit length, which failure
comes first, which prefixes a release caches and how many pages stay free.
Eviction is checked rather than predicted leaf by leaf: it happens only
when free pages run short, takes only unlocked prefixes, whole subtrees
of them, and frees at least the shortage. After every step the tree must
equal the model and `check_cached_pools` must hold, device compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from returns.result import Failure, Success

from batchstate import (
    CachedPools,
    ContextTooLong,
    EmptyPrompt,
    Filtered,
    Idle,
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    Req,
    cached_pools,
    check_batch,
    check_cached_pools,
    decode_cached,
    extend_cached,
    filter_batch,
    idle,
    make_pools,
    merge,
    release_cached,
    split,
)
from tests.strategies import CPU, LONG, keep_patterns, tile

MAX_EXAMPLES: Final = 2000 if LONG else 120
STEP_COUNT: Final = 60 if LONG else 30
MAX_CONTEXT: Final = 24
HEADERS: Final = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 9, 9, 9), (4, 4, 4, 4, 4))

_seen: dict[str, int] = {}


@attrs.define
class _Row:
    req: Req
    slot: int
    seq_len: int
    hit: int  # tokens read from the cache


class CacheMachine(RuleBasedStateMachine):
    """Cached pools, a running batch, and the model of the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.pools: CachedPools = cached_pools(make_pools(1, 1, 0, CPU))
        self.page_size = 1
        self.running: Filtered | Idle = idle(CPU)
        self.rows: list[_Row] = []
        self.cache: dict[tuple[int, ...], int] = {}  # prefix -> page
        self.locks: dict[tuple[int, ...], int] = {}  # prefix -> rows reading it
        self.released: list[tuple[Filtered, list[int]]] = []
        self.next_rid = 0

    # ---- the model ----------------------------------------------------------------------

    def _hit(self, ids: tuple[int, ...]) -> int:
        page, usable = self.page_size, (len(ids) - 1) // self.page_size * self.page_size
        length = 0
        while length + page <= usable and ids[: length + page] in self.cache:
            length += page
        return length

    def _prefixes(self, ids: Sequence[int], length: int) -> list[tuple[int, ...]]:
        return [tuple(ids[:end]) for end in range(self.page_size, length + 1, self.page_size)]

    def _evictable(self, locks: dict[tuple[int, ...], int]) -> int:
        return sum(1 for prefix in self.cache if not locks.get(prefix))

    def _private(self) -> int:
        page = self.page_size
        return sum(-(-row.seq_len // page) - row.hit // page for row in self.rows)

    def _free_pages(self) -> int:
        return self.pools.num_pages - len(self.cache) - self._private()

    def _seen(self, name: str) -> None:
        _seen[name] = _seen.get(name, 0) + 1

    def _expect_failure(self, result: object, kind: type, before: CachedPools) -> None:
        assert isinstance(result, Failure), f"expected {kind.__name__}, got {result}"
        assert type(result.failure()) is kind, f"expected {kind.__name__}, got {result}"
        assert self.pools is before
        self._seen(kind.__name__)

    def _absorb_eviction(self, after: CachedPools, needed: int, free: int) -> None:
        # The tree after an allocation: the model less some evicted prefixes.
        entries = after.cache.entries()
        evicted = set(self.cache) - set(entries)
        assert set(entries) <= set(self.cache), "an allocation added to the cache"
        if needed <= free:
            assert not evicted, "evicted while free pages sufficed"
        else:
            assert len(evicted) >= needed - free, "evicted less than the shortage"
            self._seen("eviction")
        for prefix in evicted:
            assert not self.locks.get(prefix), f"evicted a prefix in use: {prefix}"
            for longer in self.cache:
                if longer[: len(prefix)] == prefix:
                    assert longer in evicted, "evicted a prefix but kept a longer one"
            del self.cache[prefix]

    # ---- rules --------------------------------------------------------------------------

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(4, 24),
        max_reqs=st.integers(1, 5),
    )
    def start(self, page_size: int, num_pages: int, max_reqs: int) -> None:
        self.page_size = page_size
        pools = make_pools(max_reqs, MAX_CONTEXT, num_pages * page_size, CPU, page_size)
        self.pools = cached_pools(pools)

    @rule(
        picks=st.lists(
            st.tuples(st.integers(0, len(HEADERS)), st.lists(st.integers(1, 3), max_size=8)),
            max_size=3,
        ),
        empty=st.integers(0, 15),
    )
    def admit(self, picks: list[tuple[int, list[int]]], empty: int) -> None:
        """Extend requests that share headers; merge them into the running batch."""
        reqs: list[Req] = []
        for header, tail in picks:
            self.next_rid += 1
            ids = (HEADERS[header] if header < len(HEADERS) else ()) + tuple(tail)
            reqs.append(Req(self.next_rid, () if empty == 0 and not reqs else ids))
        before = self.pools
        result = extend_cached(idle(CPU), reqs, before)
        if not reqs:
            return
        if any(not req.input_ids for req in reqs):
            self._expect_failure(result, EmptyPrompt, before)
            return
        if any(len(req.input_ids) > MAX_CONTEXT for req in reqs):
            self._expect_failure(result, ContextTooLong, before)
            return
        if len(reqs) > before.num_free_slots:
            self._expect_failure(result, OutOfReqSlots, before)
            return
        hits = [self._hit(req.input_ids) for req in reqs]
        locks = dict(self.locks)
        for req, hit in zip(reqs, hits, strict=True):
            for prefix in self._prefixes(req.input_ids, hit):
                locks[prefix] = locks.get(prefix, 0) + 1
        page = self.page_size
        needed = sum(-(-(len(r.input_ids) - h) // page) for r, h in zip(reqs, hits, strict=True))
        free = self._free_pages()
        if needed > free + self._evictable(locks):
            self._expect_failure(result, OutOfKVTokens, before)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        batch, after = result.unwrap()
        assert batch.prefix_lens == tuple(hits)
        if any(hits):
            self._seen("hit")
        slots = batch.rows.req_pool_indices.host.tolist()
        table = after.table.host
        for req, hit, slot in zip(reqs, hits, slots, strict=True):
            for prefix in self._prefixes(req.input_ids, hit):
                cell = int(table[slot, len(prefix) - page])
                assert cell // page == self.cache[prefix], "a hit reads another page"
        self.locks = locks
        self._absorb_eviction(after, needed, free)
        self.pools = after
        new = [
            _Row(req, slot, len(req.input_ids), hit)
            for req, hit, slot in zip(reqs, hits, slots, strict=True)
        ]
        self.running = merge(self.running, batch)
        self.rows += new

    @precondition(lambda self: bool(self.rows))
    @rule()
    def step(self) -> None:
        """Decode every running row: evicts when free pages run short."""
        assert not isinstance(self.running, Idle)
        before = self.pools
        result = decode_cached(self.running, before)
        if max(row.seq_len for row in self.rows) >= MAX_CONTEXT:
            self._expect_failure(result, ContextTooLong, before)
            return
        needed = sum(1 for row in self.rows if row.seq_len % self.page_size == 0)
        free = self._free_pages()
        if needed > free + self._evictable(self.locks):
            self._expect_failure(result, OutOfKVTokens, before)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        batch, after = result.unwrap()
        self._absorb_eviction(after, needed, free)
        for row in self.rows:
            row.seq_len += 1
        self.pools, self.running = after, filter_batch(batch, list(range(len(self.rows))))

    @precondition(lambda self: bool(self.rows))
    @rule(pattern=keep_patterns(), generated=st.booleans())
    def finish(self, pattern: tuple[bool, ...], generated: bool) -> None:
        """Rows leave in any order and go into the cache, with or without their outputs."""
        assert not isinstance(self.running, Idle)
        keep = tile(pattern, len(self.rows))
        gone = [self.rows[index] for index in range(len(self.rows)) if index not in keep]
        kept, left = split(self.running, keep)
        tokens = [self._tokens(row) if generated else row.req.input_ids for row in gone]
        after = release_cached(left, kept, self.pools, tokens).unwrap()
        table = self.pools.table.host
        page = self.page_size
        for row, ids in zip(gone, tokens, strict=True):
            for prefix in self._prefixes(row.req.input_ids, row.hit):
                self.locks[prefix] -= 1
            full = min(len(ids), row.seq_len) // page * page
            for prefix in self._prefixes(ids, full):
                if prefix not in self.cache:
                    self.cache[prefix] = int(table[row.slot, len(prefix) - page]) // page
        self.locks = {prefix: count for prefix, count in self.locks.items() if count}
        self.released.append(
            (
                filter_batch(self.running, [i for i in range(len(self.rows)) if i not in keep]),
                [row.slot for row in gone],
            )
        )
        self.pools, self.running = after, kept
        self.rows = [self.rows[index] for index in keep]

    @precondition(lambda self: bool(self.released))
    @rule(pick=st.integers(0, 5))
    def release_twice(self, pick: int) -> None:
        """Releasing rows again: NotOwned (or StillRunning), nothing changed."""
        left, slots = self.released[pick % len(self.released)]
        live = {row.slot for row in self.rows}
        if not slots or set(slots) & live:
            return
        before = self.pools
        self._expect_failure(release_cached(left, self.running, before), NotOwned, before)

    def _tokens(self, row: _Row) -> tuple[int, ...]:
        # The prompt, then the tokens its decodes produced (made up: the KV is not modelled).
        extra = row.seq_len - len(row.req.input_ids)
        return row.req.input_ids + tuple(1 + (row.req.rid + step) % 3 for step in range(extra))

    @invariant()
    def cache_matches_model(self) -> None:
        pools = self.pools
        check_batch(self.running, compare_device=True)
        check_cached_pools(pools, [self.running], compare_device=True)
        entries = pools.cache.entries()
        assert {prefix: page for prefix, (page, _) in entries.items()} == self.cache
        assert {prefix: locks for prefix, (_, locks) in entries.items() if locks} == self.locks
        assert len(pools.free_pages) == self._free_pages()
        counts = pools.ref_counts()
        assert int(counts.sum()) == len(self.cache) + sum(self.locks.values()) + self._private()


run_machine: Callable[..., None] = run_state_machine_as_test


def test_prefix_cache_machine() -> None:
    """No sequence of cached transitions breaks an invariant or disagrees with the model."""
    _seen.clear()
    run_machine(
        CacheMachine,
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=STEP_COUNT,
            deadline=None,
            derandomize=not LONG,  # CI: the same sequences each run, coverage checked below
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    print(f"\nprefix cache machine: {_seen}")
    expected = {"hit", "eviction", "OutOfKVTokens", "OutOfReqSlots", "NotOwned"}
    assert expected <= set(_seen), f"never reached: {expected - set(_seen)}"
