"""The cache off computes what plain pools did: a random script, run twice in lockstep.

One script of extends, decodes, splits and releases, mixed chunks (new and
continued), chunks given up and stale chunks runs on pools with the cache
off and on the same pools with it on. Every request's tokens start with a
token no other request has, so the cache-on run never hits: the two runs
must then agree on every row, slot and length, on every failure value, and
on what an allocation may take (free pages off; free plus evictable on).
The cache-off run is also held to counts a plain model predicts: pages in
use are each live row's, rounded up to whole pages, and every failure value
(which comes first, what it asked for, what was there) is predicted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import numpy as np
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
    EmptyExtend,
    EmptyPrompt,
    Filtered,
    Idle,
    NotHeld,
    OutOfKVTokens,
    OutOfReqSlots,
    Pools,
    Req,
    check_batch,
    check_pools,
    decode,
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
)
from tests.strategies import CPU, LONG, keep_patterns, tile

MAX_EXAMPLES: Final = 1000 if LONG else 60
STEP_COUNT: Final = 50 if LONG else 25

# Prompt lengths: mostly fitting, now and then empty or past every context limit.
LENGTHS: Final = st.one_of(st.integers(1, 10), st.integers(1, 10), st.sampled_from([0, 21]))

_seen: dict[str, int] = {}


@attrs.define
class _World:
    pools: Pools
    running: Filtered | Idle = attrs.field(factory=lambda: idle(CPU))
    held: list[Chunked] = attrs.field(factory=list)


def _rows(batch: Any) -> tuple[list[int], list[int], list[int]]:
    rows = batch.rows
    return rows.rids.tolist(), rows.req_pool_indices.host.tolist(), rows.seq_lens.host.tolist()


class Lockstep(RuleBasedStateMachine):
    """The same script on pools with the cache off (`off`) and on (`on`)."""

    def __init__(self) -> None:
        super().__init__()
        self.off = _World(make_pools(1, 1, 0, CPU))
        self.on = _World(make_pools(1, 1, 0, CPU, prefix_cache=True))
        self.page_size = 1
        self.max_context = 1
        self.next_rid = 0
        self.spent: list[tuple[Chunked, Chunked]] = []  # (off, on): continued or released

    # ---- the model of plain pools ---------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _free_pages(self) -> int:
        running, held = self.off.running.rows.seq_lens.host.tolist(), self.off.held
        used = sum(self._pages(n) for n in running) + sum(self._pages(c.cached) for c in held)
        return self.off.pools.num_pages - used

    def _free_slots(self) -> int:
        return self.off.pools.max_reqs - len(self.off.running.rows) - len(self.off.held)

    def _too_long(self) -> ContextTooLong | None:
        rids, _, lens = _rows(self.off.running)
        if not lens or max(lens) < self.max_context:
            return None
        row = int(np.argmax(lens))
        return ContextTooLong(rids[row], lens[row] + 1, self.max_context)

    def _new_req(self, length: int) -> Req:
        self.next_rid += 1
        first = 1000 * self.next_rid  # no other request starts with it: nothing is shared
        return Req(self.next_rid, tuple(range(first, first + length)))

    # ---- running both ---------------------------------------------------------------------

    def _agree(self, results: Sequence[object], expected: object | None) -> bool:
        # Both failed with the same value (the predicted one), or both succeeded.
        off, on = results
        if expected is not None:
            assert off == Failure(expected), f"expected {expected}, got {off}"
            assert on == off, f"the cache on failed otherwise: {on} vs {off}"
            _seen[type(expected).__name__] = _seen.get(type(expected).__name__, 0) + 1
            return False
        assert isinstance(off, Success), f"expected Success, got {off}"
        assert isinstance(on, Success), f"the cache on failed: {on}"
        return True

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(0, 20),
        max_reqs=st.integers(1, 5),
        max_context=st.integers(4, 20),
    )
    def start(self, page_size: int, num_pages: int, max_reqs: int, max_context: int) -> None:
        self.page_size, self.max_context = page_size, max_context
        sizes = (max_reqs, max_context, num_pages * page_size, CPU, page_size)
        self.off = _World(make_pools(*sizes))
        self.on = _World(make_pools(*sizes, prefix_cache=True))

    @rule(lengths=st.one_of(st.lists(LENGTHS, min_size=1, max_size=3), st.just([])))
    def admit(self, lengths: list[int]) -> None:
        """Extend new requests on both; merge them into each running batch."""
        reqs = [self._new_req(length) for length in lengths]
        results = [extend(idle(CPU), reqs, world.pools) for world in (self.off, self.on)]
        expected: object = EmptyExtend() if not reqs else None
        for req in reqs:
            if expected is None and not req.input_ids:
                expected = EmptyPrompt(req.rid, 0, 0)
            elif expected is None and len(req.input_ids) > self.max_context:
                expected = ContextTooLong(req.rid, len(req.input_ids), self.max_context)
        if expected is None and len(reqs) > self._free_slots():
            expected = OutOfReqSlots(len(reqs), self._free_slots())
        needed = sum(self._pages(len(req.input_ids)) for req in reqs)
        if expected is None and needed > self._free_pages():
            expected = OutOfKVTokens(needed, self._free_pages(), self.page_size)
        if not self._agree(results, expected):
            return
        (off, off_pools), (on, on_pools) = (result.unwrap() for result in results)
        assert _rows(off) == _rows(on) and _rows(off)[0] == [req.rid for req in reqs]
        assert off.prefix_lens.tolist() == on.prefix_lens.tolist() == [0] * len(reqs)  # no hit
        assert (
            off.extend_lens.tolist() == on.extend_lens.tolist() == [len(r.input_ids) for r in reqs]
        )
        for world, batch, pools in ((self.off, off, off_pools), (self.on, on, on_pools)):
            world.pools, world.running = pools, merge(world.running, batch)

    @precondition(lambda self: len(self.off.running.rows) > 0)
    @rule()
    def step(self) -> None:
        """Decode every running row on both."""
        worlds = (self.off, self.on)
        results = [decode(world.running, world.pools) for world in worlds]  # type: ignore[arg-type]  # rows: not Idle
        expected: object = self._too_long()
        needed = sum(1 for n in _rows(self.off.running)[2] if n % self.page_size == 0)
        if expected is None and needed > self._free_pages():
            expected = OutOfKVTokens(needed, self._free_pages(), self.page_size)
        if not self._agree(results, expected):
            return
        steps = [result.unwrap() for result in results]
        assert _rows(steps[0].batch) == _rows(steps[1].batch)
        for world, (batch, pools) in zip(worlds, steps, strict=True):
            world.pools = pools
            world.running = filter_batch(batch, list(range(len(batch.rows))))

    @precondition(lambda self: len(self.off.running.rows) > 0)
    @rule(pattern=keep_patterns(), generated=st.booleans())
    def finish(self, pattern: tuple[bool, ...], generated: bool) -> None:
        """Rows leave in any order, released on both (with made-up outputs, or not)."""
        keep = tile(pattern, len(self.off.running.rows))
        for world in (self.off, self.on):
            kept, left = split(world.running, keep)  # type: ignore[arg-type]  # rows: not Idle
            # The prompt, then made-up outputs for every decoded token (or the prompt alone).
            outputs = [
                (*req.input_ids, *((7,) * (n - len(req.input_ids)) if generated else ()))
                for req, n in zip(left.reqs, left.seq_lens.tolist(), strict=True)
            ]
            world.pools = release(left, kept, world.pools, outputs).unwrap()
            world.running = kept

    def _mix_expected(self, admit: Req | None, start: int, end: int) -> object | None:
        # What mix fails with on plain pools: the admitted request, the running rows,
        # slots, then KV for the chunk and one token per running row.
        if admit is not None and not admit.input_ids:
            return EmptyPrompt(admit.rid, 0, 0)
        if admit is not None and len(admit.input_ids) > self.max_context:
            return ContextTooLong(admit.rid, len(admit.input_ids), self.max_context)
        too_long = self._too_long()
        if too_long is not None:
            return too_long
        if admit is not None and not self._free_slots():
            return OutOfReqSlots(1, 0)
        needed = self._pages(end) - self._pages(start)
        needed += sum(1 for n in _rows(self.off.running)[2] if n % self.page_size == 0)
        if needed > self._free_pages():
            return OutOfKVTokens(needed, self._free_pages(), self.page_size)
        return None

    @rule(length=LENGTHS, budget=st.integers(1, 10), resume=st.booleans())
    def chunk(self, length: int, budget: int, resume: bool) -> None:
        """One mix on both: a held chunk goes on (or a new request starts), every row decodes."""
        worlds = (self.off, self.on)
        if resume and self.off.held:
            items: Sequence[Req | Chunked] = [world.held[0] for world in worlds]
            chunked = self.off.held[0]
            new, start, ids = None, chunked.cached, chunked.req.input_ids
        else:
            new = self._new_req(length)
            items, start, ids = [new, new], 0, new.input_ids
        end = start + min(len(ids) - start, budget)
        tokens = [1] * len(self.off.running.rows)
        results = [
            mix(world.running, [item], budget, world.pools, tokens)
            for world, item in zip(worlds, items, strict=True)
        ]
        if not self._agree(results, self._mix_expected(new, start, end)):
            return
        mixed = [result.unwrap() for result in results]
        for field in ("prefix_lens", "extend_lens"):
            values = [getattr(step.batch, field).tolist() for step in mixed]
            assert values[0] == values[1], f"{field}: {values}"
        assert mixed[0].batch.prefix_lens.tolist()[0] == start  # nothing read from the cache
        assert _rows(mixed[0].batch) == _rows(mixed[1].batch)
        assert mixed[0].batch.partial == mixed[1].batch.partial == ((0,) if end < len(ids) else ())
        if new is None:
            self.spent.append((self.off.held.pop(0), self.on.held.pop(0)))
        for world, (batch, pools) in zip(worlds, mixed, strict=True):
            settled = finish_mixed(batch)
            world.pools, world.running = pools, settled.running
            world.held += settled.held
        assert [(c.slot, c.cached) for c in self.off.held] == [
            (c.slot, c.cached) for c in self.on.held
        ]
        name = "chunk held" if end < len(ids) else "chunk done"
        _seen[name] = _seen.get(name, 0) + 1

    @precondition(lambda self: bool(self.off.held))
    @rule()
    def drop_chunk(self) -> None:
        """A held chunk given up on both."""
        pair = []
        for world in (self.off, self.on):
            item = world.held.pop(0)
            world.pools = release(item, world.running, world.pools).unwrap()
            pair.append(item)
        self.spent.append((pair[0], pair[1]))

    @precondition(lambda self: bool(self.spent))
    @rule(pick=st.integers(0, 5))
    def stale_chunk(self, pick: int) -> None:
        """A chunk continued or given up already: NotHeld on both, by the same value."""
        off_item, on_item = self.spent[pick % len(self.spent)]
        if off_item.slot in _rows(self.off.running)[1]:
            return  # its slot runs now: a BatchConflict, raised, tested elsewhere
        if any((c.slot, c.cached) == (off_item.slot, off_item.cached) for c in self.off.held):
            return  # another chunk holds the same count in the slot: indistinguishable
        tokens = [1] * len(self.off.running.rows)
        results = [
            mix(world.running, [item], 4, world.pools, tokens)
            for world, item in ((self.off, off_item), (self.on, on_item))
        ]
        owned = int(self.off.pools.slot_tokens[off_item.slot])
        expected = NotHeld(off_item.req.rid, off_item.slot, off_item.cached, owned)
        self._agree(results, expected)

    # ---- after every step -----------------------------------------------------------------

    @invariant()
    def both_agree_with_plain_pools(self) -> None:
        off, on = self.off.pools, self.on.pools
        for world in (self.off, self.on):
            check_batch(world.running, compare_device=True)
            check_pools(world.pools, [world.running], compare_device=True)
        assert _rows(self.off.running) == _rows(self.on.running)
        # Off: nothing cached, read or published; every page free or one row's.
        assert off.cache.num_pages == 0 and dict(off.prefixes) == {}
        assert not off.prefix_lens.any() and int(off.ref_counts().max(initial=0)) <= 1
        assert flush(off) is off
        assert len(off.free_pages) == self._free_pages()
        assert off.num_free_slots == self._free_slots()
        # On: the same slots, each holding the same count; what an allocation may take agrees.
        assert off.free_slots.tolist() == on.free_slots.tolist()
        assert off.slot_tokens.tolist() == on.slot_tokens.tolist()
        assert off.num_free_tokens == off.num_available_tokens == on.num_available_tokens


run_machine: Callable[..., None] = run_state_machine_as_test


def test_the_cache_off_and_unshared_runs_agree_with_plain_pools() -> None:
    """No script tells the cache-off run from plain pools, or from the cache on unshared."""
    _seen.clear()
    run_machine(
        Lockstep,
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=STEP_COUNT,
            deadline=None,
            derandomize=not LONG,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    print(f"\none pools lockstep: {_seen}")
    expected = {
        "EmptyPrompt",
        "ContextTooLong",
        "OutOfReqSlots",
        "OutOfKVTokens",
        "NotHeld",
        "chunk held",
        "chunk done",
    }
    assert expected <= set(_seen), f"never reached: {expected - set(_seen)}"
