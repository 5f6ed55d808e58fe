"""Every row of TRANSITIONS, run from records reached through the public API."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from returns.result import Failure

from batchstate import (
    TRANSITIONS,
    Batch,
    Chunked,
    Decoding,
    DoesNotFit,
    Extended,
    Filtered,
    ForwardInputs,
    GraphBuffers,
    HybridBuffers,
    Idle,
    Mixed,
    Padded,
    Pools,
    Req,
    Sampled,
    SlotHolder,
    TooLargeToPad,
    Transition,
    Verifying,
    WindowAhead,
    admit_prefilled,
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
    hybrid_inputs,
    idle,
    merge,
    mix,
    pad,
    release,
    split,
    sync,
    transfer_targets,
    verify,
    verify_ahead,
)
from tests.builders import (
    CPU,
    Probe,
    assert_probe,
    make_phase,
    make_probe,
    make_reqs,
    make_test_pools,
)
from tests.forward_cases import Record, build, fill_record

Caller = Callable[[Batch | None, Batch | None, Pools], tuple[Batch, Pools, list[Batch]]]
# The chunked and mixed rows take and return records outside Batch.
Source = Batch | Chunked | None


# Whether this run's records carry `Probe` columns (set by test_transition_row).
_PROBE: list[bool] = [False]


def _columns_for(batch: object, rids: Sequence[int]) -> tuple[Probe, ...]:
    # The new rows' own columns, when the batch they join carries `Probe` ones.
    rows = getattr(batch, "rows", None)
    return (make_probe(rids),) if rows is not None and isinstance(rows.columns, Probe) else ()


def _call_idle(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    batch = idle(CPU, Probe) if _PROBE[0] else idle(CPU)
    return batch, pools, [batch]  # type: ignore[list-item, return-value]  # either set


def _call_extend(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    if pools.cache.enabled:
        return _call_extend_shared(source, pools)
    extra = _columns_for(source, [50, 51])
    batch, pools = extend(source, make_reqs([2, 9], first_rid=50), pools, *extra).unwrap()  # type: ignore[arg-type]  # table rows type sources loosely
    return batch, pools, [batch]


def _call_extend_shared(source: Batch | None, pools: Pools) -> tuple[Batch, Pools, list[Batch]]:
    # With the cache on: a first request computes a shared header, published when its
    # prefill is built; the second reads the header's whole pages while the first runs.
    header = tuple(range(7, 40))
    first, pools = extend(
        source,  # type: ignore[arg-type]  # as above
        [Req(50, (*header, 1))],
        pools,
        *_columns_for(source, [50]),
    ).unwrap()
    batch, pools = extend(
        source,  # type: ignore[arg-type]  # as above
        [Req(51, (*header, 2, 3))],
        pools,
        *_columns_for(source, [51]),
    ).unwrap()
    assert batch.prefix_lens[0] == len(header) // pools.page_size * pools.page_size
    return batch, pools, [first, batch]


def _call_prebuilt(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    extra = _columns_for(source, [50, 51])
    batch, pools = admit_prefilled(source, make_reqs([4, 17], first_rid=50), pools, *extra).unwrap()  # type: ignore[arg-type]  # as above
    return batch, pools, [batch]


def _call_decode(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    batch, pools = decode(source, pools).unwrap()  # type: ignore[arg-type]  # as above
    return batch, pools, [batch]


def _call_filter(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    assert source is not None
    kept = filter_batch(source, list(range(1, len(source.rows))))  # type: ignore[arg-type]  # as above
    dropped = filter_batch(source, [0] if len(source.rows) else [])  # type: ignore[arg-type]  # as above
    return kept, pools, [kept, dropped]


def _call_split(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    assert source is not None
    kept, left = split(source, list(range(1, len(source.rows))))  # type: ignore[arg-type]  # as above
    assert len(left.slots) == len(source.rows) - len(kept.rows)
    pools = release(left, kept, pools).unwrap()  # the rows that left give their memory back
    return kept, pools, [kept]


def _call_merge(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    batch = merge(source, operand)  # type: ignore[arg-type]  # as above
    return batch, pools, [batch]


def _call_verify(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    # The window is not a Batch: the pools are checked alone, with no rows to match.
    assert source is not None
    verifying, pools = verify(source, [2] * len(source.rows), pools).unwrap()  # type: ignore[arg-type]  # as above
    return verifying, pools, [verifying]  # type: ignore[return-value,list-item]  # a target outside Batch


def _call_sync(
    source: Batch | None, operand: Batch | None, pools: Pools
) -> tuple[Batch, Pools, list[Batch]]:
    # The source is a Decoding (see test_transition_row): open the window, reject every draft.
    assert source is not None
    verifying, pools = verify(source, [3] * len(source.rows), pools).unwrap()  # type: ignore[arg-type]  # as above
    synced, pools = sync(verifying, torch.zeros(len(source.rows), dtype=torch.int64), pools)
    return synced, pools, [synced]


def _call_verify_ahead(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    # The source is a Decoding (see test_transition_row): open a window, then the next one
    # ahead of its counts, which stay on the device.
    assert isinstance(source, Decoding)
    window, pools = verify(source, [2] * len(source.rows), pools).unwrap()
    counts = torch.ones(len(source.rows), dtype=torch.int32)
    opened, pools = verify_ahead(window, counts, [1] * len(source.rows), pools).unwrap()
    assert opened.seq_lens.device.tolist() == (opened.seq_lens.bound - 1).tolist()
    return opened, pools, [opened]


def _call_settle_ahead(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    opened, pools, _ = _call_verify_ahead(source, operand, pools)
    assert isinstance(opened, WindowAhead)
    window, pools = exact_window(opened, np.ones(len(opened.reqs), dtype=np.int32), pools)
    assert window.out_cache_loc.host.tolist() == opened.out_cache_loc.device.tolist()
    return window, pools, [window]


def _call_mix(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    # Idle or Filtered source; the operand is a held Chunked, or None for new requests only.
    assert isinstance(source, Idle | Filtered)
    tokens = [7] * len(source.rows)
    admit: list[Req | Chunked] = [] if operand is None else [operand]  # type: ignore[list-item]  # a Chunked
    admit += make_reqs([9, 30], first_rid=60)
    extra = _columns_for(source, [60, 61])
    mixed, pools = mix(source, admit, 20, pools, tokens, *extra).unwrap()
    assert mixed.num_extend_rows >= 1
    assert mixed.num_extend_tokens == 20 or not mixed.partial
    assert mixed.rows.rids.tolist()[mixed.num_extend_rows :] == source.rows.rids.tolist()
    return mixed, pools, [mixed]


def _call_decode_sampled(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    assert isinstance(source, Filtered)
    tokens = torch.arange(len(source.rows), dtype=torch.int64)
    mixed, pools = decode_sampled(source, Sampled.of(source.rows, tokens), pools).unwrap()
    assert mixed.input_ids.device.tolist() == tokens.tolist()
    assert mixed.num_extend_rows == 0
    return mixed, pools, [mixed]


def _call_settle(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    # The source is a Filtered (see test_transition_row): mix a long prompt in, cut by the budget.
    assert isinstance(source, Filtered)
    long = make_reqs([45], first_rid=70)
    tokens = [3] * len(source.rows)
    mixed, pools = mix(source, long, 11, pools, tokens, *_columns_for(source, [70])).unwrap()
    running, held = finish_mixed(mixed)
    assert [chunk.cached for chunk in held] == [11]
    assert running.rows.rids.tolist() == source.rows.rids.tolist()
    return running, pools, [running, *held]


def _call_settle_held(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    _, pools, live = _call_settle(source, operand, pools)
    return live[-1], pools, live


def _call_forward_inputs(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    # The source is the record itself (a Filtered stands for Mixed, a Decoding for Verifying:
    # see test_transition_row, whose window map builds them).
    assert isinstance(source, Idle | Extended | Decoding)
    inputs = forward_inputs(source, pools.table, pools.page_size)
    _assert_inputs(inputs, source.rows.seq_lens.host.tolist())
    return inputs, pools, [source]


def _call_forward_inputs_mixed(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    mixed, pools, live = _call_mix(source, None, pools)
    assert isinstance(mixed, Mixed)
    inputs = forward_inputs(mixed, pools.table, pools.page_size)
    _assert_inputs(inputs, mixed.rows.seq_lens.host.tolist())
    return inputs, pools, live


def _call_forward_inputs_verifying(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    assert isinstance(source, Decoding)
    window, pools = verify(source, [2] * len(source.rows), pools).unwrap()
    inputs = forward_inputs(window, pools.table, pools.page_size, slot_tokens=pools.slot_tokens)
    _assert_inputs(inputs, [n + 2 for n in source.rows.seq_lens.host.tolist()])
    return inputs, pools, [window]


def _assert_inputs(inputs: ForwardInputs, seq_lens: list[int]) -> None:
    assert inputs.seq_lens.host.tolist() == seq_lens
    assert (
        inputs.kv_indices.device.tolist()
        == inputs.page_table.device.reshape(-1)[
            [
                row * inputs.page_table.device.shape[1] + page
                for row, count in enumerate(np.diff(inputs.kv_indptr.host).tolist())
                for page in range(count)
            ]
        ].tolist()
    )


def _call_hybrid_inputs(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    # These pools are full attention: no kind, so no window or state inputs (test_hybrid_pools
    # covers hybrid pools).
    assert isinstance(source, Decoding)
    inputs = forward_inputs(source, pools.table, pools.page_size)
    hybrid = hybrid_inputs(inputs, pools)
    assert (hybrid.num_rows, hybrid.windows, hybrid.states) == (len(source.rows), (), ())
    return hybrid, pools, [source]


def _call_transfer_targets(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    # Full-attention pools: each row's every position at its table cells, and nothing more
    # (tests/forward/test_hybrid_prebuilt.py covers hybrid pools).
    assert isinstance(source, Filtered)
    targets = transfer_targets(source, pools)
    slots, lens = source.rows.req_pool_indices.host, source.rows.seq_lens.host
    cells = [
        pools.table.host[slot, :length].tolist() for slot, length in zip(slots, lens, strict=True)
    ]
    assert targets.kv_locs.host.tolist() == [loc for row in cells for loc in row]
    assert (targets.num_rows, targets.hybrid.windows) == (len(source.rows), ())
    return targets, pools, [source]


def _call_fill_hybrid(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    # Full-attention pools, a padded decode bucket: no window or state inputs, as
    # `hybrid_inputs` (tests/captured/test_hybrid_buffers.py covers hybrid pools).
    assert isinstance(source, Decoding)
    padded = pad(forward_inputs(source, pools.table, pools.page_size), [64]).unwrap()
    buffers = HybridBuffers.allocate(CPU, pools.memory_kinds, rows=64, tokens=64, window_pages=64)
    hybrid = fill_hybrid_buffers(buffers, padded.inputs, pools).unwrap()
    assert (hybrid.num_rows, hybrid.windows, hybrid.states) == (64, (), ())
    return hybrid, pools, [source]


def _call_pad(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    assert isinstance(source, Decoding)
    inputs = forward_inputs(source, pools.table, pools.page_size)
    padded = pad(inputs, [1, 2, 4, 8, 16]).unwrap()
    assert padded.num_real_rows == len(source.rows) <= padded.inputs.num_rows
    if len(source.rows) > 1:  # larger than every size: a Failure, nothing padded
        largest = len(source.rows) - 1
        assert pad(inputs, [largest]) == Failure(TooLargeToPad(len(source.rows), largest))
    return padded, pools, [source]


def _call_fill(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    assert isinstance(source, Idle | Extended | Decoding)
    return _fill_checked(source, pools), pools, [source]


def _call_fill_mixed(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    mixed, pools, live = _call_mix(source, None, pools)
    assert isinstance(mixed, Mixed)
    return _fill_checked(mixed, pools), pools, live


def _call_fill_verifying(
    source: Source, operand: Source, pools: Pools
) -> tuple[object, Pools, list[SlotHolder]]:
    assert isinstance(source, Decoding)
    window, pools = verify(source, [2] * len(source.rows), pools).unwrap()
    return _fill_checked(window, pools), pools, [window]


def _fill_checked(record: Record, pools: Pools) -> Padded:
    # A bucket one row and one token larger than the forward; one row smaller is a Failure.
    inputs = build(record, pools)
    rows, width = inputs.num_rows, max(inputs.page_table.device.shape[1], 1)
    sizes: dict[str, Any] = {"tokens": inputs.num_tokens + 1, "max_pages": width}
    buffers = GraphBuffers.allocate(CPU, pools.page_size, rows=rows + 1, **sizes)
    padded = fill_record(buffers, record, pools).unwrap()
    assert padded.num_real_rows == rows and padded.inputs.num_rows == rows + 1
    assert padded.inputs.seq_lens.host[:rows].tolist() == inputs.seq_lens.host.tolist()
    assert padded.inputs.page_table.device.data_ptr() == buffers.page_table.data_ptr()
    if rows > 1:  # a bucket too small: a Failure, nothing written
        small = GraphBuffers.allocate(CPU, pools.page_size, rows=rows - 1, **sizes)
        assert fill_record(small, record, pools) == Failure(DoesNotFit("rows", rows, rows - 1))
    return padded


CALLERS: dict[Callable[..., object], Caller] = {
    idle: _call_idle,
    extend: _call_extend,
    admit_prefilled: _call_prebuilt,
    decode: _call_decode,
    filter_batch: _call_filter,
    split: _call_split,
    merge: _call_merge,
    verify: _call_verify,
    sync: _call_sync,
    verify_ahead: _call_verify_ahead,  # type: ignore[dict-item]  # its records are not all Batch
    exact_window: _call_settle_ahead,  # type: ignore[dict-item]  # as above
    mix: _call_mix,  # type: ignore[dict-item]  # its records are not all Batch
    decode_sampled: _call_decode_sampled,  # type: ignore[dict-item]  # as above
    forward_inputs: _call_forward_inputs,  # type: ignore[dict-item]  # as above
    pad: _call_pad,  # type: ignore[dict-item]  # as above
    hybrid_inputs: _call_hybrid_inputs,  # type: ignore[dict-item]  # as above
    transfer_targets: _call_transfer_targets,  # type: ignore[dict-item]  # as above
    fill_hybrid_buffers: _call_fill_hybrid,  # type: ignore[dict-item]  # as above
    fill_buffers: _call_fill,  # type: ignore[dict-item]  # as above
}


def make_chunk(pools: Pools, first_rid: int) -> tuple[Chunked[Any], Pools]:
    """A request held between chunks: 8 of its 40 prompt tokens prefilled."""
    reqs = make_reqs([40], first_rid)
    if _PROBE[0]:
        probed, pools = mix(idle(CPU, Probe), reqs, 8, pools, (), make_probe([first_rid])).unwrap()
        _, (probed_chunk,) = finish_mixed(probed)
        return probed_chunk, pools
    mixed, pools = mix(idle(CPU), reqs, 8, pools).unwrap()
    _, (chunk,) = finish_mixed(mixed)
    return chunk, pools


def _row_id(row: Transition) -> str:
    source = row.source.__name__ if row.source else "none"
    operand = f"+{row.operand.__name__}" if row.operand else ""
    return f"{source}{operand}-{row.function.__name__}-{row.target.__name__}"


_LENGTHS = st.lists(st.integers(1, 40), min_size=1, max_size=5)


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("probe", [False, True], ids=["no-columns", "columns"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("row", TRANSITIONS, ids=_row_id)
@settings(max_examples=4, deadline=None)
@given(source_lengths=_LENGTHS, operand_lengths=_LENGTHS)
def test_transition_row(  # noqa: PLR0917  # pytest passes every parameter by name
    row: Transition,
    page_size: int,
    probe: bool,
    cache: bool,
    source_lengths: list[int],
    operand_lengths: list[int],
) -> None:
    """Each legal transition yields its target phase, and every invariant holds after it.

    With `probe`, every record carries a column set with one column of each
    kind, and every column of every output is checked on both sides. With
    `cache`, the pools share pages through their prefix cache.
    """
    _PROBE[0] = probe
    pools = make_test_pools(page_size, prefix_cache=cache)
    # make_phase builds mirrored phases only: sync's caller opens its window from a Decoding,
    # finish_mixed's mixes one from a Filtered.
    windows = {Verifying: Decoding, Mixed: Filtered, ForwardInputs: Decoding, WindowAhead: Decoding}
    phase = windows.get(row.source, row.source) if row.source is not None else None
    source, pools = (
        make_phase(phase, pools, source_lengths, probe=probe) if phase else (None, pools)
    )
    operand: Batch | Chunked | None = None
    if row.operand is Chunked:
        operand, pools = make_chunk(pools, first_rid=40)
    elif row.operand is not None and not issubclass(row.operand, Verifying):
        operand, pools = make_phase(row.operand, pools, operand_lengths, first_rid=20, probe=probe)
    holders_before: list[SlotHolder] = [source] if source is not None else []
    holders_before += [operand] if operand is not None else []
    unheld_before = set(find_leaks(pools, holders_before).unheld)  # make_phase drops rows
    caller = CALLERS.get(row.function)
    if row.function is finish_mixed:
        caller = _call_settle if row.target is Filtered else _call_settle_held  # type: ignore[assignment]  # as above
    if row.function is forward_inputs and row.source in (Mixed, Verifying):
        window = (
            _call_forward_inputs_mixed if row.source is Mixed else _call_forward_inputs_verifying
        )
        caller = window  # type: ignore[assignment]  # as above
    if row.function is fill_buffers and row.source in (Mixed, Verifying):
        filled = _call_fill_mixed if row.source is Mixed else _call_fill_verifying
        caller = filled  # type: ignore[assignment]  # as above
    assert caller is not None, f"add a caller for {row.function.__name__} to CALLERS"
    result, after, outputs = caller(source, operand, pools)  # type: ignore[arg-type]  # as above
    live: list[SlotHolder] = list(outputs)
    assert type(result) is row.target
    if probe:
        assert live, "the transition made no record to check"
        for holder in live:
            _assert_probe_of(holder)
    batches = [batch for batch in live if isinstance(batch, Idle | Extended | Decoding | Filtered)]
    for batch in batches:
        check_batch(batch, compare_device=True)
    check_pools(after, batches, compare_device=True)
    # Every slot the transition's inputs held is held by its outputs: nothing leaked.
    leaks = find_leaks(after, live)
    assert set(leaks.unheld) <= unheld_before, leaks
    assert not leaks.held_twice and not leaks.wrong_length, leaks
    if row.function is merge and source is not None and isinstance(operand, Filtered | Extended):
        assert len(result.rows) == len(source.rows) + len(operand.rows)
        assert result.rows.seq_lens_sum == source.rows.seq_lens_sum + operand.rows.seq_lens_sum


def _assert_probe_of(holder: object) -> None:
    # Every column of a record that holds rows, checked on both sides against its rids.
    if isinstance(holder, Chunked):
        assert_probe(holder.columns, [holder.req.rid])
    elif isinstance(holder, Verifying | WindowAhead):
        assert_probe(holder.columns, holder.rids.tolist())
    else:
        rows = holder.rows  # type: ignore[attr-defined]  # a batch or a Mixed
        assert_probe(rows.columns, rows.rids.tolist())
