"""Every transition's failure paths, with the prefix cache off and on, read nothing from the device.

The records live on the `meta` device (it holds no data) under the audit in
forbid mode, so a read anywhere on a path raises `DeviceReadError`. Each
case builds its inputs there too, and checks that the failure comes back as
the value (or the exception) the transition's contract names, and that the
pools it was given are unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import pytest
import torch
from returns.result import Failure

from batchstate import (
    BatchConflict,
    Chunked,
    ContextTooLong,
    Decoding,
    DraftError,
    EmptyExtend,
    EmptyPrompt,
    Filtered,
    NoChunkBudget,
    NotHeld,
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    PhaseError,
    Pools,
    Req,
    Sampled,
    StalePools,
    StillRunning,
    admit_prefilled,
    decode,
    decode_sampled,
    extend,
    finish_mixed,
    flush,
    idle,
    make_pools,
    mix,
    release,
    split,
    sync,
    verify,
)
from batchstate.audit import device_reads

META: Final = torch.device("meta")
PAGE: Final = 4


def _pools(cache: bool, *, slots: int = 8, context: int = 64, kv: int = 96) -> Pools:
    return make_pools(slots, context, kv, META, PAGE, prefix_cache=cache)


def _reqs(*lengths: int, first: int = 0) -> list[Req]:
    # Requests sharing their first tokens, so the cache has something to match.
    return [Req(first + i, tuple(range(1, 1 + n))) for i, n in enumerate(lengths)]


def _running(pools: Pools) -> tuple[Decoding[Any], Pools]:
    extended, pools = extend(idle(META), _reqs(9, 6, 11), pools).unwrap()
    return decode(extended, pools).unwrap()


def _chunk(pools: Pools) -> tuple[Chunked[Any], Filtered[Any], Pools]:
    mixed, pools = mix(idle(META), _reqs(30, first=40), 8, pools).unwrap()
    running, (held,) = finish_mixed(mixed)
    return held, running, pools


# Each case: (the pools it starts from, the call that fails given them).
Case = Callable[[Pools], object]


def _extend_nothing(pools: Pools) -> object:
    return extend(idle(META), [], pools)


def _extend_empty_prompt(pools: Pools) -> object:
    return extend(idle(META), [Req(0, ())], pools)


def _extend_too_long(pools: Pools) -> object:
    return extend(idle(META), _reqs(65), pools)


def _extend_no_slots(pools: Pools) -> object:
    return extend(idle(META), _reqs(*[2] * 9), pools)


def _extend_no_kv(pools: Pools) -> object:
    return extend(idle(META), _reqs(40, 40, 40), pools)


def _extend_chunk_not_held(pools: Pools) -> object:
    held, _, pools = _chunk(pools)
    return extend(idle(META), [Chunked(held.req, held.slot, held.cached + 1, gen=held.gen)], pools)


def _prebuilt_no_kv(pools: Pools) -> object:
    return admit_prefilled(idle(META), _reqs(40, 40, 40), pools)


def _decode_no_kv(pools: Pools) -> object:
    batch, pools = _running(pools)
    for _ in range(80):
        result = decode(batch, pools)
        if isinstance(result, Failure):
            return result
        batch, pools = result.unwrap()
    raise AssertionError("decode never ran out of KV")


def _mix_no_budget(pools: Pools) -> object:
    return mix(idle(META), _reqs(5), 0, pools)


def _mix_nothing(pools: Pools) -> object:
    return mix(idle(META), [], 8, pools)


def _mix_chunk_twice(pools: Pools) -> object:
    held, running, pools = _chunk(pools)
    _, pools = mix(running, [held], 8, pools, [1] * len(running.rows)).unwrap()
    return mix(idle(META), [held], 8, pools)  # the same chunk again: its slot holds more now


def _mix_no_slots(pools: Pools) -> object:
    return mix(idle(META), _reqs(*[2] * 9), 64, pools)


def _mix_no_kv(pools: Pools) -> object:
    return mix(idle(META), _reqs(40, 40, 40), 120, pools)


def _decode_sampled_too_long(pools: Pools) -> object:
    batch, pools = _running(pools)
    running = split(batch, [0, 1, 2]).kept
    sampled = Sampled.of(running.rows, torch.empty(3, dtype=torch.int64, device=META))
    for _ in range(80):
        result = decode_sampled(running, sampled, pools)
        if isinstance(result, Failure):
            return result
        mixed, pools = result.unwrap()
        running = finish_mixed(mixed).running
        sampled = Sampled.of(running.rows, torch.empty(3, dtype=torch.int64, device=META))
    raise AssertionError("decode_sampled never failed")


def _verify_too_long(pools: Pools) -> object:
    batch, pools = _running(pools)
    return verify(batch, [60, 0, 0], pools)


def _verify_no_kv(pools: Pools) -> object:
    batch, pools = _running(pools)
    return verify(batch, [40, 40, 0], pools)


def _release_still_running(pools: Pools) -> object:
    batch, pools = _running(pools)
    _, left = split(batch, [0, 2])
    return release(left, batch, pools)


def _release_twice(pools: Pools) -> object:
    batch, pools = _running(pools)
    kept, left = split(batch, [0, 2])
    pools = release(left, kept, pools).unwrap()
    return release(left, kept, pools)


def _release_chunk_after_it_finished(pools: Pools) -> object:
    held, running, pools = _chunk(pools)
    mixed, pools = mix(running, [held], 64, pools, [1] * len(running.rows)).unwrap()
    assert not mixed.partial
    return release(held, idle(META), pools)


def _release_window_twice(pools: Pools) -> object:
    batch, pools = _running(pools)
    window, pools = verify(batch, [2, 1, 0], pools).unwrap()
    pools = release(window, idle(META), pools).unwrap()
    return release(window, idle(META), pools)


FAILURES: Final[dict[str, tuple[Case, type[object]]]] = {
    "extend-nothing": (_extend_nothing, EmptyExtend),
    "extend-empty-prompt": (_extend_empty_prompt, EmptyPrompt),
    "extend-too-long": (_extend_too_long, ContextTooLong),
    "extend-no-slots": (_extend_no_slots, OutOfReqSlots),
    "extend-no-kv": (_extend_no_kv, OutOfKVTokens),
    "extend-chunk-not-held": (_extend_chunk_not_held, NotHeld),
    "prebuilt-no-kv": (_prebuilt_no_kv, OutOfKVTokens),
    "decode-no-kv": (_decode_no_kv, OutOfKVTokens),
    "mix-no-budget": (_mix_no_budget, NoChunkBudget),
    "mix-nothing": (_mix_nothing, EmptyExtend),
    "mix-chunk-twice": (_mix_chunk_twice, NotHeld),
    "mix-no-slots": (_mix_no_slots, OutOfReqSlots),
    "mix-no-kv": (_mix_no_kv, OutOfKVTokens),
    "decode-sampled-fails": (_decode_sampled_too_long, (OutOfKVTokens, ContextTooLong)),  # type: ignore[dict-item]  # either ends the run
    "verify-too-long": (_verify_too_long, ContextTooLong),
    "verify-no-kv": (_verify_no_kv, OutOfKVTokens),
    "release-still-running": (_release_still_running, StillRunning),
    "release-twice": (_release_twice, NotOwned),
    "release-finished-chunk": (_release_chunk_after_it_finished, NotOwned),
    "release-window-twice": (_release_window_twice, NotOwned),
}


def _state(pools: Pools) -> tuple[object, ...]:
    # What a failure must leave as it was: counts, the cache, and the host table.
    return (
        pools.num_free_slots,
        pools.num_free_tokens,
        pools.cache.num_pages,
        pools.cache.num_locked,
        dict(pools.prefixes),
        pools.slot_tokens.tolist(),
        pools.table.host.copy(),
    )


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("name", FAILURES)
def test_failure_paths_read_nothing(name: str, cache: bool) -> None:
    """Each failure comes back as its value, on meta, under a forbidding audit."""
    case, expected = FAILURES[name]
    given = _pools(cache)
    with device_reads(forbid=True) as log:
        result = case(given)
    assert isinstance(result, Failure), result
    assert isinstance(result.failure(), expected)
    assert log.report().count == 0


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize(
    "name", ["extend-no-kv", "mix-no-kv", "prebuilt-no-kv", "extend-no-slots", "mix-no-slots"]
)
def test_a_failure_leaves_the_pools_it_was_given(name: str, cache: bool) -> None:
    """The pools a failing call was handed read the same after it: nothing is lost.

    (The cases whose failing call is their first: the others' earlier calls
    rightly write the shared table.)
    """
    case, _ = FAILURES[name]
    pools = _pools(cache, kv=64)
    before = _state(pools)
    case(pools)
    after = _state(pools)
    assert after[:-1] == before[:-1]
    assert np.array_equal(after[-1], before[-1])  # type: ignore[arg-type]  # host tables


def _sync_refused(how: str) -> Case:
    # `sync` of a verify window on meta, handed counts on meta (reading them would raise):
    # each refusal must come before the read. `how` the call is wrong.
    def case(pools: Pools) -> object:
        batch, pools = _running(pools)
        other = copy.deepcopy(pools)  # another lineage: it never held the window
        window, after = verify(batch, [2, 2, 2], pools).unwrap()
        counts = torch.zeros(3, dtype=torch.int64, device=META)
        if how == "twice":
            _, after = sync(window, np.array([1, 0, 2]), after)  # host counts: no read
        given = {"stale": pools, "other": other, "twice": after}.get(how, after)
        if how == "shape":
            counts = counts[:2]
        elif how == "dtype":
            counts = counts.to(torch.float32)
        elif how == "device":
            counts = torch.zeros(3, dtype=torch.int64)  # on the CPU, the window on meta
        elif how == "host-range":
            return sync(window, np.array([3, 0, 0]), given)  # known on the host: no read
        elif how == "phase":
            return sync(batch, counts, given)  # type: ignore[arg-type]  # the contract under test
        return sync(window, counts, given)

    return case


BROKEN_CONTRACTS: Final[dict[str, tuple[Case, type[Exception], str]]] = {
    "decode-idle": (lambda p: decode(idle(META), p), PhaseError, "decode takes"),  # type: ignore[arg-type]  # the contract under test
    "decode-pools-swapped": (
        lambda p: decode(_running(p)[0], idle(META)),  # type: ignore[arg-type]  # as above
        TypeError,
        "expected Pools",
    ),
    "extend-from-running": (
        lambda p: extend(_running(p)[0], _reqs(3), p),  # type: ignore[call-overload]  # as above
        PhaseError,
        "extend starts from Idle",
    ),
    "mix-duplicate-rid": (
        lambda p: mix(idle(META), _reqs(3, 3)[:1] * 2, 8, p),
        BatchConflict,
        "rid",
    ),
    "release-pools-swapped": (
        lambda p: release(idle(META), idle(META), idle(META)),  # type: ignore[arg-type]  # as above
        TypeError,
        "expected Pools",
    ),
    "sync-stale-pools": (_sync_refused("stale"), StalePools, "these pools are stale"),
    "sync-pools-of-another-lineage": (
        _sync_refused("other"),
        DraftError,
        "the pools do not hold this batch's drafts",
    ),
    "sync-twice": (_sync_refused("twice"), DraftError, "the pools do not hold this batch's"),
    "sync-counts-short": (_sync_refused("shape"), DraftError, r"expected int32 or int64 \[3\]"),
    "sync-float-counts": (_sync_refused("dtype"), DraftError, "got torch.float32"),
    "sync-counts-elsewhere": (_sync_refused("device"), DraftError, "on cpu"),
    "sync-a-decode": (_sync_refused("phase"), PhaseError, "sync takes Verifying"),
    "sync-host-count-past-drafts": (
        _sync_refused("host-range"),
        DraftError,
        "row 0 accepted 3 of 2 drafts",
    ),
    "flush-a-batch": (lambda p: flush(idle(META)), TypeError, "expected Pools"),  # type: ignore[arg-type]  # as above
}


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("name", BROKEN_CONTRACTS)
def test_broken_contracts_raise_before_any_read(name: str, cache: bool) -> None:
    """A wrong kind of value raises the typed error its transition names, reading nothing.

    `sync`'s cases hand it counts on meta, which it would read if it got that far: every
    refusal that does not need the counts' values comes before the read. A count out of
    range needs them; handed on the host, it is refused with no read."""
    case, error, message = BROKEN_CONTRACTS[name]
    with device_reads(forbid=True) as log, pytest.raises(error, match=message):
        case(_pools(cache))
    assert log.report().count == 0
