"""A scheduler's own columns ride through every transition, on both sides, row for row.

`Probe` has one column of each kind (mirrored, device-only, host-only); a
plain-Python model keeps each row's values, and after every transition every
column is compared with it on every side it has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import attrs
import numpy as np
import pytest
import torch
from benchmarks.counting import count_device_work
from hypothesis import settings
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
    ColumnError,
    Columns,
    Filtered,
    Idle,
    Mirrored,
    NoColumns,
    Pools,
    RecordShapeError,
    Req,
    Sampled,
    Sampling,
    SamplingParams,
    admit_prefilled,
    build_columns,
    check_batch,
    check_pools,
    decode,
    decode_sampled,
    extend,
    filter_batch,
    finish_mixed,
    idle,
    make_pools,
    merge,
    mix,
    release,
    split,
    sync,
    verify,
)
from batchstate.audit import device_reads
from tests.builders import Probe, assert_probe, make_probe
from tests.strategies import assert_unchanged, snapshot

CPU: Final = torch.device("cpu")
META: Final = torch.device("meta")


def _reqs(rids: Sequence[int], length: int = 3) -> list[Req]:
    return [Req(rid, tuple(range(1, length + 1))) for rid in rids]


def test_every_transition_carries_the_columns_row_for_row() -> None:
    """extend, decode, split, release, merge, filter and verify/sync keep each row's columns."""
    pools = make_pools(8, 64, 256, CPU, page_size=4)
    batch, pools = extend(idle(CPU, Probe), _reqs([1, 2, 3]), pools, make_probe([1, 2, 3])).unwrap()
    assert_probe(batch.rows.columns, [1, 2, 3])
    decoded, pools = decode(batch, pools).unwrap()
    assert_probe(decoded.rows.columns, [1, 2, 3])
    kept, left = split(decoded, [0, 2])
    assert_probe(kept.rows.columns, [1, 3])
    pools = release(left, kept, pools).unwrap()
    new, pools = admit_prefilled(
        idle(CPU, Probe), _reqs([7, 8]), pools, make_probe([7, 8])
    ).unwrap()
    running = merge(kept, new)
    assert_probe(running.rows.columns, [1, 3, 7, 8])
    decoded, pools = decode(running, pools).unwrap()
    window, pools = verify(decoded, [1, 0, 2, 0], pools).unwrap()
    synced, pools = sync(window, torch.tensor([1, 0, 0, 0]), pools)
    assert_probe(synced.rows.columns, [1, 3, 7, 8])
    check_batch(synced, compare_device=True)
    check_pools(pools, [synced], compare_device=True)


def test_an_empty_filter_leaves_zero_rows_in_every_column() -> None:
    """Filtering everything out gives well-formed empty columns, on both sides."""
    pools = make_pools(8, 64, 256, CPU)
    batch, _ = extend(idle(CPU, Probe), _reqs([1, 2]), pools, make_probe([1, 2])).unwrap()
    empty = filter_batch(batch, [])
    assert_probe(empty.rows.columns, [])
    assert empty.rows.columns.weight.device.shape == (0,)
    assert idle(CPU, Probe).rows.columns.lora.device.shape == (0,)


def _wrong_length() -> Probe:
    return make_probe([1])


def _wrong_dtype() -> Probe:
    good = make_probe([1, 2])
    bad = Mirrored.from_host(good.weight.host.astype(np.float64), CPU)
    return attrs.evolve(good, weight=bad)  # type: ignore[arg-type]  # the point of the case


def _wrong_device() -> Probe:
    return make_probe([1, 2], META)


def _writable_host() -> Probe:
    return attrs.evolve(make_probe([1, 2]), budget=np.array([1, 2]))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_wrong_length, r"Probe\.weight\.host: expected a read-only float32 array \[2\]"),
        (_wrong_dtype, r"Probe\.weight\.host: expected a read-only float32 array"),
        (_wrong_device, r"Probe\.weight\.device: expected torch.float32 \[2\] on cpu"),
        (_writable_host, r"Probe\.budget: expected a read-only int64 array \[2\], got a writable"),
        (NoColumns, r"the batch carries Probe columns, got NoColumns"),
    ],
    ids=["length", "dtype", "device", "writable", "another-set"],
)
def test_bad_columns_at_extend_allocate_nothing(make: object, message: str) -> None:
    """A wrong set, length, dtype or device is a ColumnError, raised before any allocation."""
    pools = make_pools(8, 64, 256, CPU)
    before = snapshot(pools)
    columns = make()  # type: ignore[operator]  # parametrized callables
    with pytest.raises(ColumnError, match=message):
        extend(idle(CPU, Probe), _reqs([1, 2]), pools, columns)
    assert_unchanged(before, pools, "pools")


def test_merging_different_column_sets_is_refused_at_run_time_too() -> None:
    """mypy rejects it; a caller without mypy gets ColumnError, and nothing is built."""
    pools = make_pools(8, 64, 256, CPU)
    probed, pools = extend(idle(CPU, Probe), _reqs([1]), pools, make_probe([1])).unwrap()
    plain, pools = extend(idle(CPU), _reqs([2]), pools).unwrap()
    with pytest.raises(ColumnError, match="cannot merge NoColumns columns into Probe ones"):
        merge(filter_batch(probed, [0]), plain)  # type: ignore[misc, arg-type]  # the runtime check


def test_a_hand_built_column_set_of_the_wrong_length_is_refused() -> None:
    """Rows built by hand check their columns as they check their own."""
    pools = make_pools(8, 64, 256, CPU)
    batch, _ = extend(idle(CPU, Probe), _reqs([1, 2]), pools, make_probe([1, 2])).unwrap()
    with pytest.raises(RecordShapeError, match=r"Rows\.Probe\.weight"):
        attrs.evolve(batch.rows, columns=make_probe([1]))


def test_columns_that_are_not_a_column_set_are_refused() -> None:
    """A field of another type, or a class that is not attrs, is a ColumnError naming it."""

    @attrs.frozen(eq=False)
    class Wrong(Columns):
        weight: list[float]  # type: ignore[column-set]  # the run-time refusal

    with pytest.raises(ColumnError, match=r"Wrong\.weight: a column is Mirrored"):
        build_columns(Wrong, {"weight": [1.0]}, CPU)
    with pytest.raises(ColumnError, match=r"columds|columns \['budget', 'lora', 'weight'\]"):
        build_columns(Probe, {"weight": [1.0]}, CPU)


def test_columns_on_meta_read_nothing() -> None:
    """The decode path with a column set reads nothing from the device."""
    pools = make_pools(8, 64, 256, META, page_size=4)
    with device_reads(forbid=True) as log:
        batch, pools = extend(
            idle(META, Probe), _reqs([1, 2, 3]), pools, make_probe([1, 2, 3], META)
        ).unwrap()
        decoded, pools = decode(batch, pools).unwrap()
        kept, left = split(decoded, [0, 2])
        pools = release(left, kept, pools).unwrap()
        new, pools = extend(idle(META, Probe), _reqs([9]), pools, make_probe([9], META)).unwrap()
        running = merge(kept, new)
    assert log.report().count == 0
    assert running.rows.columns.budget.tolist() == [1001, 1003, 1009]


@pytest.mark.parametrize("phase", ["decode", "filter", "merge", "extend"])
def test_a_standard_column_set_adds_no_upload(phase: str) -> None:
    """With Sampling columns each transition still makes one host-to-device copy."""
    device = META
    params = [SamplingParams(0.5, seed=rid) for rid in range(3)]
    pools = make_pools(8, 64, 256, device)
    base, pools = extend(
        idle(device, Sampling), _reqs([0, 1, 2]), pools, Sampling.of(params, device)
    ).unwrap()
    arriving = Sampling.of([SamplingParams(seed=9)], device)  # built before the count
    with count_device_work() as work:
        if phase == "decode":
            decode(base, pools).unwrap()
        elif phase == "filter":
            filter_batch(base, [0, 2])
        elif phase == "merge":
            merge(
                filter_batch(base, [0, 1, 2]),
                extend(idle(device, Sampling), _reqs([9]), pools, arriving).unwrap().batch,
            )
        else:
            extend(idle(device, Sampling), _reqs([9]), pools, arriving).unwrap()
    expected = 2 if phase == "merge" else 1  # merge's case includes the extend it merges
    assert work.copies == expected


def test_chunked_and_mixed_forwards_carry_the_columns() -> None:
    """mix, finish_mixed and decode_sampled keep each row's columns; a held chunk keeps its own."""
    pools = make_pools(8, 64, 256, CPU, page_size=4)
    first, pools = extend(idle(CPU, Probe), _reqs([1, 2]), pools, make_probe([1, 2])).unwrap()
    running = merge(idle(CPU, Probe), first)
    # A long prompt joins under a small budget: it is cut, and held with its own row.
    long = [Req(5, tuple(range(1, 21)))]
    mixed, pools = mix(running, long, 8, pools, [7, 7], make_probe([5])).unwrap()
    assert_probe(mixed.rows.columns, [5, 1, 2])
    settled, held = finish_mixed(mixed)
    assert_probe(settled.rows.columns, [1, 2])
    assert [chunk.req.rid for chunk in held] == [5]
    assert_probe(held[0].columns, [5])
    # The chunk goes on beside a new request; the last chunk makes it a running row.
    mixed, pools = mix(settled, [held[0], *_reqs([6])], 20, pools, [7, 7], make_probe([6])).unwrap()
    assert_probe(mixed.rows.columns, [5, 6, 1, 2])
    settled, held = finish_mixed(mixed)
    assert held == ()
    assert_probe(settled.rows.columns, [1, 2, 5, 6])
    tokens = Sampled.of(settled.rows, torch.zeros(4, dtype=torch.int64))
    decoded, pools = decode_sampled(settled, tokens, pools).unwrap()
    assert_probe(decoded.rows.columns, [1, 2, 5, 6])
    check_pools(pools, [finish_mixed(decoded).running], compare_device=True)


def test_mix_refuses_columns_that_do_not_fit_before_allocating() -> None:
    """One row per new request, of the batch's set: anything else is a ColumnError."""
    pools = make_pools(8, 64, 256, CPU)
    first, pools = extend(idle(CPU, Probe), _reqs([1]), pools, make_probe([1])).unwrap()
    running = merge(idle(CPU, Probe), first)
    before = snapshot(pools)
    with pytest.raises(ColumnError, match=r"Probe\.weight\.host: expected a read-only float32"):
        mix(running, _reqs([4, 5]), 8, pools, [7], make_probe([4]))
    with pytest.raises(ColumnError, match="the batch carries Probe columns, got NoColumns"):
        mix(running, _reqs([4]), 8, pools, [7], NoColumns())  # type: ignore[misc, arg-type]  # on purpose
    assert_unchanged(before, pools, "pools")


# ---- the stateful model -----------------------------------------------------------------


class ColumnMachine(RuleBasedStateMachine):
    """Admit, decode, split and release, merge, filter: columns against a Python model."""

    def __init__(self) -> None:
        super().__init__()
        self.next_rid = 0
        self.pools: Pools = make_pools(6, 48, 96, CPU, page_size=4)
        self.running: Filtered[Probe] | Idle[Probe] = idle(CPU, Probe)
        self.rids: list[int] = []

    @initialize(page_size=st.sampled_from([1, 4]))
    def start(self, page_size: int) -> None:
        self.pools = make_pools(6, 48, 96, CPU, page_size=page_size)

    @rule(count=st.integers(1, 3), length=st.integers(1, 9))
    def admit(self, count: int, length: int) -> None:
        rids = list(range(self.next_rid, self.next_rid + count))
        self.next_rid += count
        before = snapshot(self.pools)
        result = extend(idle(CPU, Probe), _reqs(rids, length), self.pools, make_probe(rids))
        if isinstance(result, Failure):
            assert_unchanged(before, self.pools, "pools after a failed extend")
            return
        batch, self.pools = result.unwrap()
        assert_probe(batch.rows.columns, rids)
        self.running = merge(self.running, batch)
        self.rids += rids

    @precondition(lambda self: bool(self.rids))
    @rule()
    def step(self) -> None:
        result = decode(self.running, self.pools)  # type: ignore[arg-type]  # not Idle: precondition
        if isinstance(result, Success):
            decoded, self.pools = result.unwrap()
            assert_probe(decoded.rows.columns, self.rids)
            self.running = filter_batch(decoded, list(range(len(self.rids))))

    @precondition(lambda self: bool(self.rids))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        keep = sorted(data.draw(st.sets(st.integers(0, len(self.rids) - 1))))
        kept, left = split(self.running, keep)  # type: ignore[arg-type]  # not Idle: precondition
        self.pools = release(left, kept, self.pools).unwrap()
        self.running, self.rids = kept, [self.rids[row] for row in keep]

    @invariant()
    def columns_match_the_model(self) -> None:
        assert_probe(self.running.rows.columns, self.rids)
        check_batch(self.running, compare_device=True)
        check_pools(self.pools, [self.running], compare_device=True)


# hypothesis' runner is untyped: give it a type once.
run_machine: Callable[..., None] = run_state_machine_as_test


def test_column_machine() -> None:
    """Any sequence of steps keeps every column equal to the model, both sides."""
    run_machine(
        ColumnMachine, settings=settings(max_examples=40, stateful_step_count=25, deadline=None)
    )
