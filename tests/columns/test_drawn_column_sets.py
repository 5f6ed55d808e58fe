"""Column sets Hypothesis draws, of every kind and scalar type, through every transition.

Each example makes a column set at run time (`attrs.make_class`, frozen,
deriving from `Columns`), one to four fields of drawn kinds and dtypes, and
drives one pools lineage through every transition of `TRANSITIONS` that
moves rows (and `release`, `gather_sampled`, `join_sampled`), with the prefix cache
off or on. Each row's value in each column is a function of its rid, so
after every step each record's columns must hold, host and device side, in
the declared dtype, exactly the values of its rows' rids in row order; and
`check_batch` and `check_pools` (both sides compared) must pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import attrs
import numpy as np
import numpy.typing as npt
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchstate import (
    TRANSITIONS,
    Batch,
    Chunked,
    Columns,
    Decoding,
    DeviceOnly,
    Extended,
    Filtered,
    GraphBuffers,
    HostColumn,
    HybridBuffers,
    Idle,
    MemoryKinds,
    Mirrored,
    Pools,
    RecurrentState,
    Req,
    Sampled,
    SlidingWindow,
    Verifying,
    WindowAhead,
    admit_prefilled,
    build_columns,
    check_batch,
    check_pools,
    decode,
    decode_sampled,
    exact_window,
    extend,
    fill_buffers,
    fill_hybrid_buffers,
    filter_batch,
    find_leaks,
    finish_mixed,
    forward_inputs,
    gather_sampled,
    hybrid_inputs,
    idle,
    join_sampled,
    make_pools,
    merge,
    mix,
    pad,
    release,
    split,
    sync,
    transfer_targets,
    unwrap,
    verify,
    verify_ahead,
)
from batchstate.base.mirrored import torch_dtype
from batchstate.base.scalars import SCALAR_NAMES
from tests.builders import CPU, make_reqs, make_test_pools

_KINDS: Final = ("mirrored", "device", "host")


class Field(NamedTuple):
    """One drawn column: its kind and the numpy dtype of its values."""

    kind: str
    dtype: np.dtype[Any]


@st.composite
def column_sets(draw: st.DrawFn) -> tuple[Field, ...]:
    """One to four columns, each of a drawn kind and an admitted scalar type."""
    fields = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(_KINDS))
        fields.append(Field(kind, np.dtype(getattr(np, draw(st.sampled_from(SCALAR_NAMES))))))
    return tuple(fields)


def _declare(fields: Sequence[Field]) -> type[Columns]:
    # The set as a frozen attrs class made at run time, as a scheduler might declare it.
    kinds: dict[str, Any] = {"mirrored": Mirrored, "host": HostColumn}
    hints = {
        f"c{index}": DeviceOnly if field.kind == "device" else kinds[field.kind][field.dtype.type]
        for index, field in enumerate(fields)
    }
    attributes = {name: attrs.field(type=hint) for name, hint in hints.items()}
    return attrs.make_class("Drawn", attributes, bases=(Columns,), frozen=True, eq=False)


def _values(field: Field, index: int, rids: Sequence[int]) -> npt.NDArray[Any]:
    # Column `index`'s values for rows `rids`: a function of each rid, in the column's dtype.
    kind = field.dtype.kind
    if kind == "b":
        values: list[object] = [(rid + index) % 2 == 1 for rid in rids]
    elif kind in "iu":
        values = [(rid * 3 + index) % 100 for rid in rids]
    elif kind == "f":
        values = [(rid + index) / 4 for rid in rids]
    else:
        values = [complex(rid, index) for rid in rids]
    return np.array(values, dtype=field.dtype)


class Story:
    """The drawn set, its values by rid, and the checks every step's records must pass."""

    def __init__(self, fields: tuple[Field, ...]) -> None:
        self.fields = fields
        self.cls = _declare(fields)

    def columns(self, rids: Sequence[int]) -> Any:
        """The set's columns for new rows `rids`, in one upload."""
        return build_columns(
            self.cls,
            {f"c{i}": _values(field, i, rids) for i, field in enumerate(self.fields)},
            CPU,
        )

    def columns_of(self, reqs: Sequence[Req]) -> Any:
        return self.columns([req.rid for req in reqs])

    def expect(self, columns: object, rids: Sequence[int]) -> None:
        """Every column holds rows `rids`' values, in order, in its dtype, on both sides."""
        assert type(columns) is self.cls
        for index, field in enumerate(self.fields):
            value = getattr(columns, f"c{index}")
            expected = _values(field, index, rids)
            if field.kind == "host":
                assert value.dtype == field.dtype
                assert not value.flags.writeable
                assert np.array_equal(value, expected)
                continue
            side = value.device
            if field.kind == "mirrored":
                assert value.host.dtype == field.dtype
                assert not value.host.flags.writeable
                assert np.array_equal(value.host, expected)
                assert side.dtype == torch_dtype(field.dtype)
            elif len(rids):  # an Idle's empty device column is int64: it has no rows to type
                assert side.dtype == torch_dtype(field.dtype)
            assert np.array_equal(side.cpu().numpy(), expected)

    def check(self, pools: Pools, *holders: object) -> None:
        """Each holder's columns follow its rows; the invariants hold, device sides compared."""
        batches: list[Batch[Any]] = []
        for holder in holders:
            if isinstance(holder, Chunked):
                self.expect(holder.columns, [holder.req.rid])
            elif isinstance(holder, Verifying | WindowAhead):
                self.expect(holder.columns, holder.rids.tolist())
            else:
                rows = holder.rows  # type: ignore[attr-defined]  # a batch or a Mixed
                self.expect(rows.columns, rows.rids.tolist())
                if isinstance(holder, Idle | Extended | Decoding | Filtered):
                    check_batch(holder, compare_device=True)
                    batches.append(holder)
        check_pools(pools, batches, compare_device=True)


# The public functions the story calls: each transition of the table is among them.
COVERED: Final = frozenset(
    {idle, extend, admit_prefilled, decode, filter_batch, split, merge, verify, sync, mix}
    | {decode_sampled, finish_mixed, forward_inputs, pad, release, gather_sampled, join_sampled}
    | {
        fill_buffers,
        verify_ahead,
        exact_window,
        hybrid_inputs,
        transfer_targets,
        fill_hybrid_buffers,
    }
)


def test_the_story_covers_every_transition_of_the_table() -> None:
    assert {row.function for row in TRANSITIONS} <= COVERED


@settings(max_examples=100, deadline=None)
@given(fields=column_sets(), cache=st.booleans(), page_size=st.sampled_from([1, 16]))
def test_drawn_columns_follow_their_rows_through_every_transition(
    fields: tuple[Field, ...], cache: bool, page_size: int
) -> None:
    pools = make_test_pools(page_size, max_reqs=16, num_kv_tokens=1024, prefix_cache=cache)
    _tell(Story(fields), pools)


# A sliding window shorter than the story's longer prompts, and a state per request slot.
HYBRID: Final = MemoryKinds((SlidingWindow(8, 1024), RecurrentState(8, 16)))


@settings(max_examples=25, deadline=None)
@given(fields=column_sets(), page_size=st.sampled_from([1, 16]))
def test_drawn_columns_follow_their_rows_on_hybrid_pools(
    fields: tuple[Field, ...], page_size: int
) -> None:
    """The same story on hybrid pools: window pages and states move with the rows too."""
    pools = make_pools(16, 64, 1024, CPU, page_size, memory=HYBRID)
    _tell(Story(fields), pools)


def _tell(story: Story, pools: Pools) -> None:
    empty = idle(CPU, story.cls)
    story.check(pools, empty)
    running, pools = _admit(story, empty, pools)
    running, pools = _mix(story, running, pools)
    running, pools = _speculate_and_join(story, empty, running, pools)
    # Everything leaves: nothing is held, nothing leaked.
    pools = unwrap(release(running, empty, pools))
    story.check(pools, empty)
    leaks = find_leaks(pools, [])
    assert not leaks.unheld and not leaks.held_twice and not leaks.wrong_length
    assert all(state.num_free == state.kind.num_states for state in pools.memory.states)
    assert all(len(window.page_list) == window.num_pages for window in pools.memory.windows)


def _admit(story: Story, empty: Idle[Any], pools: Pools) -> tuple[Filtered[Any], Pools]:
    # Admit, run a forward, decode, let a row leave, filter, and merge a prebuilt batch in.
    first = make_reqs([3, 9, 5, 2], first_rid=0)
    extended, pools = unwrap(extend(empty, first, pools, story.columns_of(first)))
    story.check(pools, extended)
    inputs = forward_inputs(extended, pools.table, pools.page_size)
    assert unwrap(pad(inputs, [64])).num_real_rows == 4
    hybrid = hybrid_inputs(inputs, pools)  # per kind of memory the pools hold: none, or one
    assert len(hybrid.windows) == len(pools.memory.windows)
    assert len(hybrid.states) == len(pools.memory.states)
    buffers = GraphBuffers.allocate(CPU, pools.page_size, rows=8, tokens=64, max_pages=64)
    filled = unwrap(fill_buffers(buffers, extended, pools.table))
    assert filled.num_real_rows == 4
    kinds = pools.memory_kinds
    other = HybridBuffers.allocate(CPU, kinds, rows=8, tokens=64, window_pages=512)
    assert unwrap(fill_hybrid_buffers(other, filled.inputs, pools)).num_rows == 8
    decoding, pools = unwrap(decode(extended, pools))
    story.check(pools, decoding)
    kept, left = split(decoding, [0, 2, 3])
    pools = unwrap(release(left, kept, pools))
    story.check(pools, kept)
    assert kept.rows.rids.tolist() == [0, 2, 3]
    # Filter without releasing: both parts still hold their rows.
    stay, gone = filter_batch(kept, [0, 2]), filter_batch(kept, [1])
    story.check(pools, stay, gone)
    pools = unwrap(release(gone, stay, pools))
    arrived = make_reqs([4, 6], first_rid=100)
    built, pools = unwrap(admit_prefilled(empty, arrived, pools, story.columns_of(arrived)))
    assert len(transfer_targets(built, pools).kv_locs) == 4 + 6  # every prompt position
    merged = merge(stay, built)
    story.check(pools, merged)
    assert merged.rows.rids.tolist() == [0, 3, 100, 101]
    return merged, pools


def _mix(story: Story, running: Filtered[Any], pools: Pools) -> tuple[Filtered[Any], Pools]:
    # Two new prompts, the long one cut by the budget and held; the held chunk continued
    # on its own row of columns; then a decode fed the last forward's device tokens.
    prompts = make_reqs([2, 30], first_rid=200)
    tokens = [7] * len(running.rows)
    mixed, pools = unwrap(mix(running, prompts, 12, pools, tokens, story.columns_of(prompts)))
    story.check(pools, mixed)
    running, held = finish_mixed(mixed)
    story.check(pools, running, *held)
    assert [chunk.req.rid for chunk in held] == [201]
    tokens = [5] * len(running.rows)
    again, pools = unwrap(mix(running, held, 64, pools, tokens, story.columns([])))
    story.check(pools, again)
    running, held = finish_mixed(again)
    assert held == ()
    sampled = Sampled.of(again.rows, torch.arange(len(again.rows), dtype=torch.int64))
    fed, pools = unwrap(decode_sampled(running, gather_sampled(sampled, running), pools))
    story.check(pools, fed)
    return finish_mixed(fed).running, pools


def _speculate_and_join(
    story: Story, empty: Idle[Any], running: Filtered[Any], pools: Pools
) -> tuple[Filtered[Any], Pools]:
    # A verify window synced with one draft accepted per row; then a row prefilled beside
    # the running ones, merged, and the two forwards' device tokens joined to feed both.
    decoding, pools = unwrap(decode(running, pools))
    first, pools = unwrap(verify(decoding, [2] * len(decoding.rows), pools))
    story.check(pools, first)
    # Under overlap: the next window opened from the device's counts, then settled.
    counts = torch.ones(len(decoding.rows), dtype=torch.int32)
    opened, pools = unwrap(verify_ahead(first, counts, [2] * len(decoding.rows), pools))
    story.check(pools, opened)
    window, pools = exact_window(opened, counts.numpy(), pools)
    story.check(pools, window)
    synced, pools = sync(window, np.ones(len(decoding.rows), dtype=np.int64), pools)
    story.check(pools, synced)
    late = make_reqs([3], first_rid=300)
    prefill, pools = unwrap(extend(empty, late, pools, story.columns_of(late)))
    both = merge(synced, prefill)
    story.check(pools, both)
    old = Sampled.of(synced.rows, torch.full((len(synced.rows),), 3, dtype=torch.int64))
    new = Sampled.of(prefill.rows, torch.tensor([4], dtype=torch.int64))
    fed, pools = unwrap(decode_sampled(both, gather_sampled(join_sampled(old, new), both), pools))
    story.check(pools, fed)
    final = finish_mixed(fed).running
    assert final.rows.rids.tolist() == [*synced.rows.rids.tolist(), 300]
    return final, pools
