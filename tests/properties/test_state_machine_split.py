"""The state machine of test_state_machine.py, with split, release of a `Departed`, verify and sync.

`SpeculativeMachine` runs every rule of `BatchMachine` and adds:

- `split_off`: `split` the running batch; release the `Departed` now, later
  (against whatever batch then runs), or never (held);
- `release_departed_running`: a `Departed` naming rows that still run, built
  from another split of the same batch or edited with `attrs.evolve`:
  `Failure(StillRunning)`, nothing freed;
- `speculate`: `verify` a decode batch with drawn draft lengths, then `sync`
  it with drawn accepted counts (after, sometimes, a count out of range).

The plain-Python model predicts each outcome, and every input (records and
pools) is checked unchanged after each call, failed or not. Host values are
compared through `.tolist()` and `int()` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule
from returns.result import Failure, Success

from batchstate import (
    ContextTooLong,
    Decoding,
    Departed,
    DraftError,
    Idle,
    NotOwned,
    OutOfKVTokens,
    Pools,
    SlotHolder,
    StalePools,
    StillRunning,
    Verifying,
    check_batch,
    check_pools,
    idle,
    release,
    split,
    sync,
    verify,
)
from tests.properties.test_state_machine import (
    BatchMachine,
    _counts,
    _failures,
    _pages,
    _Row,
    run_timed,
)
from tests.strategies import (
    FAST,
    LONG,
    PoolShape,
    assert_unchanged,
    keep_patterns,
    pool_shapes,
    snapshot,
    tile,
)

MAX_EXAMPLES: Final = 3000 if LONG else 40 if FAST else 200


def _host_state(pools: Pools) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Every host value of `pools` a transition must not change, as Python lists."""
    return (
        pools.free_slots.tolist(),
        pools.free_pages.tolist(),
        pools.slot_tokens.tolist(),
        pools.table.host.tolist(),
    )


def _but_table(pools: Pools) -> tuple[list[int], list[int], list[int]]:
    # A transition that allocates writes the table in cells the old pools treat as unused.
    return pools.free_slots.tolist(), pools.free_pages.tolist(), pools.slot_tokens.tolist()


@st.composite
def _roomy_shapes(draw: st.DrawFn) -> PoolShape:
    # Room for several verify windows before a row hits the table's width.
    page_size = draw(st.sampled_from([1, 4, 16]))
    num_pages = draw(st.integers(4, 256 // page_size))
    return PoolShape(draw(st.integers(1, 6)), draw(st.integers(24, 64)), num_pages * page_size,
                     page_size)  # fmt: skip


class SpeculativeMachine(BatchMachine):
    """`BatchMachine` plus split, release of a `Departed`, verify and sync."""

    def __init__(self) -> None:
        super().__init__()
        self.departed: list[tuple[Departed, list[_Row]]] = []  # split off, not yet released

    @initialize(shape=st.one_of(pool_shapes(), _roomy_shapes()))
    def start(self, shape: PoolShape) -> None:
        """Tight pools (failures) or roomy ones (long runs of verify windows)."""
        super().start(shape)

    def _owners(self) -> list[_Row]:
        return super()._owners() + [row for _, rows in self.departed for row in rows]

    def _holders(self) -> list[SlotHolder]:
        return [*super()._holders(), *(left for left, _ in self.departed)]

    def _assert_departed(self, left: Departed, rows: Sequence[_Row]) -> None:
        assert left.reqs == tuple(row.req for row in rows)
        assert left.slots.tolist() == [row.slot for row in rows]
        assert left.seq_lens.tolist() == [row.seq_len for row in rows]

    # ---- split and release of a Departed ------------------------------------------------

    @rule(pattern=keep_patterns(), destination=st.sampled_from(["release", "later", "hold"]))
    def split_off(self, pattern: tuple[bool, ...], destination: str) -> None:
        """Split rows off; release the `Departed` now (against the kept rows), later, or never."""
        running = self.running
        if isinstance(running, Idle):
            return
        before = snapshot(running)
        keep = tile(pattern, len(self.model_running))
        gone = [row for row in range(len(self.model_running)) if row not in keep]
        kept, left = split(running, keep)
        assert_unchanged(before, running, "the split batch")
        kept_rows = [self.model_running[row] for row in keep]
        left_rows = [self.model_running[row] for row in gone]
        self._assert_rows(kept, kept_rows)
        self._assert_departed(left, left_rows)
        self.running, self.model_running = kept, kept_rows
        if destination == "release":
            self._release(left, left_rows)
        elif destination == "later":
            self.departed.append((left, left_rows))
        else:
            self.held += left_rows

    @precondition(lambda self: bool(self.departed))
    @rule(pick=st.integers(0, 7))
    def release_departed_later(self, pick: int) -> None:
        """Release a `Departed` against the batch running now (decoded, merged since)."""
        left, rows = self.departed.pop(pick % len(self.departed))
        self._assert_departed(left, rows)
        before = snapshot(left)
        self._release(left, rows)
        assert_unchanged(before, left, "the released Departed")

    @precondition(lambda self: bool(self.model_running))
    @rule(pattern=keep_patterns(), how=st.sampled_from(["other split", "evolved"]))
    def release_departed_running(self, pattern: tuple[bool, ...], how: str) -> None:
        """A `Departed` naming rows that still run: StillRunning, nothing freed."""
        running = self.running
        assert not isinstance(running, Idle)
        num_rows = len(self.model_running)
        keep = tile(pattern, num_rows) or [0]
        gone = [row for row in range(num_rows) if row not in keep]
        kept, left = split(running, keep)
        if how == "other split":
            # The complement's Departed holds exactly the rows `kept` runs.
            named, still = split(running, gone).left, keep
        else:
            # The split's own Departed, edited to name the rows that stayed.
            named = attrs.evolve(
                left,
                reqs=kept.rows.reqs,
                slots=kept.rows.req_pool_indices.host,
                seq_lens=kept.rows.seq_lens.host,
            )
            still = keep
        before = snapshot((self.pools, kept))
        result = release(named, kept, self.pools)
        expected = StillRunning(tuple(self.model_running[row].slot for row in still))
        self._assert_failed_on(result, expected, before, (self.pools, kept))

    def _assert_failed_on(
        self, result: object, expected: object, before: object, inputs: object
    ) -> None:
        # `_assert_failed` for inputs other than the machine's pools and running batch.
        running = self.running
        self.running = inputs[1]  # type: ignore[index]  # (pools, batch)
        try:
            self._assert_failed(result, type(expected), before, expected)
        finally:
            self.running = running

    # ---- verify and sync ----------------------------------------------------------------

    @precondition(lambda self: bool(self.model_running))
    @rule(data=st.data())
    def speculate_again(self, data: st.DataObject) -> None:
        """`speculate` under a second name: hypothesis draws it twice as often."""
        self.speculate(data)

    @precondition(lambda self: bool(self.model_running))
    @rule(data=st.data())
    def speculate(self, data: st.DataObject) -> None:
        """Verify drawn drafts, then sync drawn accepted counts; or a Failure that changes nothing.

        A batch not decoding yet is decoded first (the `step_decode` rule, checked as there).
        """
        if not isinstance(self.running, Decoding):
            self.step_decode()
        running = self.running
        if not isinstance(running, Decoding):
            return  # the decode failed (full pools, full context), as the model predicted
        shape, rows = self.shape, self.model_running
        drafts = data.draw(
            st.lists(st.integers(0, 3), min_size=len(rows), max_size=len(rows)), label="drafts"
        )
        before = snapshot((self.pools, running))
        before_batch = snapshot(running)
        before_pools = _but_table(self.pools)
        result = verify(running, drafts, self.pools)

        lens = [row.seq_len for row in rows]
        reserved = [length + draft for length, draft in zip(lens, drafts, strict=True)]
        too_long = [row for row, length in enumerate(reserved) if length > shape.max_context_len]
        if too_long:
            first = too_long[0]
            expected = ContextTooLong(rows[first].req.rid, reserved[first], shape.max_context_len)
            self._assert_failed(result, ContextTooLong, before, expected)
            return
        page_size = shape.page_size
        pages = sum(
            _pages(new, page_size) - _pages(old, page_size)
            for old, new in zip(lens, reserved, strict=True)
        )
        free_pages = self._model_free_pages()
        if pages > free_pages:
            expected_oom = OutOfKVTokens(pages, free_pages, page_size)
            self._assert_failed(result, OutOfKVTokens, before, expected_oom)
            return
        assert isinstance(result, Success), f"expected Success, got {result}"
        window, pools = result.unwrap()
        assert_unchanged(before_batch, running, "the verified batch")
        assert _but_table(self.pools) == before_pools, "verify changed the pools passed in"
        self._check_window(window, pools, drafts)
        assert pools.num_free_tokens == (free_pages - pages) * page_size
        self._sync(data, window, pools, drafts)

    def _check_window(self, window: Verifying, pools: Pools, drafts: list[int]) -> None:
        # The window: rows, slots, drafts, and where the forward writes (decode token first).
        rows = self.model_running
        lens = [row.seq_len for row in rows]
        reserved = [length + draft for length, draft in zip(lens, drafts, strict=True)]
        slots = [row.slot for row in rows]
        assert window.reqs == tuple(row.req for row in rows)
        assert window.rids.tolist() == [row.req.rid for row in rows]
        assert window.req_pool_indices.host.tolist() == slots
        assert window.req_pool_indices.device.tolist() == slots
        assert window.draft_lens.tolist() == drafts
        assert window.seq_lens.device.tolist() == reserved
        table = pools.table.host.tolist()
        assert window.out_cache_loc.device.tolist() == [
            table[slot][position]
            for slot, length, new in zip(slots, lens, reserved, strict=True)
            for position in range(length - 1, new)
        ]
        assert pools.table.device.tolist() == table
        owned = [pools.slot_tokens.tolist()[slot] for slot in slots]
        assert owned == reserved
        for slot, length, row in zip(slots, lens, rows, strict=True):
            seen = self.locs.get(row.req.rid, [])
            assert table[slot][:length][: len(seen)] == seen, "verify moved a KV location"
        check_pools(pools, [], compare_device=True)

    def _sync(
        self, data: st.DataObject, window: Verifying, pools: Pools, drafts: list[int]
    ) -> None:
        rows, page_size = self.model_running, self.shape.page_size
        slots = [row.slot for row in rows]
        lens = [row.seq_len for row in rows]
        reserved = [length + draft for length, draft in zip(lens, drafts, strict=True)]
        table = pools.table.host.tolist()
        # Sometimes a count out of range first: DraftError, window and pools unchanged.
        bad_first: bool = data.draw(st.booleans(), label="bad count first")
        if rows and bad_first:
            at = data.draw(st.integers(0, len(rows) - 1), label="bad row")
            bad = [0] * len(rows)
            bad[at] = data.draw(st.sampled_from([-1, drafts[at] + 1]), label="bad value")
            state = (snapshot(window), _host_state(pools))
            with pytest.raises(DraftError, match=f"row {at} accepted {bad[at]} of"):
                sync(window, torch.tensor(bad, dtype=torch.int64), pools)
            assert (snapshot(window), _host_state(pools)) == state, "a refused sync changed"
            _failures["DraftError"] = _failures.get("DraftError", 0) + 1
        # Sometimes the pools from before verify: stale (pools are linear), drafts or not.
        stale_first: bool = data.draw(st.booleans(), label="pools from before verify first")
        if stale_first:
            zeros = torch.zeros(len(rows), dtype=torch.int64)
            inputs = (snapshot(window), _host_state(self.pools), _host_state(pools))
            with pytest.raises(StalePools, match="pass the newest pools"):
                sync(window, zeros, self.pools)
            assert (snapshot(window), _host_state(self.pools), _host_state(pools)) == inputs, (
                "a sync refused for stale pools changed"
            )
            _failures["StalePools"] = _failures.get("StalePools", 0) + 1

        accepted = [
            data.draw(st.integers(0, draft), label=f"accepted of {draft}") for draft in drafts
        ]
        num_accepted = torch.tensor(accepted, dtype=torch.int64)
        state = (snapshot((window, num_accepted)), _host_state(pools))
        synced, after = sync(window, num_accepted, pools)
        assert (snapshot((window, num_accepted)), _host_state(pools)) == state, (
            "sync changed its inputs (the window, the counts or the pools passed in)"
        )
        # The window is consumed: its rows hold their slots at one new generation.
        new_gens = synced.rows.gens.tolist()
        assert len(set(new_gens)) <= 1 and all(gen > self.last_gen for gen in new_gens)
        self.last_gen = max(new_gens, default=self.last_gen)
        for row, count in zip(rows, accepted, strict=True):
            row.seq_len += count
            row.gen = self.last_gen
        self._assert_rows(synced, rows)
        if rows:  # the consumed window is refused by a second sync and by release
            with pytest.raises(DraftError, match="do not hold this batch's drafts"):
                sync(window, np.zeros(len(rows), dtype=np.int64), after)
            refused = release(window, idle(window.device), after)
            assert isinstance(refused, Failure) and isinstance(refused.failure(), NotOwned)
        assert after.slot_tokens.tolist()[1:] == [
            next((row.seq_len for row in self._owners() if row.slot == slot), 0)
            for slot in range(1, self.shape.max_reqs + 1)
        ]
        assert after.table.host.tolist() == table, "sync wrote the table"
        # Pages holding only unaccepted drafts went back, behind the pages free before.
        freed = [
            table[slot][page * page_size] // page_size
            for slot, old, new, count in zip(slots, lens, reserved, accepted, strict=True)
            for page in range(_pages(old + count, page_size), _pages(new, page_size))
        ]
        assert after.free_pages.tolist() == pools.free_pages.tolist() + freed
        check_batch(synced, compare_device=True)
        _counts["synced"] = _counts.get("synced", 0) + 1
        self.running, self.pools = synced, after


def test_speculative_state_machine() -> None:
    """No sequence with split, Departed releases, verify and sync disagrees with the model."""
    _counts.update(examples=0, steps=0, continued=0, synced=0)
    _failures.clear()
    elapsed = run_timed(SpeculativeMachine, MAX_EXAMPLES)
    print(
        f"\nspeculative state machine: {_counts['examples']} runs, {_counts['steps']} checked"
        f" states, {_counts['synced']} syncs in {elapsed:.1f} s; failures seen: {_failures}"
    )
    assert _counts["steps"] > _counts["examples"], "the machine ran no steps"
    if FAST:
        return  # the mutation profile's budget is too small to reach every failure
    assert _counts["synced"] >= 10, "too few verify windows synced"
    expected = {
        "OutOfKVTokens",
        "ContextTooLong",
        "StillRunning",
        "NotOwned",
        "DraftError",
        "StalePools",
    }
    assert expected <= set(_failures), f"never reached: {expected - set(_failures)}"
