"""Hostile inputs to every public function, as one table.

Each row builds real records and pools through the public API (or by hand,
where the row is about hand-built records), calls one function with one bad
input, and expects a specific exception or `Failure` whose message says
what was wrong. Every input is snapshotted first (every tensor, host and
device, the request-to-token table included) and must be unchanged after,
and every record and pool among the inputs must still pass its invariants.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple

import attrs
import numpy as np
import pytest
import torch
from returns.result import Failure

from batchstate import (
    Batch,
    BatchConflict,
    Chunked,
    ContextTooLong,
    Decoding,
    Departed,
    DeviceOnly,
    DraftError,
    EmptyExtend,
    EmptyPrompt,
    Extended,
    Filtered,
    FreeList,
    Idle,
    InvariantViolation,
    KeepIndicesError,
    Mirrored,
    NoColumns,
    NotHeld,
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    PhaseError,
    Pools,
    RecordShapeError,
    Req,
    Rows,
    Sampled,
    StalePools,
    StillRunning,
    TokenIdError,
    admit_prefilled,
    check_batch,
    check_pools,
    decode,
    extend,
    filter_batch,
    gather_sampled,
    idle,
    keep_indices,
    make_pools,
    merge,
    mix,
    release,
    sync,
    verify,
)
from batchstate.base.mirrored import frozen, host_int64
from tests.builders import (
    CPU,
    Probe,
    make_extended,
    make_phase,
    make_probe,
    make_reqs,
    make_test_pools,
)
from tests.strategies import assert_unchanged, snapshot

META: Final = torch.device("meta")

# A row's setup: the call to make, and every value it is handed (to snapshot and recheck).
Setup = tuple[Callable[[], object], tuple[object, ...]]


class Case(NamedTuple):
    """One hostile input: how to set it up, what must come back, what its message says."""

    setup: Callable[[], Setup]
    expected: type  # an exception class, or the class of the `Failure`'s value
    message: str  # a regex the message must match


def _make_running(page_size: int = 1) -> tuple[Decoding, Pools]:
    """A decoding batch of three rows (lengths 4, 6, 8 after the decode) and its pools."""
    batch, pools = make_phase(Decoding, make_test_pools(page_size))
    assert isinstance(batch, Decoding)
    return batch, pools


def _make_filtered() -> tuple[Filtered, Pools]:
    batch, pools = make_phase(Filtered, make_test_pools())
    assert isinstance(batch, Filtered)
    return batch, pools


def _make_rows(
    slots: list[int], lens: list[int], rids: list[int] | None = None, device: torch.device = CPU
) -> Rows:
    """Rows built by hand, as a caller without the transitions would."""
    rids = rids if rids is not None else list(range(len(slots)))
    return Rows.from_host(device, [Req(rid, (1,)) for rid in rids], slots, lens, NoColumns())


def _make_hand_rows(**changes: object) -> Rows:
    """Two consistent rows, then the fields in `changes` replaced (bypassing from_host)."""
    rows = _make_rows([1, 2], [3, 4])
    fields = {
        "device": rows.device,
        "reqs": rows.reqs,
        "rids": rows.rids,
        "gens": rows.gens,
        "req_pool_indices": rows.req_pool_indices,
        "seq_lens": rows.seq_lens,
        "orig_seq_lens": rows.orig_seq_lens,
        "seq_lens_sum": rows.seq_lens_sum,
        "max_seq_len": rows.max_seq_len,
    }
    fields.update(changes)
    return Rows(**fields)  # type: ignore[arg-type]  # rows built with wrong fields on purpose


def _call(function: Callable[..., object], *args: object) -> Setup:
    return (lambda: function(*args)), args


# ---- setups, one per row family -------------------------------------------------------------


def _wrong_phase(function: Callable[..., object], phase: type[Batch] | None) -> Callable[[], Setup]:
    def setup() -> Setup:
        pools = make_test_pools()
        batch: object = "not a batch"
        if phase is not None:
            batch, pools = make_phase(phase, pools)
        if function is extend or function is admit_prefilled:
            return _call(function, batch, make_reqs([3], first_rid=50), pools)
        if function is decode:
            return _call(decode, batch, pools)
        return _call(filter_batch, batch, [])

    return setup


def _merge_phases(running: type[Batch] | None, incoming: type[Batch] | None) -> Callable[[], Setup]:
    def setup() -> Setup:
        pools = make_test_pools()
        left: object = "not a batch"
        right: object = "not a batch"
        if running is not None:
            left, pools = make_phase(running, pools)
        if incoming is not None:
            right, pools = make_phase(incoming, pools, first_rid=20)
        return _call(merge, left, right)

    return setup


def _release_args(left_phase: type[Batch] | None, running_ok: bool) -> Callable[[], Setup]:
    def setup() -> Setup:
        batch, pools = _make_running()
        left: object = filter_batch(batch, [0]) if left_phase else pools
        running: object = filter_batch(batch, [1, 2]) if running_ok else "not a batch"
        return _call(release, left, running, pools)

    return setup


def _filter_keep(keep: object) -> Callable[[], Setup]:
    def setup() -> Setup:
        batch, _ = _make_running()
        return _call(filter_batch, batch, keep)

    return setup


def _keep_indices(keep: object, num_rows: int = 3) -> Callable[[], Setup]:
    return lambda: _call(keep_indices, keep, num_rows)


def _admit(
    inputs: Callable[[Pools], Sequence[Req | Chunked]],
    pools: Callable[[], Pools] = make_test_pools,
    function: Callable[..., object] = extend,
) -> Callable[[], Setup]:
    def setup() -> Setup:
        made = pools()
        return _call(function, idle(made.table.device.device), inputs(made), made)

    return setup


def _with_chunk(pools: Pools) -> tuple[Pools, int]:
    """Pools where request 7 owns a slot with 4 cached tokens, out of any batch."""
    batch, pools = extend(idle(CPU), [Req(7, (1, 2, 3, 4))], pools).unwrap()
    return pools, int(batch.rows.req_pool_indices.host[0])


def _continue(
    input_ids: tuple[int, ...], slot: int | None = None, cached: int = 4
) -> Callable[[], Setup]:
    def setup() -> Setup:
        pools, owned = _with_chunk(make_test_pools())
        at = owned if slot is None else slot
        item = Chunked(Req(7, input_ids), at, cached, gen=int(pools.slot_gens[owned]))
        return _call(extend, idle(CPU), [item], pools)

    return setup


def _continue_twice() -> Setup:
    pools, owned = _with_chunk(make_test_pools())
    gen = int(pools.slot_gens[owned])
    items = [
        Chunked(Req(7, (1,) * 6), owned, 4, gen=gen),
        Chunked(Req(8, (1,) * 6), owned, 4, gen=gen),
    ]
    return _call(extend, idle(CPU), items, pools)


def _one_slot_in_use() -> Setup:
    pools = make_test_pools(max_reqs=1)
    _, pools = make_extended(pools, [3])
    return _call(extend, idle(CPU), make_reqs([2], first_rid=9), pools)


def _decode_at_context() -> Setup:
    pools = make_test_pools(max_context_len=8)
    batch, pools = make_extended(pools, [3, 8])
    return _call(decode, batch, pools)


def _decode_out_of_kv(page_size: int) -> Callable[[], Setup]:
    def setup() -> Setup:
        pools = make_test_pools(page_size, num_kv_tokens=2 * page_size)
        lengths = [1, 1] if page_size == 1 else [page_size, page_size]
        batch, pools = make_extended(pools, lengths)
        return _call(decode, batch, pools)

    return setup


def _decode_on(batch_device: torch.device, pools_device: torch.device) -> Setup:
    batch, _ = make_extended(make_test_pools(device=batch_device), device=batch_device)
    return _call(decode, batch, make_test_pools(device=pools_device))


def _merge_shared(what: str) -> Setup:
    running, _ = _make_running()
    if what == "itself":
        return _call(merge, running, filter_batch(running, [1]))
    if what == "slot":
        # A hand-built batch that claims slot 2 under a new request id.
        return _call(merge, running, Filtered(_make_rows([2], [4], rids=[99])))
    return _call(merge, running, Filtered(_make_rows([15], [4], rids=[1])))  # rid 1 reused


def _merge_devices() -> Setup:
    running, _ = _make_running()
    return _call(merge, running, Filtered(_make_rows([9], [4], rids=[99], device=META)))


def _release_twice() -> Setup:
    batch, pools = _make_running()
    left, running = filter_batch(batch, [0]), filter_batch(batch, [1, 2])
    pools = release(left, running, pools).unwrap()
    return _call(release, left, running, pools)


def _release_running() -> Setup:
    batch, pools = _make_running()
    return _call(release, filter_batch(batch, [1]), batch, pools)


def _release_unowned(slots: list[int]) -> Callable[[], Setup]:
    def setup() -> Setup:
        _, pools = _make_running()
        left = Filtered(_make_rows(slots, [1] * len(slots), rids=[90 + i for i in slots]))
        return _call(release, left, idle(CPU), pools)

    return setup


def _release_departed(slots: list[int]) -> Callable[[], Setup]:
    def setup() -> Setup:
        _, pools = _make_running()
        reqs = tuple(Req(90 + i, (1,)) for i in range(len(slots)))
        ones = host_int64([1] * len(slots))
        left = Departed(reqs, host_int64(slots), ones, gens=host_int64([1] * len(slots)))
        return _call(release, left, idle(CPU), pools)

    return setup


def _hand_record(build: Callable[[], object]) -> Callable[[], Setup]:
    return lambda: ((build), ())


def _extended_with(**changes: object) -> Callable[[], object]:
    def build() -> object:
        batch, _ = make_extended(make_test_pools())
        fields = {
            "rows": batch.rows,
            "input_ids": batch.input_ids,
            "out_cache_loc": batch.out_cache_loc,
            "prefix_lens": batch.prefix_lens,
            "extend_lens": batch.extend_lens,
            "extend_num_tokens": batch.extend_num_tokens,
        }
        fields.update(changes)
        return Extended(**fields)  # type: ignore[arg-type]  # wrong fields on purpose

    return build


def _decoding_with(out_cache_loc: DeviceOnly) -> Callable[[], object]:
    def build() -> object:
        batch, _ = _make_running()
        return Decoding(batch.rows, out_cache_loc)

    return build


def _check(value: Callable[[], tuple[object, ...]]) -> Callable[[], Setup]:
    """Call check_batch (one batch) or check_pools (pools and a list of batches) on `value`."""

    def setup() -> Setup:
        made = value()
        first = made[0]
        if isinstance(first, Pools):
            batches = made[1]
            assert isinstance(batches, list)
            return (lambda: check_pools(first, batches, compare_device=True)), made
        assert isinstance(first, Idle | Extended | Decoding | Filtered)
        return (lambda: check_batch(first, compare_device=True)), made

    return setup


def _pools_sharing_a_page() -> tuple[object, ...]:
    batch, pools = _make_running()
    free_pages = np.concatenate((pools.free_pages, pools.table.host[1, :1].astype(np.int64)))
    return (
        attrs.evolve(pools, page_list=FreeList.of(free_pages)),
        [batch],
    )


def _pools_behind_the_batch() -> tuple[object, ...]:
    extended, pools = make_extended(make_test_pools())
    return pools, [decode(extended, pools).unwrap().batch]  # the pools from before the decode


def _table_out_of_sync() -> tuple[object, ...]:
    batch, pools = _make_running()
    pools.table.device[1, 40] = 7  # NOTE: a caller writing one side of the table by hand
    return pools, [batch]


def _i(value: int) -> torch.Tensor:
    return torch.tensor([value])


def _take(index: list[int]) -> Callable[[], Setup]:
    # Three rows built by hand, taken at a full-length `index` (the in-order shortcut's size).
    return lambda: _call(Rows.take, _make_rows([1, 2, 3], [3, 4, 5]), np.array(index))


def _mix_tokens(tokens: list[int]) -> Callable[[], Setup]:
    # A mixed step of the running rows alone, fed `tokens` from the host.
    def setup() -> Setup:
        batch, pools = _make_filtered()
        return _call(mix, batch, [], 4, pools, tokens)

    return setup


def _follow_from(device: torch.device) -> Setup:
    # Tokens on `device` followed to a cpu batch's rows (in order: the shortcut's case).
    batch, _ = _make_filtered()
    tokens = torch.zeros(len(batch.rows), dtype=torch.int64, device=device)
    return _call(gather_sampled, Sampled(batch.rows.rids, DeviceOnly(tokens)), batch)


def _column_out_of_sync() -> tuple[object, ...]:
    pools = make_test_pools()
    batch, pools = extend(idle(CPU, Probe), make_reqs([3, 4]), pools, make_probe([0, 1])).unwrap()
    batch.rows.columns.weight.device[1] = 99.0  # NOTE: one side of a mirrored column, by hand
    return (Filtered(batch.rows),)


def _window_on_meta(how: str) -> Setup:
    # A verify window on meta, synced with meta counts (a read would raise): `how` the pools
    # are wrong. Each refusal must come before the counts are read.
    pools = make_test_pools(device=META)
    extended, pools = extend(idle(META), make_reqs([3, 4]), pools).unwrap()
    decoding, pools = decode(extended, pools).unwrap()
    other = copy.deepcopy(pools)  # another lineage, holding no window
    window, after = verify(decoding, [2, 1], pools).unwrap()
    counts = torch.zeros(2, dtype=torch.int64, device=META)
    if how == "synced":
        _, after = sync(window, np.array([2, 1]), after)  # the window is consumed
    given = {"stale": pools, "other": other, "synced": after}[how]
    return _call(sync, window, counts, given)


HOSTILE: Final = {
    # ---- wrong phases, for callers without mypy ----
    "extend-from-extended": Case(
        _wrong_phase(extend, Extended), PhaseError, r"extend starts from Idle, got Extended"
    ),  # a scheduler re-extending a batch already extended
    "extend-from-a-string": Case(
        _wrong_phase(extend, None), PhaseError, r"starts from Idle, got str"
    ),  # not a batch at all
    "prebuilt-from-filtered": Case(
        _wrong_phase(admit_prefilled, Filtered),
        PhaseError,
        r"admit_prefilled starts from Idle, got Filtered",
    ),  # admit_prefilled admits into nothing
    "decode-idle": Case(
        _wrong_phase(decode, Idle), PhaseError, r"decode takes .* got Idle"
    ),  # idle batches reaching decode crashed DP ranks
    "decode-a-string": Case(
        _wrong_phase(decode, None), PhaseError, r"decode takes .* got str"
    ),  # not a batch at all
    "filter-idle": Case(
        _wrong_phase(filter_batch, Idle), PhaseError, r"filter_batch takes .* got Idle"
    ),  # Idle has no rows to keep
    "merge-into-extended": Case(
        _merge_phases(Extended, Filtered), PhaseError, r"merge appends to .* got Extended"
    ),  # an extend forward has not run yet: nothing to append to
    "merge-decoding-in": Case(
        _merge_phases(Filtered, Decoding),
        PhaseError,
        r"merge appends Extended or Filtered, got Decoding",
    ),  # the incoming side must be between steps
    "merge-idle-in": Case(
        _merge_phases(Filtered, Idle), PhaseError, r"got Idle"
    ),  # Idle incoming: use the running batch as it is
    "merge-a-string": Case(
        _merge_phases(None, Filtered), PhaseError, r"got str"
    ),  # not a batch at all
    "release-pools-as-left": Case(
        _release_args(None, running_ok=True), PhaseError, r"release .*got Pools"
    ),  # arguments swapped by a caller without mypy
    "release-string-running": Case(
        _release_args(Filtered, running_ok=False), PhaseError, r"release .*got str"
    ),  # the running batch is not a batch
    # ---- keep indices: wrong types, devices, ranges ----
    "keep-out-of-range": Case(
        _filter_keep([0, 3]), KeepIndicesError, r"keep index 3 is out of range for 3 rows"
    ),  # one past the last row
    "keep-duplicate": Case(
        _filter_keep([1, 1]), KeepIndicesError, r"a duplicate at position 1 \(1 then 1\)"
    ),  # a row kept twice would own its slot twice
    "keep-unsorted": Case(
        _filter_keep([2, 0]), KeepIndicesError, r"out of order at position 1 \(2 then 0\)"
    ),  # rows must stay in order
    "keep-negative": Case(
        _filter_keep([-1, 0]), KeepIndicesError, r"keep index -1 is negative"
    ),  # Python's negative indexing must not apply
    "keep-huge": Case(
        _filter_keep([0, 2**70]), KeepIndicesError, r"keep indices must fit in int64: int too big"
    ),  # past int64: was an OverflowError from array('q')
    "keep-float-list": Case(
        _filter_keep([0.0]), KeepIndicesError, r"keep indices must be integers.*float"
    ),  # floats are not positions
    "keep-bool-list": Case(
        _filter_keep([True]), KeepIndicesError, r"got a bool"
    ),  # a mask is not a list of positions
    "keep-none-in-list": Case(
        _filter_keep([0, None]), KeepIndicesError, r"integers.*NoneType"
    ),  # a hole in the caller's list
    "keep-float-tensor": Case(
        _filter_keep(torch.tensor([0.0, 1.0])), KeepIndicesError, r"integers, got torch.float32"
    ),  # a float tensor of positions
    "keep-bool-tensor": Case(
        _filter_keep(torch.tensor([True, False, True])), KeepIndicesError, r"got torch.bool"
    ),  # a mask tensor is not positions (torch would index by mask)
    "keep-2d-tensor": Case(
        _filter_keep(torch.tensor([[0, 1]])), KeepIndicesError, r"must be 1-D, got shape \[1, 2\]"
    ),  # a batch of keep lists
    "keep-on-device": Case(
        _filter_keep(torch.tensor([0], device=META)), KeepIndicesError, r"on the CPU, got meta"
    ),  # reading device indices would sync
    "keep-indices-out-of-range": Case(
        _keep_indices(_i(5), 5), KeepIndicesError, r"keep index 5 is out of range for 5 rows"
    ),  # the public checker, a tensor one past the end
    "keep-indices-any-for-zero-rows": Case(
        _keep_indices([0], 0), KeepIndicesError, r"out of range for 0 rows"
    ),  # an empty batch keeps nothing
    "rows-take-out-of-order": Case(
        _take([2, 0, 1]),
        KeepIndicesError,
        r"Rows.take: positions must be strictly increasing: out of order at position 1"
        r" \(2 then 0\)",
    ),  # a full-length index: the shortcut returned the rows as they were
    "rows-take-out-of-range": Case(
        _take([0, 1, 3]), KeepIndicesError, r"Rows.take: position 3 is out of range for 3 rows"
    ),  # the same shortcut, past the last row
    "rows-take-a-list": Case(
        lambda: _call(Rows.take, _make_rows([1, 2], [3, 4]), [0, 1]),
        KeepIndicesError,
        r"Rows.take: expected a 1-D integer numpy array, got list",
    ),  # positions must be host int64 (filter_batch takes lists)
    # ---- admission: empty, too long, full, conflicting ----
    "extend-no-requests": Case(
        _admit(lambda pools: []), EmptyExtend, r"at least one request"
    ),  # an empty extend would build an Extended with nothing to run
    "prebuilt-no-requests": Case(
        _admit(lambda pools: [], function=admit_prefilled), EmptyExtend, r"at least one request"
    ),  # the same through admit_prefilled
    "extend-empty-prompt": Case(
        _admit(lambda pools: [*make_reqs([3]), Req(5, ())]),
        EmptyPrompt,
        r"request 5 has nothing to extend: 0 input ids",
    ),  # an empty prompt after a good one: the good one must not be admitted alone
    "extend-too-long": Case(
        _admit(lambda pools: make_reqs([65])),
        ContextTooLong,
        r"request 0 needs 65 tokens of context, the table holds 64",
    ),  # one past the table's width
    "prebuilt-too-long": Case(
        _admit(lambda pools: make_reqs([2, 65]), function=admit_prefilled),
        ContextTooLong,
        r"request 1 needs 65",
    ),  # the same through admit_prefilled
    "extend-negative-token": Case(
        _admit(lambda pools: [Req(0, (5, -7, 9))]),
        TokenIdError,
        r"request 0: input id -7 at position 1 is negative: token ids are >= 0",
    ),  # an embedding would read out of range
    "admit-prefilled-negative-token": Case(
        _admit(lambda pools: [Req(0, (5, 6)), Req(1, (-1,))], function=admit_prefilled),
        TokenIdError,
        r"request 1: input id -1 at position 0 is negative",
    ),  # the same through admit_prefilled
    "mix-negative-running-token": Case(
        _mix_tokens([1, -2]),
        TokenIdError,
        r"running row 1's input token -2 is negative",
    ),  # a decode row's token, from the host
    "extend-duplicate-rid": Case(
        _admit(lambda pools: [Req(3, (1,)), Req(3, (2,))]),
        BatchConflict,
        r"the same rid appears twice among the requests: \[3\]",
    ),  # two requests with one id
    "chunk-nothing-new": Case(
        _continue((1, 2, 3, 4)),
        EmptyPrompt,
        r"request 7 has nothing to extend: 4 input ids, 4 already",
    ),  # a chunk continuation with no new tokens
    "chunk-shorter-than-cache": Case(
        _continue((1, 2)), EmptyPrompt, r"2 input ids, 4 already cached"
    ),  # a continuation that forgot its prefix
    "chunk-free-slot": Case(
        _continue((1,) * 6, slot=5),
        NotHeld,
        r"^request 7 is not held in slot 5: the chunk says 4 cached tokens, the pools hold 0$",
    ),  # a slot nobody owns
    "chunk-padding-slot": Case(
        _continue((1,) * 6, slot=0), NotHeld, r"in slot 0: .* the pools hold 0$"
    ),  # row 0 of the table is padding
    "chunk-negative-slot": Case(
        _continue((1,) * 6, slot=-1), NotHeld, r"in slot -1: .* the pools hold 0$"
    ),  # Python's negative indexing must not reach slot_tokens[-1]
    "chunk-past-max-slot": Case(
        _continue((1,) * 6, slot=17), NotHeld, r"in slot 17: .* the pools hold 0$"
    ),  # one past max_reqs
    "chunk-held-at-another-count": Case(
        _continue((1,) * 6, cached=3), NotHeld, r"says 3 cached tokens, the pools hold 4$"
    ),  # a stale chunk: its slot holds more than it says
    "chunk-slot-twice": Case(
        _continue_twice, BatchConflict, r"the same slot appears twice among the requests: \[1\]"
    ),  # two continuations into one slot
    "extend-zero-kv-pool": Case(
        _admit(lambda pools: make_reqs([3]), lambda: make_pools(2, 32, 0, CPU, 16)),
        OutOfKVTokens,
        r"1 pages of 16 requested, 0 free",
    ),  # a zero-size KV pool
    "extend-one-slot-pool": Case(
        _admit(lambda pools: make_reqs([3, 3]), lambda: make_pools(1, 32, 64, CPU)),
        OutOfReqSlots,
        r"2 requested, 1 free",
    ),  # two requests, one slot: neither is admitted
    "extend-one-slot-in-use": Case(
        _one_slot_in_use, OutOfReqSlots, r"1 requested, 0 free"
    ),  # the only slot is taken
    "extend-kv-short-by-one-page": Case(
        _admit(lambda pools: make_reqs([16, 17]), lambda: make_pools(4, 64, 32, CPU, 16)),
        OutOfKVTokens,
        r"3 pages of 16 requested, 2 free",
    ),  # slots succeed, KV does not: the slots must not be taken
    "extend-batch-on-other-device": Case(
        lambda: _call(extend, idle(META), make_reqs([3]), make_test_pools()),
        BatchConflict,
        r"batch is on meta.*pools.* on cpu",
    ),  # was silently written to the host table only
    # ---- decode ----
    "decode-at-context": Case(
        _decode_at_context,
        ContextTooLong,
        r"request 1 needs 9 tokens of context, the table holds 8",
    ),  # the longest row is at the table's width
    "decode-out-of-kv-page-1": Case(
        _decode_out_of_kv(1), OutOfKVTokens, r"2 pages of 1 requested, 0 free"
    ),  # every row needs a token, none is free
    "decode-out-of-kv-page-16": Case(
        _decode_out_of_kv(16), OutOfKVTokens, r"2 pages of 16 requested, 0 free"
    ),  # every row starts a new page at once
    "decode-pools-on-other-device": Case(
        lambda: _decode_on(CPU, META), BatchConflict, r"batch is on cpu.*pools.* on meta"
    ),  # was written to the host table only
    # ---- overlap: tokens left on the device ----
    "gather-sampled-tokens-on-meta": Case(
        lambda: _follow_from(META),
        BatchConflict,
        r"sampled tokens on meta, the batch on cpu",
    ),  # the in-order shortcut handed them back as they were; join_sampled refused them
    # ---- speculative sync: refused before the counts are read (meta counts: a read raises) ----
    "sync-stale-pools": Case(
        lambda: _window_on_meta("stale"), StalePools, r"these pools are stale"
    ),  # the pools from before verify
    "sync-pools-of-another-lineage": Case(
        lambda: _window_on_meta("other"),
        DraftError,
        r"the pools do not hold this batch's drafts",
    ),  # a copy that never held the window
    "sync-twice": Case(
        lambda: _window_on_meta("synced"),
        DraftError,
        r"the pools do not hold this batch's drafts",
    ),  # the window consumed already
    # ---- merge ----
    "merge-itself": Case(
        lambda: _merge_shared("itself"), BatchConflict, r"request ids \[1\] are in both batches"
    ),  # a row merged back into the batch it never left
    "merge-shared-slot": Case(
        lambda: _merge_shared("slot"), BatchConflict, r"request slots \[2\] are in both batches"
    ),  # two requests claiming one slot
    "merge-shared-rid": Case(
        lambda: _merge_shared("rid"), BatchConflict, r"request ids \[1\] are in both batches"
    ),  # one request in two slots
    "merge-devices": Case(
        _merge_devices, BatchConflict, r"cannot merge a batch on meta into one on cpu"
    ),  # sides on different devices
    # ---- release ----
    "release-twice": Case(
        _release_twice, NotOwned, r"request slots \[1\] are not owned: already released"
    ),  # a double free
    "release-still-running": Case(
        _release_running, StillRunning, r"request slots \[2\] are still in the running batch"
    ),  # freeing memory a running row still uses
    "release-never-allocated": Case(
        _release_unowned([9]), NotOwned, r"\[9\] are not owned"
    ),  # a hand-built record with a free slot
    "release-padding-slot": Case(
        _release_departed([0]), NotOwned, r"\[0\] are not owned"
    ),  # slot 0 is padding
    "rows-padding-slot": Case(
        _hand_record(lambda: _make_rows([0], [1])),
        RecordShapeError,
        r"slot 0 is padding \(0\) or negative",
    ),  # a row on the padding slot
    "rows-negative-slot": Case(
        _hand_record(lambda: _make_rows([2, -1], [1, 1])),
        RecordShapeError,
        r"slot -1 is padding \(0\) or negative",
    ),  # numpy would read a negative slot from the end of the pools
    "release-same-slot-twice": Case(
        _release_unowned([1, 1]), NotOwned, r"\[1, 1\]"
    ),  # one slot on two rows of a hand-built record
    # ---- pools ----
    "pools-zero-reqs": Case(
        lambda: _call(make_pools, 0, 8, 8, CPU), ValueError, r"max_reqs must be >= 1, got 0"
    ),  # no slot at all
    "pools-zero-context": Case(
        lambda: _call(make_pools, 1, 0, 8, CPU), ValueError, r"max_context_len must be >= 1, got 0"
    ),  # a table with no columns
    "pools-zero-page": Case(
        lambda: _call(make_pools, 1, 8, 8, CPU, 0), ValueError, r"page_size must be >= 1, got 0"
    ),  # division by a zero page
    "pools-negative-kv": Case(
        lambda: _call(make_pools, 1, 8, -16, CPU, 16), ValueError, r"non-negative multiple.*-16"
    ),  # a negative pool
    "pools-ragged-kv": Case(
        lambda: _call(make_pools, 1, 8, 20, CPU, 16), ValueError, r"multiple of page_size=16"
    ),  # a part page
    "mirror-from-device": Case(
        lambda: _call(Mirrored.from_host, torch.zeros(2, device=META), CPU),
        ValueError,
        r"must be a 1-D numpy array, got Tensor",
    ),  # a mirror built from the device side would need a sync
    # ---- records built by hand ----
    "rows-short-rids": Case(
        _hand_record(lambda: _make_hand_rows(rids=host_int64([0, 1, 2]))),
        RecordShapeError,
        r"Rows.rids: expected a read-only int64 array \[2\], got a read-only int64 array \[3\]",
    ),  # a column one row too long
    "rows-torch-rids": Case(
        _hand_record(lambda: _make_hand_rows(rids=torch.tensor([0, 1]))),
        RecordShapeError,
        r"Rows.rids: expected a read-only int64 array \[2\], got Tensor",
    ),  # a host column that is not numpy
    "rows-writable-rids": Case(
        _hand_record(lambda: _make_hand_rows(rids=np.array([0, 1]))),
        RecordShapeError,
        r"Rows.rids: expected a read-only int64 array \[2\], got a writable int64 array",
    ),  # a host column that could be changed without its device side
    "rows-int32-lens": Case(
        _hand_record(
            lambda: _make_hand_rows(
                seq_lens=Mirrored.from_host(np.array([3, 4], dtype=np.int32), CPU)
            )
        ),
        RecordShapeError,
        r"seq_lens.host: expected a read-only int64 array \[2\], got a read-only int32",
    ),  # a wrong dtype on both sides
    "rows-device-on-meta": Case(
        _hand_record(lambda: _make_hand_rows(req_pool_indices=Mirrored.from_ints([1, 2], META))),
        RecordShapeError,
        r"req_pool_indices.device: expected .* on cpu, got .* on meta",
    ),  # a device side on another device
    "rows-no-reqs": Case(
        _hand_record(lambda: _make_hand_rows(reqs=())),
        RecordShapeError,
        r"expected a read-only int64 array \[0\]",
    ),  # zero requests but stale rows
    "idle-with-rows": Case(
        _hand_record(lambda: Idle(_make_rows([1], [3]))),
        RecordShapeError,
        r"Idle holds no rows, got 1",
    ),  # Idle is the empty batch
    "extended-short-prefix-lens": Case(
        _hand_record(_extended_with(prefix_lens=frozen(np.zeros(2, dtype=np.int64)))),
        RecordShapeError,
        r"Extended.prefix_lens: expected a read-only int64 array \[3\], got",
    ),  # host columns of the wrong length
    "extended-prefix-lens-as-a-tuple": Case(
        _hand_record(_extended_with(prefix_lens=(0, 0, 0))),
        RecordShapeError,
        r"Extended.prefix_lens: expected a read-only int64 array \[3\], got tuple",
    ),  # a host column must be a read-only array, as Mixed's are
    "extended-short-locs": Case(
        _hand_record(_extended_with(out_cache_loc=DeviceOnly(torch.zeros(14, dtype=torch.int64)))),
        RecordShapeError,
        r"out_cache_loc: expected int64 \[15\] on cpu, got torch.int64 \[14\] on cpu",
    ),  # one location short of the tokens
    "extended-ids-on-meta": Case(
        _hand_record(
            _extended_with(input_ids=DeviceOnly(torch.zeros(15, dtype=torch.int64, device=META)))
        ),
        RecordShapeError,
        r"input_ids: expected .* on cpu, got .* on meta",
    ),  # a device column on another device than the rows
    "decoding-short-locs": Case(
        _hand_record(_decoding_with(DeviceOnly(torch.zeros(2, dtype=torch.int64)))),
        RecordShapeError,
        r"expected int64 \[3\] on cpu, got torch.int64 \[2\] on cpu",
    ),  # a location missing for one row
    "decoding-int32-locs": Case(
        _hand_record(_decoding_with(DeviceOnly(torch.zeros(3, dtype=torch.int32)))),
        RecordShapeError,
        r"got torch.int32 \[3\]",
    ),  # the wrong dtype
    "decoding-locs-on-meta": Case(
        _hand_record(_decoding_with(DeviceOnly(torch.zeros(3, dtype=torch.int64, device=META)))),
        RecordShapeError,
        r"expected .* on cpu, got .* on meta",
    ),  # out_cache_loc on another device than the rows
    # ---- invariant checks on values broken by hand ----
    "check-wrong-sum": Case(
        _check(lambda: (Filtered(_make_hand_rows(seq_lens_sum=8)),)),
        InvariantViolation,
        r"seq_lens_sum=8, seq_lens sum to 7",
    ),  # a derived value out of step
    "check-wrong-rids": Case(
        _check(lambda: (Filtered(_make_hand_rows(rids=host_int64([5, 6]))),)),
        InvariantViolation,
        r"rids differ from the reqs' rids",
    ),  # the rid column out of step with the requests
    "check-page-free-and-owned": Case(
        _check(_pools_sharing_a_page),
        InvariantViolation,
        r"KV pages: .* owned twice or lost",
    ),  # a page both free and owned
    "check-pools-behind": Case(
        _check(_pools_behind_the_batch),
        StalePools,
        r"these pools are stale",
    ),  # a batch checked against pools it does not belong to
    "check-table-out-of-sync": Case(
        _check(_table_out_of_sync), InvariantViolation, r"table: host != device"
    ),  # one side of the table written alone
    "check-column-out-of-sync": Case(
        _check(_column_out_of_sync),
        InvariantViolation,
        r"columns.weight: host mirror != device",
    ),  # compare_device compared the slots and lengths only
}


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_input(case: Case) -> None:
    """A hostile input gets its specific error and message, and changes nothing it was handed."""
    call, inputs = case.setup()
    before = snapshot(inputs)
    if not attrs.has(case.expected):  # an exception; a failure value is an attrs record
        with pytest.raises(case.expected) as raised:
            call()
        assert type(raised.value) is case.expected
        message = str(raised.value)
    else:
        result = call()
        assert isinstance(result, Failure), f"expected Failure({case.expected.__name__}): {result}"
        assert type(result.failure()) is case.expected
        message = str(result.failure())
    assert re.search(case.message, message), f"{message!r} does not match {case.message!r}"
    assert_unchanged(before, inputs)
    if case.expected not in {InvariantViolation, StalePools}:
        _assert_still_valid(inputs)  # stale pools stay stale: nothing to check them with


def _assert_still_valid(inputs: tuple[object, ...]) -> None:
    batches = [
        value for value in inputs if isinstance(value, Idle | Extended | Decoding | Filtered)
    ]
    for batch in batches:
        if batch.device.type != "meta":
            check_batch(batch, compare_device=True)
    for pools in (value for value in inputs if isinstance(value, Pools)):
        meta = pools.table.device.device.type == "meta"
        check_pools(pools, compare_device=not meta)
