"""A model-based state machine for the prefix cache: extends, chunks, decodes and releases.

A plain-Python model (a dict from every cached page-aligned prefix to its
page, the rows locking each, and the prefix each row reads) predicts every
hit length, which failure comes first, which pages a prefill or a chunk
publishes at its end (and which rows read the cache's copy instead, their
own pages retired, because another row cached the same tokens first; a
prebuilt row keeps its own private), which prefixes a release caches
and how many pages stay free. Eviction is checked rather than predicted
leaf by leaf: it happens only when free pages run short, takes only
unlocked prefixes, whole subtrees of them, frees at least the shortage, and
is counted in `num_evicted`. After every step the tree, the locks and each
slot's prefix must equal the model and `check_pools` must hold, device
compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import attrs
import torch
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
    Chunked,
    ContextTooLong,
    EmptyPrompt,
    Filtered,
    Idle,
    NotHeld,
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    Pools,
    Req,
    admit_prefilled,
    check_batch,
    check_pools,
    decode,
    extend,
    filter_batch,
    finish_mixed,
    idle,
    make_pools,
    merge,
    mix,
    release,
    split,
)
from tests.strategies import CPU, LONG, keep_patterns, tile

MAX_EXAMPLES: Final = 2000 if LONG else 120
STEP_COUNT: Final = 60 if LONG else 30
MAX_CONTEXT: Final = 24
HEADERS: Final = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 9, 9, 9), (4, 4, 4, 4, 4))

Prefix = tuple[int, ...]
_seen: dict[str, int] = {}


@attrs.define
class _Row:
    req: Req
    slot: int
    seq_len: int
    prefix: Prefix  # the cached prefix the row reads (and locks)


class CacheMachine(RuleBasedStateMachine):
    """Pools with the cache on, a running batch, held chunks, and the model of the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.pools: Pools = make_pools(1, 1, 0, CPU, prefix_cache=True)
        self.page_size = 1
        self.running: Filtered | Idle = idle(CPU)
        self.rows: list[_Row] = []
        self.held: list[tuple[Chunked, _Row]] = []  # chunks between their prefill's chunks
        self.cache: dict[Prefix, int] = {}  # prefix -> page
        self.locks: dict[Prefix, int] = {}  # prefix -> rows reading it
        self.released: list[tuple[Filtered, list[int]]] = []
        self.spent: list[Chunked] = []  # chunks continued or released: never held again
        self.next_rid = 0

    # ---- the model ----------------------------------------------------------------------

    def _match(self, ids: Sequence[int]) -> int:
        # The longest cached prefix of `ids`, whole pages.
        page, length = self.page_size, 0
        while length + page <= len(ids) and tuple(ids[: length + page]) in self.cache:
            length += page
        return length

    def _hit(self, ids: Prefix) -> int:
        # What a new request reads: whole pages, leaving its last token to compute.
        return self._match(ids[: (len(ids) - 1) // self.page_size * self.page_size])

    def _prefixes(self, ids: Sequence[int], start: int, end: int) -> list[Prefix]:
        # The page-aligned prefixes of `ids` ending in (start, end].
        page = self.page_size
        return [tuple(ids[:stop]) for stop in range(start + page, end + 1, page)]

    def _lock(self, locks: dict[Prefix, int], ids: Sequence[int], start: int, end: int) -> None:
        for prefix in self._prefixes(ids, start, end):
            locks[prefix] = locks.get(prefix, 0) + 1

    def _evictable(self, locks: dict[Prefix, int]) -> int:
        return sum(1 for prefix in self.cache if not locks.get(prefix))

    def _every_row(self) -> list[_Row]:
        return self.rows + [row for _, row in self.held]

    def _private(self) -> int:
        page = self.page_size
        return sum(-(-row.seq_len // page) - len(row.prefix) // page for row in self._every_row())

    def _free_slots(self) -> int:
        return self.pools.max_reqs - len(self._every_row())

    def _free_pages(self) -> int:
        return self.pools.num_pages - len(self.cache) - self._private()

    def _seen(self, name: str) -> None:
        _seen[name] = _seen.get(name, 0) + 1

    def _expect_failure(self, result: object, kind: type, before: Pools) -> None:
        assert isinstance(result, Failure), f"expected {kind.__name__}, got {result}"
        assert type(result.failure()) is kind, f"expected {kind.__name__}, got {result}"
        assert self.pools is before
        self._seen(kind.__name__)

    def _absorb_eviction(
        self, after: Pools, locks: dict[Prefix, int], fresh: set[int], needed: int, free: int
    ) -> None:
        # The model less what the allocation evicted. Pages just allocated (`fresh`)
        # were free or evicted before: an entry at one of them was published since.
        entries = after.cache.entries()
        survivors = {prefix: page for prefix, (page, _) in entries.items() if page not in fresh}
        for prefix, page in survivors.items():
            assert self.cache.get(prefix) == page, f"a transition moved or added {prefix}"
        evicted = set(self.cache) - set(survivors)
        assert after.cache.num_evicted - self.pools.cache.num_evicted == len(evicted)
        if needed <= free:
            assert not evicted, "evicted while free pages sufficed"
        else:
            assert len(evicted) >= needed - free, "evicted less than the shortage"
            self._seen("eviction")
        for prefix in evicted:
            assert not locks.get(prefix), f"evicted a prefix in use: {prefix}"
            for longer in self.cache:
                if longer[: len(prefix)] == prefix:
                    assert longer in evicted, "evicted a prefix but kept a longer one"
        for prefix in evicted:
            del self.cache[prefix]

    def _publish(self, after: Pools, row: _Row, ids: Sequence[int], *, retire: bool) -> None:
        # A prefill or a chunk ended: the row's whole pages of `ids` go into the cache
        # and its lock moves onto them. Where the cache holds them already (another row
        # cached them first), the row reads the cache's pages, its own retired; a
        # prebuilt row (`retire` false) keeps its own private instead.
        full = len(ids) // self.page_size * self.page_size
        start = len(row.prefix)
        if full <= start:
            return
        cached = self._match(ids[:full])
        if cached != start and not retire:
            self._seen("kept private")
            return
        if cached != start:
            self._lock(self.locks, ids, start, cached)
            row.prefix = tuple(ids[:cached])
            self._check_hits(after, [row])
            self._seen("read the cache's copy")
            start = cached
            if full <= start:
                return
        table, page = after.table.host, self.page_size
        for prefix in self._prefixes(ids, start, full):
            self.cache[prefix] = int(table[row.slot, len(prefix) - page]) // page
        self._lock(self.locks, ids, start, full)
        row.prefix = tuple(ids[:full])
        self._seen("published")

    def _fresh_pages(self, after: Pools, slots: Sequence[int], starts: Sequence[int]) -> set[int]:
        # The pages each slot owns from the page holding position `starts[i]` on, in
        # `after`: new ones, and a partly filled one the row had (private, never cached).
        table, page = after.table.host, self.page_size
        pages: set[int] = set()
        for slot, start in zip(slots, starts, strict=True):
            first = start // page * page
            end = int(after.slot_tokens[slot])
            pages |= {int(cell) // page for cell in table[slot, first:end:page]}
        return pages

    def _check_hits(self, after: Pools, rows: Sequence[_Row]) -> None:
        table, page = after.table.host, self.page_size
        for row in rows:
            for prefix in self._prefixes(row.req.input_ids, 0, len(row.prefix)):
                cell = int(table[row.slot, len(prefix) - page])
                assert cell // page == self.cache[prefix], "a hit reads another page"

    # ---- rules --------------------------------------------------------------------------

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(4, 24),
        max_reqs=st.integers(1, 5),
    )
    def start(self, page_size: int, num_pages: int, max_reqs: int) -> None:
        self.page_size = page_size
        self.pools = make_pools(
            max_reqs, MAX_CONTEXT, num_pages * page_size, CPU, page_size, prefix_cache=True
        )

    def _new_reqs(self, picks: list[tuple[int, list[int]]], empty: int) -> list[Req]:
        reqs: list[Req] = []
        for header, tail in picks:
            self.next_rid += 1
            ids = (HEADERS[header] if header < len(HEADERS) else ()) + tuple(tail)
            reqs.append(Req(self.next_rid, () if empty == 0 and not reqs else ids))
        return reqs

    @rule(
        picks=st.lists(
            st.tuples(st.integers(0, len(HEADERS)), st.lists(st.integers(1, 3), max_size=8)),
            max_size=3,
        ),
        empty=st.integers(0, 15),
        arrives_whole=st.integers(0, 4),
    )
    def admit(self, picks: list[tuple[int, list[int]]], empty: int, arrives_whole: int) -> None:
        """Extend (or now and then `admit_prefilled`) requests that share headers; merge them in."""
        reqs = self._new_reqs(picks, empty)
        whole = arrives_whole == 0  # prebuilt: nothing read from the cache, KV arrives whole
        before = self.pools
        result = (admit_prefilled if whole else extend)(idle(CPU), reqs, before)
        if not reqs:
            return
        if any(not req.input_ids for req in reqs):
            self._expect_failure(result, EmptyPrompt, before)
            return
        if any(len(req.input_ids) > MAX_CONTEXT for req in reqs):
            self._expect_failure(result, ContextTooLong, before)
            return
        if len(reqs) > self._free_slots():
            self._expect_failure(result, OutOfReqSlots, before)
            return
        # Every prompt matches the cache as it was before the extend.
        hits = [0 if whole else self._hit(req.input_ids) for req in reqs]
        locks = dict(self.locks)
        for req, hit in zip(reqs, hits, strict=True):
            self._lock(locks, req.input_ids, 0, hit)
        page = self.page_size
        needed = sum(-(-(len(r.input_ids) - h) // page) for r, h in zip(reqs, hits, strict=True))
        free = self._free_pages()
        if needed > free + self._evictable(locks):
            self._expect_failure(result, OutOfKVTokens, before)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        batch, after = result.unwrap()
        if not whole:
            assert batch.prefix_lens.tolist() == list(hits)
        if any(hits):
            self._seen("hit")
        slots = batch.rows.req_pool_indices.host.tolist()
        new = [
            _Row(req, slot, len(req.input_ids), req.input_ids[:hit])
            for req, hit, slot in zip(reqs, hits, slots, strict=True)
        ]
        fresh = (
            self._fresh_pages(after, slots, hits)  # prebuilt: every page is the row's own
            if whole
            else _pages_of(batch.out_cache_loc.device, page)  # what the extend allocated
        )
        self._absorb_eviction(after, locks, fresh, needed, free)
        self.locks = locks
        self._check_hits(after, new)
        for row in new:  # in row order: a row publishes what an earlier one did not
            self._publish(after, row, row.req.input_ids, retire=not whole)
        self.pools = after
        self.running = merge(self.running, batch)
        self.rows += new

    @rule(
        pick=st.tuples(st.integers(0, len(HEADERS)), st.lists(st.integers(1, 3), max_size=12)),
        budget=st.integers(1, 12),
        resume=st.booleans(),
    )
    def chunk(self, pick: tuple[int, list[int]], budget: int, resume: bool) -> None:
        """One `mix`: a held chunk goes on (or a new request starts), every running row decodes."""
        if resume and self.held:
            item, row = self.held[0]
            self._mix_one(item, row, item.cached, budget)
        else:
            (req,) = self._new_reqs([pick], 1)
            self._mix_one(req, _Row(req, 0, 0, ()), self._hit(req.input_ids), budget)

    def _mix_refused(self, result: object, admit: Req | Chunked, before: Pools) -> bool:
        # The refusals `mix` makes before it allocates, in its order.
        ids = admit.req.input_ids if isinstance(admit, Chunked) else admit.input_ids
        if not ids:
            self._expect_failure(result, EmptyPrompt, before)
        elif len(ids) > MAX_CONTEXT or (
            self.rows and max(r.seq_len for r in self.rows) >= MAX_CONTEXT
        ):
            self._expect_failure(result, ContextTooLong, before)
        elif isinstance(admit, Req) and not self._free_slots():
            self._expect_failure(result, OutOfReqSlots, before)
        else:
            return False
        return True

    def _mix_one(self, admit: Req | Chunked, row: _Row, start: int, budget: int) -> None:
        # `start`: the tokens the row holds before the chunk (a new request's hit).
        before = self.pools
        tokens = [1 + running.req.rid % 3 for running in self.rows]
        result = mix(self.running, [admit], budget, before, tokens)
        if self._mix_refused(result, admit, before):
            return
        ids = row.req.input_ids
        end = start + min(len(ids) - start, budget)
        locks = dict(self.locks)
        if isinstance(admit, Req):
            self._lock(locks, ids, 0, start)
            row.prefix = ids[:start]
        page = self.page_size
        needed = -(-end // page) - -(-start // page)
        needed += sum(1 for r in self.rows if r.seq_len % page == 0)
        free = self._free_pages()
        if needed > free + self._evictable(locks):
            self._expect_failure(result, OutOfKVTokens, before)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        mixed, after = result.unwrap()
        assert mixed.prefix_lens.tolist()[0] == start and mixed.num_extend_rows == 1
        if isinstance(admit, Req):
            row.slot = int(mixed.rows.req_pool_indices.host[0])
            if start:
                self._seen("hit")
        else:
            self.held.pop(0)
            self.spent.append(admit)
        fresh = _pages_of(mixed.out_cache_loc.device, page)  # what the mix allocated
        self._absorb_eviction(after, locks, fresh, needed, free)
        self.locks = locks
        self._check_hits(after, [row])
        row.seq_len = end
        self._publish(after, row, ids[:end], retire=True)  # the chunk's end
        for decoding in self.rows:
            decoding.seq_len += 1
        settled = finish_mixed(mixed)
        self.pools, self.running = after, settled.running
        if end < len(ids):
            (held,) = settled.held
            assert (held.slot, held.cached) == (row.slot, end)
            self.held.append((held, row))
            self._seen("chunk held")
        else:
            assert not settled.held
            self.rows.append(row)  # finish_mixed puts a finished prompt after the decode rows

    @precondition(lambda self: bool(self.spent))
    @rule(pick=st.integers(0, 5))
    def continue_spent(self, pick: int) -> None:
        """A chunk continued or released already goes on no more: NotHeld, nothing changed."""
        item = self.spent[pick % len(self.spent)]
        if any(row.slot == item.slot for row in self.rows):
            return  # its rid and slot are running now: a BatchConflict, tested elsewhere
        if any(row.slot == item.slot and row.seq_len == item.cached for _, row in self.held):
            return  # another chunk holds the same count in the slot: it cannot tell them apart
        before = self.pools
        result = mix(self.running, [item], 4, before, [1] * len(self.rows))
        self._expect_failure(result, NotHeld, before)

    @precondition(lambda self: bool(self.held))
    @rule()
    def drop_chunk(self) -> None:
        """A held chunk given up: its whole pages stay cached, its lock goes."""
        item, row = self.held.pop(0)
        after = release(item, self.running, self.pools).unwrap()
        self._release_rows(after, [row], [item.req.input_ids])
        self.spent.append(item)
        self.pools = after

    @precondition(lambda self: bool(self.rows))
    @rule()
    def step(self) -> None:
        """Decode every running row: evicts when free pages run short."""
        assert not isinstance(self.running, Idle)
        before = self.pools
        result = decode(self.running, before)
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
        slots = [row.slot for row in self.rows]
        fresh = self._fresh_pages(after, slots, [row.seq_len for row in self.rows])
        self._absorb_eviction(after, self.locks, fresh, needed, free)
        for row in self.rows:
            row.seq_len += 1
        self.pools, self.running = after, filter_batch(batch, list(range(len(self.rows))))

    def _release_rows(self, after: Pools, gone: Sequence[_Row], tokens: Sequence[Prefix]) -> None:
        # The model of a release: each row unlocks its prefix, then caches its whole
        # pages that the cache does not hold yet, in row order.
        table, page = self.pools.table.host, self.page_size
        for row, ids in zip(gone, tokens, strict=True):
            for prefix in self._prefixes(row.prefix, 0, len(row.prefix)):
                self.locks[prefix] -= 1
            full = min(len(ids), row.seq_len) // page * page
            for prefix in self._prefixes(ids, 0, full):
                if prefix not in self.cache:
                    self.cache[prefix] = int(table[row.slot, len(prefix) - page]) // page
        self.locks = {prefix: count for prefix, count in self.locks.items() if count}

    @precondition(lambda self: bool(self.rows))
    @rule(pattern=keep_patterns(), generated=st.booleans())
    def finish(self, pattern: tuple[bool, ...], generated: bool) -> None:
        """Rows leave in any order and go into the cache, with or without their outputs."""
        assert not isinstance(self.running, Idle)
        keep = tile(pattern, len(self.rows))
        gone = [self.rows[index] for index in range(len(self.rows)) if index not in keep]
        kept, left = split(self.running, keep)
        tokens = [self._tokens(row) if generated else row.req.input_ids for row in gone]
        after = release(left, kept, self.pools, tokens).unwrap()
        self._release_rows(after, gone, tokens)
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
        live = {row.slot for row in self._every_row()}
        if not slots or set(slots) & live:
            return
        before = self.pools
        self._expect_failure(release(left, self.running, before), NotOwned, before)

    def _tokens(self, row: _Row) -> Prefix:
        # The prompt, then the tokens its decodes produced (made up: the KV is not modelled).
        extra = row.seq_len - len(row.req.input_ids)
        return row.req.input_ids + tuple(1 + (row.req.rid + step) % 3 for step in range(extra))

    @invariant()
    def cache_matches_model(self) -> None:
        pools = self.pools
        check_batch(self.running, compare_device=True)
        check_pools(pools, [self.running], compare_device=True)
        entries = pools.cache.entries()
        assert {prefix: page for prefix, (page, _) in entries.items()} == self.cache
        assert {prefix: locks for prefix, (_, locks) in entries.items() if locks} == self.locks
        reading = {row.slot: row.prefix for row in self._every_row() if row.prefix}
        assert dict(pools.prefixes) == reading
        for item, row in self.held:
            assert int(pools.slot_tokens[item.slot]) == item.cached == row.seq_len
        assert len(pools.free_pages) + pools.retired.shape[0] == self._free_pages()
        assert pools.num_free_slots == self._free_slots()
        counts = pools.ref_counts()
        assert int(counts.sum()) == len(self.cache) + sum(self.locks.values()) + self._private()


def _pages_of(locs: torch.Tensor, page_size: int) -> set[int]:
    return {loc // page_size for loc in locs.tolist()}


run_machine: Callable[..., None] = run_state_machine_as_test


def test_prefix_cache_machine() -> None:
    """No sequence of transitions on shared pools breaks an invariant or the model."""
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
    expected = {
        "hit",
        "eviction",
        "published",
        "kept private",
        "read the cache's copy",
        "chunk held",
        "OutOfKVTokens",
        "OutOfReqSlots",
        "NotOwned",
        "NotHeld",
    }
    assert expected <= set(_seen), f"never reached: {expected - set(_seen)}"
