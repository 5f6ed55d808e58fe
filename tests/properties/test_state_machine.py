"""A model-based state machine: random runs of the public transitions against plain Python.

The machine keeps one running batch and the pools, plus requests held out
of the batch with their memory (chunked prefill between chunks) and rows
filtered out but not yet released. A plain-Python model predicts every
outcome: which rows, which slots (slots are handed out from the front of
the free list, freed ones go to its back), which lengths, how many free
slots and pages, and which `Failure` comes first. After every step it
checks every invariant of docs/design.md (device compared), the record against
the model, that KV locations already written never move, and that a failed
or successful transition left its inputs unchanged.

CI runs a bounded budget; `BATCHSTATE_LONG=1` runs the long profile.
Run with `-s` to see how many steps ran.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Final, cast

import attrs
import pytest
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
    Batch,
    Chunked,
    ContextTooLong,
    Decoding,
    Departed,
    EmptyExtend,
    EmptyPrompt,
    Extended,
    Filtered,
    Idle,
    Mixed,
    NoChunkBudget,
    NotHeld,
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    Pools,
    Req,
    SlotHolder,
    StalePools,
    StillRunning,
    admit_prefilled,
    check_batch,
    check_leaks,
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
)
from tests.strategies import (
    CPU,
    FAST,
    LONG,
    PoolShape,
    assert_unchanged,
    keep_patterns,
    pool_shapes,
    prompt_lengths,
    snapshot,
    tile,
)

MAX_EXAMPLES: Final = 5000 if LONG else 40 if FAST else 200
STEP_COUNT: Final = 100 if LONG else 40

_counts: dict[str, int] = {"examples": 0, "steps": 0, "continued": 0, "mixed": 0, "chunks": 0}
_failures: dict[str, int] = {}  # Failure type -> how often the machine predicted and saw it


@attrs.define
class _Row:
    """The model of one request that owns memory: its request, slot, KV length, generation."""

    req: Req
    slot: int
    seq_len: int
    gen: int = 0  # the generation it holds its slot at: read from the record that admits it


def _make_ids(rid: int, length: int) -> tuple[int, ...]:
    return tuple(1000 * rid + position for position in range(length))


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _pools_but_table(pools: Pools) -> tuple[object, ...]:
    # A successful transition writes the table in cells the old pools treat as
    # unused (see TokenTable's NOTE), so only the rest of them must not move.
    return ((pools.page_size, pools.num_pages, pools.free_slots, pools.free_pages,
                     pools.slot_tokens))  # fmt: skip


class BatchMachine(RuleBasedStateMachine):
    """The running batch, the pools, held and finished requests, and their model."""

    def __init__(self) -> None:
        super().__init__()
        self.shape = PoolShape(1, 1, 0, 1)
        self.pools = make_pools(1, 1, 0, CPU)
        self.running: Batch = idle(CPU)
        self.model_running: list[_Row] = []
        self.model_free_slots: list[int] = []
        self.held: list[_Row] = []  # out of the batch, memory kept: continued later
        self.finished: list[tuple[Filtered, list[_Row]]] = []  # filtered out, not released
        # Released records, for doubles, with their rows (slot, length) as they were then.
        self.released: list[tuple[Departed | Filtered, list[_Row]]] = []
        self.spent: list[Chunked] = []  # chunks already continued: stale, never held again
        self.next_rid = 0
        self.last_gen = 0  # the newest generation handed out
        self.old_pools: list[Pools] = []  # pools values seen before, for reuse
        self.locs: dict[int, list[int]] = {}  # rid -> KV locations seen so far

    # ---- helpers ------------------------------------------------------------------------

    def _owners(self) -> list[_Row]:
        return self.model_running + self.held + [row for _, rows in self.finished for row in rows]

    def _model_free_pages(self) -> int:
        owned = sum(_pages(row.seq_len, self.shape.page_size) for row in self._owners())
        return self.shape.num_kv_tokens // self.shape.page_size - owned

    def _fresh_rid(self) -> int:
        self.next_rid += 1
        return self.next_rid

    def _spend(self, rows: Sequence[_Row]) -> None:
        # Rows just continued from a held chunk: their chunks, as they were, go stale.
        self.spent += [Chunked(row.req, row.slot, row.seq_len, gen=row.gen) for row in rows]
        del self.spent[:-8]  # a few suffice; older ones add nothing

    def _assert_failed(
        self, result: object, expected: type, before: object, value: object = None
    ) -> None:
        assert isinstance(result, Failure), f"expected Failure({expected.__name__}), got {result}"
        failure = result.failure()
        assert type(failure) is expected, f"expected {expected.__name__}, got {result}"
        assert value is None or failure == value, f"expected {value!r}, got {failure!r}"
        _failures[expected.__name__] = _failures.get(expected.__name__, 0) + 1
        # The message carries the facts needed to act on it: every field's value.
        message = str(failure)
        for field in attrs.fields(cast("type[attrs.AttrsInstance]", type(failure))):
            if field.name in {"stale", "other_tokens"}:
                continue  # flags: the message says "handed out again" or "was swapped" instead
            shown = getattr(failure, field.name)
            shown = list(shown) if isinstance(shown, tuple) else shown
            assert str(shown) in message, f"{message!r} does not say {field.name}={shown}"
        assert_unchanged(before, (self.pools, self.running), "pools and batch after a Failure")

    def _running_as_base(self) -> Decoding | Filtered | Idle:
        # merge appends to Decoding, Filtered or Idle; an Extended running batch goes through Idle.
        running = self.running
        if isinstance(running, Extended):
            return merge(idle(CPU), running)
        return running

    def _predict_admit(
        self, num_new: int, lengths: Sequence[int], prefixes: Sequence[int]
    ) -> type | None:
        # The model: the first failure, in the order the transition checks them.
        shape = self.shape
        if not lengths:
            return EmptyExtend
        for length, prefix in zip(lengths, prefixes, strict=True):
            if length <= prefix:
                return EmptyPrompt
            if length > shape.max_context_len:
                return ContextTooLong
        if num_new > len(self.model_free_slots):
            return OutOfReqSlots
        pages = sum(
            _pages(length, shape.page_size) - _pages(prefix, shape.page_size)
            for length, prefix in zip(lengths, prefixes, strict=True)
        )
        return OutOfKVTokens if pages > self._model_free_pages() else None

    # ---- rules --------------------------------------------------------------------------

    @initialize(shape=pool_shapes())
    def start(self, shape: PoolShape) -> None:
        """Fresh pools of a drawn shape; an Idle batch."""
        self.shape = shape
        self.pools = make_pools(*shape[:3], CPU, shape.page_size)
        self.model_free_slots = list(range(1, shape.max_reqs + 1))
        _counts["examples"] += 1

    @rule(
        data=st.data(),
        num_new=st.integers(0, 4),
        continue_picks=st.lists(st.integers(0, 7), max_size=3, unique=True),
        via_prebuilt=st.booleans(),
        hold=keep_patterns(),
        replace_idle=st.booleans(),
    )
    def admit(
        self,
        *,
        data: st.DataObject,
        num_new: int,
        continue_picks: list[int],
        via_prebuilt: bool,
        hold: tuple[bool, ...],
        replace_idle: bool,
    ) -> None:
        """Extend (or prebuild) new requests and held chunks; merge them in or hold some out."""
        shape = self.shape
        # Chunks with room to grow: one at the table's width can only fail, and would
        # make every admission it joins fail with it.
        room = [row for row in self.held if row.seq_len < shape.max_context_len]
        picks = sorted({pick % len(room) for pick in continue_picks}) if room else []
        continued_rows = [] if via_prebuilt else [room[pick] for pick in picks]
        items: list[Req | Chunked] = []
        new_lens: list[int] = []
        for _ in range(num_new):
            length = data.draw(prompt_lengths(shape.max_context_len), label="prompt")
            rid = self._fresh_rid()
            items.append(Req(rid, _make_ids(rid, length)))
            new_lens.append(length)
        continued_lens: list[int] = []
        for row in continued_rows:
            length = data.draw(prompt_lengths(shape.max_context_len, row.seq_len), label="continue")
            req = Req(row.req.rid, _make_ids(row.req.rid, length))
            items.append(Chunked(req, row.slot, row.seq_len, gen=row.gen))
            continued_lens.append(length)
        before = snapshot((self.pools, self.running))
        before_pools = snapshot(_pools_but_table(self.pools))
        reqs_only = [item for item in items if isinstance(item, Req)]
        result = (
            admit_prefilled(idle(CPU), reqs_only, self.pools)
            if via_prebuilt
            else extend(idle(CPU), items, self.pools)
        )

        prefixes = [0] * num_new + [row.seq_len for row in continued_rows]
        lengths = new_lens + continued_lens
        expected = self._predict_admit(num_new, lengths, prefixes)
        if expected is not None:
            self._assert_failed(result, expected, before)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        batch, pools = result.unwrap()
        assert_unchanged(before_pools, _pools_but_table(self.pools), "old pools after Success")

        new_slots = self.model_free_slots[:num_new]
        self.model_free_slots = self.model_free_slots[num_new:]
        rows = [
            _Row(item.req if isinstance(item, Chunked) else item, slot, length)
            for item, slot, length in zip(
                items, new_slots + [row.slot for row in continued_rows], lengths, strict=True
            )
        ]
        self._take_gens(rows, batch.rows.gens.tolist(), num_new)
        self.held = [row for row in self.held if row not in continued_rows]
        self._spend(continued_rows)
        _counts["continued"] += len(continued_rows)
        self._assert_rows(batch, rows)
        if isinstance(batch, Extended):
            self._assert_extended(batch, pools, rows, prefixes)
        check_pools(pools, [batch, *self._other_batches()], compare_device=True)
        self.pools = pools

        held_positions = tile(hold, len(rows)) if len(hold) > 1 else []
        going = [row for row in range(len(rows)) if row not in held_positions]
        self.held += [rows[row] for row in held_positions]
        incoming = filter_batch(batch, going)
        if replace_idle and isinstance(self.running, Idle) and len(going) == len(rows):
            self.running = batch  # run the Extended (or prebuilt Filtered) as it is
        else:
            self.running = merge(self._running_as_base(), incoming)
        self.model_running += [rows[row] for row in going]

    @rule()
    def step_decode(self) -> None:
        """Decode the running batch: one more token per row, or a Failure that changes nothing."""
        running = self.running
        if isinstance(running, Idle):
            return
        shape = self.shape
        before = snapshot((self.pools, self.running))
        before_batch = snapshot(running)
        before_pools = snapshot(_pools_but_table(self.pools))
        result = decode(running, self.pools)
        lens = [row.seq_len for row in self.model_running]
        if max(lens, default=0) >= shape.max_context_len:
            self._assert_failed(result, ContextTooLong, before)
            return
        pages = sum(1 for length in lens if length % shape.page_size == 0)
        if pages > self._model_free_pages():
            self._assert_failed(result, OutOfKVTokens, before)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        batch, pools = result.unwrap()
        assert_unchanged(before_batch, running, "the decoded batch")
        assert_unchanged(before_pools, _pools_but_table(self.pools), "old pools after decode")
        for row in self.model_running:
            row.seq_len += 1
        self._assert_rows(batch, self.model_running)
        locs = batch.out_cache_loc.device.tolist()
        table = pools.table.host
        assert locs == [int(table[row.slot, row.seq_len - 1]) for row in self.model_running]
        self.pools, self.running = pools, batch

    @rule(
        data=st.data(),
        num_new=st.integers(0, 3),
        continue_picks=st.lists(st.integers(0, 7), max_size=2, unique=True),
        budget=st.sampled_from([0, 1, 3, 8, 16, 40]),
        with_running=st.booleans(),
    )
    def mixed_step(
        self,
        *,
        data: st.DataObject,
        num_new: int,
        continue_picks: list[int],
        budget: int,
        with_running: bool,
    ) -> None:
        """Mix chunks of held and new requests (under a budget) with running rows; finish_mixed."""
        shape = self.shape
        running = self._running_as_base()
        if isinstance(running, Decoding):
            running = filter_batch(running, list(range(len(self.model_running))))
        base = running if with_running else idle(CPU)
        decode_rows = self.model_running if with_running else []
        picks = sorted({pick % len(self.held) for pick in continue_picks}) if self.held else []
        admit: list[Req | Chunked] = []
        wanted: list[tuple[_Row | None, Req]] = []
        for pick in picks:
            row = self.held[pick]
            length = data.draw(prompt_lengths(shape.max_context_len, row.seq_len), label="continue")
            req = Req(row.req.rid, _make_ids(row.req.rid, length))
            admit.append(Chunked(req, row.slot, row.seq_len, gen=row.gen))
            wanted.append((row, req))
        for _ in range(num_new):
            length = data.draw(prompt_lengths(shape.max_context_len), label="prompt")
            rid = self._fresh_rid()
            req = Req(rid, _make_ids(rid, length))
            admit.append(req)
            wanted.append((None, req))
        before = snapshot((self.pools, self.running))
        result = mix(base, admit, budget, self.pools, [1] * len(decode_rows))
        expected = self._predict_mix(wanted, budget, decode_rows)
        if expected is not None:
            if expected is NoChunkBudget or expected is EmptyExtend:
                self._assert_failed(result, expected, before)
            else:  # the first of several possible failures: its type, and nothing changed
                assert isinstance(result, Failure), f"expected a Failure, got {result}"
                assert_unchanged(before, (self.pools, self.running), "inputs after a Failure")
            return
        if not isinstance(result, Success):
            assert_unchanged(before, (self.pools, self.running), "inputs after a Failure")
            return  # the model's page count is an upper bound when pages are shared
        mixed, pools = result.unwrap()
        self._apply_mix(mixed, pools, wanted, decode_rows, running if not with_running else None)

    def _apply_mix(
        self,
        mixed: Mixed,
        pools: Pools,
        wanted: list[tuple[_Row | None, Req]],
        decode_rows: list[_Row],
        parked: Decoding | Filtered | Idle | None,
    ) -> None:
        # The model after a successful mix and finish_mixed: slots, lengths, held chunks, rows.
        settled, held = finish_mixed(mixed)
        extend_rows: list[_Row] = []
        slots = iter(self.model_free_slots)
        extend_lens = mixed.rows.seq_lens.host.tolist()[: mixed.num_extend_rows]
        for (row, req), seq_len in zip(wanted, extend_lens, strict=False):
            slot = row.slot if row is not None else next(slots)
            extend_rows.append(_Row(req, slot, seq_len, row.gen if row is not None else 0))
        # Continued chunks come first in `admit`, then new requests: the new rows' slots
        # were all allocated by this mix.
        num_continued = sum(row is not None for row, _ in wanted[: len(extend_rows)])
        gens = mixed.rows.gens.tolist()[: len(extend_rows)]
        self._take_gens(
            extend_rows[num_continued:] + extend_rows[:num_continued],
            gens[num_continued:] + gens[:num_continued],
            len(extend_rows) - num_continued,
        )
        taken = len(extend_rows)
        self.model_free_slots = self.model_free_slots[sum(r is None for r, _ in wanted[:taken]) :]
        done_held = [row for row, _ in wanted[:taken] if row is not None]
        self.held = [row for row in self.held if row not in done_held]
        self._spend(done_held)
        for row in decode_rows:
            row.seq_len += 1
        cut = [row for row in extend_rows if row.seq_len < len(row.req.input_ids)]
        whole = [row for row in extend_rows if row not in cut]
        assert [(c.req.rid, c.slot, c.cached, c.gen) for c in held] == [
            (row.req.rid, row.slot, row.seq_len, row.gen) for row in cut
        ]
        self.pools = pools
        self.held += cut
        if parked is None:
            self.running, self.model_running = settled, decode_rows + whole
        else:
            self.running = merge(parked, settled)
            self.model_running = self.model_running + whole
        self._assert_rows(self.running, self.model_running)
        _counts["mixed"] += 1
        _counts["chunks"] += len(cut)

    def _predict_mix(
        self, wanted: list[tuple[_Row | None, Req]], budget: int, decode_rows: list[_Row]
    ) -> type | None:
        # The failures the model can name exactly; None: expect Success (or a pool Failure).
        shape = self.shape
        if budget < 1:
            return NoChunkBudget
        if not wanted and not decode_rows:
            return EmptyExtend
        for row, req in wanted:
            cached = row.seq_len if row is not None else 0
            if len(req.input_ids) <= cached or len(req.input_ids) > shape.max_context_len:
                return EmptyPrompt
        if any(row.seq_len >= shape.max_context_len for row in decode_rows):
            return ContextTooLong
        return None

    @precondition(lambda self: bool(self.spent))
    @rule(pick=st.integers(0, 7))
    def continue_spent(self, pick: int) -> None:
        """Extend a chunk already continued: NotHeld, naming what its slot holds now.

        A slot handed out again and holding exactly the chunk's count is
        told apart by its generation: `NotHeld(..., stale=True)`.
        """
        chunk = self.spent[pick % len(self.spent)]
        owned = {row.slot: row.seq_len for row in self._owners()}.get(chunk.slot, 0)
        more = Req(chunk.req.rid, _make_ids(chunk.req.rid, chunk.cached + 1))
        before = snapshot((self.pools, self.running))
        result = extend(idle(CPU), [attrs.evolve(chunk, req=more)], self.pools)
        stale = owned == chunk.cached
        expected = NotHeld(chunk.req.rid, chunk.slot, chunk.cached, owned, stale=stale)
        if stale:
            _failures["reused at the same length"] = (
                _failures.get("reused at the same length", 0) + 1
            )
        self._assert_failed(result, NotHeld, before, expected)

    @rule(pattern=keep_patterns(), destination=st.sampled_from(["release", "later", "hold"]))
    def finish(self, pattern: tuple[bool, ...], destination: str) -> None:
        """Filter rows out (none, all, staggered, random); release them now, later, or hold them."""
        running = self.running
        if isinstance(running, Idle):
            return
        before = snapshot(running)
        keep = tile(pattern, len(self.model_running))
        gone = [row for row in range(len(self.model_running)) if row not in keep]
        kept_batch, left = filter_batch(running, keep), filter_batch(running, gone)
        assert_unchanged(before, running, "the filtered batch")
        kept_rows = [self.model_running[row] for row in keep]
        left_rows = [self.model_running[row] for row in gone]
        self._assert_rows(kept_batch, kept_rows)
        self._assert_rows(left, left_rows)
        self.running, self.model_running = kept_batch, kept_rows
        if destination == "hold":
            self.held += left_rows
        elif destination == "later":
            self.finished.append((left, left_rows))
        else:
            self._release(left, left_rows)

    @precondition(lambda self: bool(self.finished))
    @rule(pick=st.integers(0, 7))
    def release_later(self, pick: int) -> None:
        """Release rows filtered out earlier."""
        left, rows = self.finished.pop(pick % len(self.finished))
        self._release(left, rows)

    @precondition(lambda self: bool(self.released))
    @rule(pick=st.integers(0, 7))
    def release_twice(self, pick: int) -> None:
        """Release a record again: StillRunning or NotOwned, never a Success.

        A slot handed out again, even holding exactly the length the stale
        record says, is at another generation: NotOwned names every slot.
        """
        left, rows = self.released[pick % len(self.released)]
        before = snapshot((self.pools, self.running))
        result = release(left, self.running, self.pools)
        running_slots = [row.slot for row in self.model_running]
        still = tuple(row.slot for row in rows if row.slot in running_slots)
        if still:
            self._assert_failed(result, StillRunning, before, StillRunning(still))
            return
        if not rows:
            assert result == Success(self.pools), f"nothing to release, got {result}"
            return
        owned = {row.slot for row in self._owners()}
        free = tuple(row.slot for row in rows if row.slot not in owned)
        # Every slot that is owned again is at another generation than the record's.
        expected = NotOwned(free or tuple(row.slot for row in rows))
        if not free:
            _failures["reused slots"] = _failures.get("reused slots", 0) + 1
        self._assert_failed(result, NotOwned, before, expected)

    @precondition(lambda self: bool(self.model_running))
    @rule(pattern=keep_patterns())
    def release_running(self, pattern: tuple[bool, ...]) -> None:
        """Release rows that are still in the batch: StillRunning, nothing freed."""
        rows = tile(pattern, len(self.model_running)) or [0]
        before = snapshot((self.pools, self.running))
        assert not isinstance(self.running, Idle)
        result = release(filter_batch(self.running, rows), self.running, self.pools)
        self._assert_failed(result, StillRunning, before)

    @rule(which=st.sampled_from(["empty incoming", "into idle", "idle reset"]))
    def merge_empty(self, which: str) -> None:
        """Merge with an empty side: the other side's rows, unchanged."""
        running = self.running
        if isinstance(running, Idle):
            return
        before = snapshot(running)
        if which == "empty incoming":
            merged = merge(self._running_as_base(), filter_batch(running, []))
        elif which == "into idle" and not isinstance(running, Decoding):
            merged = merge(idle(CPU), running)
        elif which == "idle reset" and not self.model_running:
            self.running = idle(CPU)
            return
        else:
            return
        assert_unchanged(before, running, "a batch merged with an empty one")
        self._assert_rows(merged, self.model_running)
        self.running = merged

    @precondition(lambda self: any(not pools.is_newest for pools in self.old_pools))
    @rule(pick=st.integers(0, 7), which=st.sampled_from(["decode", "extend", "release"]))
    def reuse_old_pools(self, pick: int, which: str) -> None:
        """Hand a pools value from before a later success to a transition: StalePools."""
        stale = [pools for pools in self.old_pools if not pools.is_newest]
        old = stale[pick % len(stale)]
        before = snapshot((self.pools, self.running))
        with pytest.raises(StalePools):
            if which == "decode" and not isinstance(self.running, Idle):
                decode(self.running, old)
            elif which == "release" and not isinstance(self.running, Idle):
                release(filter_batch(self.running, []), self.running, old)
            else:
                extend(idle(CPU), [Req(self._fresh_rid(), (1,))], old)
        assert_unchanged(before, (self.pools, self.running), "pools and batch after StalePools")
        _failures["StalePools"] = _failures.get("StalePools", 0) + 1

    @rule()
    def deepcopy_mid_run(self) -> None:
        """Deep-copy the batch and pools together: read-only mirrors, a lineage of its own."""
        batch, pools = copy.deepcopy((self.running, self.pools))
        rows = batch.rows
        hosts = (rows.rids, rows.gens, rows.req_pool_indices.host, rows.seq_lens.host)
        assert not any(host.flags.writeable for host in hosts), "a copy's mirror is writable"
        assert not pools.slot_gens.flags.writeable and not pools.table.host.flags.writeable
        check_batch(batch, compare_device=True)
        check_pools(pools, [batch], compare_device=True)
        if not isinstance(batch, Idle) and rows.max_seq_len < self.shape.max_context_len:
            decode(batch, pools)  # the copy goes on, or fails, on its own lineage
        assert self.pools.is_newest, "a copy's transition made the original stale"

    # ---- checks -------------------------------------------------------------------------

    def _release(self, left: Departed | Filtered, rows: list[_Row]) -> None:
        before = snapshot(_pools_but_table(self.pools))
        table_before = snapshot(self.pools.table)
        result = release(left, self.running, self.pools)
        assert isinstance(result, Success), f"expected Success, got {result}"
        assert_unchanged(before, _pools_but_table(self.pools), "pools after release")
        assert_unchanged(
            table_before, result.unwrap().table, "the table, which release must not write"
        )
        self.pools = result.unwrap()
        self.model_free_slots += [row.slot for row in rows]
        self.released.append((left, [attrs.evolve(row) for row in rows]))
        for row in rows:
            self.locs.pop(row.req.rid, None)

    def _take_gens(self, rows: Sequence[_Row], gens: Sequence[int], num_new: int) -> None:
        # The first `num_new` rows got their slots just now: one generation, newer than
        # any before; the rest keep theirs.
        fresh = list(gens[:num_new])
        if fresh:
            assert len(set(fresh)) == 1 and fresh[0] > self.last_gen, f"generations {fresh}"
            self.last_gen = fresh[0]
        for row, gen in zip(rows, gens, strict=True):
            assert row.gen in {0, gen}, f"request {row.req.rid} changed generation"
            row.gen = gen

    def _other_batches(self) -> list[Batch]:
        return [self.running, *(left for left, _ in self.finished)]

    def _assert_rows(self, batch: Batch, rows: Sequence[_Row]) -> None:
        got = batch.rows
        assert got.reqs == tuple(row.req for row in rows)
        assert got.rids.tolist() == [row.req.rid for row in rows]
        slots = [row.slot for row in rows]
        assert got.req_pool_indices.host.tolist() == slots
        assert got.req_pool_indices.device.tolist() == slots
        assert got.gens.tolist() == [row.gen for row in rows]
        lens = [row.seq_len for row in rows]
        assert got.seq_lens.host.tolist() == lens
        assert got.seq_lens.device.tolist() == lens
        assert got.orig_seq_lens.device.tolist() == lens
        assert got.seq_lens_sum == sum(lens)
        assert got.max_seq_len == max(lens, default=0)
        check_batch(batch, compare_device=True)

    def _assert_extended(
        self, batch: Extended, pools: Pools, rows: Sequence[_Row], prefixes: Sequence[int]
    ) -> None:
        assert batch.prefix_lens.tolist() == list(prefixes)
        assert batch.extend_lens.tolist() == list(
            row.seq_len - prefix for row, prefix in zip(rows, prefixes, strict=True)
        )
        ids = [i for row, p in zip(rows, prefixes, strict=True) for i in row.req.input_ids[p:]]
        assert batch.input_ids.device.tolist() == ids
        table = pools.table.device
        locs = [
            int(table[row.slot, position])
            for row, prefix in zip(rows, prefixes, strict=True)
            for position in range(prefix, row.seq_len)
        ]
        assert batch.out_cache_loc.device.tolist() == locs

    def _holders(self) -> list[SlotHolder]:
        # Every live record that holds memory: the leak check's view of the machine.
        chunks = [Chunked(row.req, row.slot, row.seq_len, gen=row.gen) for row in self.held]
        return [*self._other_batches(), *chunks]

    @invariant()
    def holds_everything(self) -> None:
        """Every invariant, the model's free counts, and KV locations that never move."""
        _counts["steps"] += 1
        self.old_pools = [*self.old_pools[-3:], self.pools]
        check_batch(self.running, compare_device=True)
        check_pools(self.pools, self._other_batches(), compare_device=True)
        # Every owned slot is held by exactly one live record: the batch, a finished
        # record not yet released, or a request held between chunks.
        check_leaks(self.pools, self._holders())
        self._assert_rows(self.running, self.model_running)
        pools = self.pools
        assert pools.num_free_slots == len(self.model_free_slots)
        assert pools.free_slots.tolist() == self.model_free_slots
        assert pools.num_free_tokens == self._model_free_pages() * self.shape.page_size
        owners = self._owners()
        every_slot = sorted([row.slot for row in owners] + self.model_free_slots)
        assert every_slot == list(range(1, self.shape.max_reqs + 1)), "a slot owned twice or lost"
        for row in owners:
            assert int(pools.slot_tokens[row.slot]) == row.seq_len
            locs = pools.table.host[row.slot, : row.seq_len].tolist()
            seen = self.locs.get(row.req.rid, [])
            assert locs[: len(seen)] == seen, f"request {row.req.rid}: KV locations moved"
            self.locs[row.req.rid] = locs


# Older hypothesis releases leave this unannotated; a typed alias works with both.
run_machine: Callable[..., None] = run_state_machine_as_test


def run_timed(machine: type[RuleBasedStateMachine], max_examples: int) -> float:
    """Run `machine` with the profile's step budget; the seconds it took.

    The CI profile is derandomized: the same sequences every run, so the
    checks that every failure was reached cannot fail by chance. The long
    profile draws new ones each run.
    """
    started = time.perf_counter()
    run_machine(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=STEP_COUNT,
            deadline=None,
            derandomize=not LONG,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    return time.perf_counter() - started


def test_state_machine() -> None:
    """No sequence of public transitions breaks an invariant or disagrees with the model."""
    _counts.update(examples=0, steps=0, continued=0, mixed=0, chunks=0)
    _failures.clear()
    elapsed = run_timed(BatchMachine, MAX_EXAMPLES)
    print(
        f"\nstate machine: {_counts['examples']} runs, {_counts['steps']} checked states,"
        f" {_counts['continued']} chunked-prefill continuations, {_counts['mixed']} mixed steps"
        f" ({_counts['chunks']} chunks held)"
        f" in {elapsed:.1f} s ({'long' if LONG else 'CI'} profile); failures seen: {_failures}"
    )
    assert _counts["steps"] > _counts["examples"], "the machine ran no steps"
    if FAST:
        return  # the mutation profile's budget is too small to reach every failure
    # The budget must reach full pools and every admission failure, or it proves little.
    expected = {
        "OutOfReqSlots",
        "OutOfKVTokens",
        "ContextTooLong",
        "EmptyPrompt",
        "StillRunning",
        "NotHeld",
    }
    assert expected <= set(_failures), f"never reached: {expected - set(_failures)}"
    assert _counts["continued"], "no chunked-prefill continuation was ever admitted"
    assert _counts["mixed"] and _counts["chunks"], "no mixed step or held chunk was ever made"
