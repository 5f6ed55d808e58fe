"""A generated hostile-input table: every public function x every kind of bad argument.

`LEGAL` holds one legal call per public function of `batchstate.__all__`
and per public `Pools` method (a test asserts none is missing). Each case
swaps one argument of one legal call for one bad value, with the prefix
cache off and on, snapshots every input bit for bit (host arrays, device
tensors, pools fields), and expects a typed refusal: a `Failure`, an
exception batchstate defines, or a `TypeError` / `ValueError` whose message
names the argument or the bad value's type. A raw `AttributeError`,
`KeyError` or numpy error fails the case, as does any change to an input.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Final

import numpy as np
import pytest
import torch
from returns.result import Failure, Success

import batchstate
from batchstate import (
    SGLANG_PAD_VALUES,
    GraphBuffers,
    HybridBuffers,
    MemoryKinds,
    Pools,
    RecurrentState,
    Req,
    Sampled,
    Sampling,
    SlidingWindow,
    accepted_states,
    admit_prefilled,
    build_columns,
    captured_size,
    check_batch,
    check_forward,
    check_leaks,
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
    flush,
    forward_inputs,
    gather_sampled,
    hybrid_inputs,
    idle,
    join_sampled,
    keep_indices,
    make_pools,
    merge,
    mix,
    pad,
    read_sampled,
    read_verified,
    release,
    split,
    sync,
    transfer_targets,
    unpad,
    unpad_tokens,
    unwrap,
    verify,
    verify_ahead,
)
from batchstate.base.mirrored import host_int64
from tests.strategies import assert_unchanged, snapshot

CPU: Final = torch.device("cpu")
Call = tuple[Callable[..., object], list[object]]


def _pools(cache: bool) -> Pools:
    return make_pools(8, 64, 256, CPU, 4, prefix_cache=cache)


def _running(cache: bool):  # type: ignore[no-untyped-def]  # (Decoding, Pools)
    extended, pools = extend(idle(CPU), [Req(0, (1, 2, 3)), Req(1, (4, 5))], _pools(cache)).unwrap()
    return decode(extended, pools).unwrap()


def _filtered(cache: bool):  # type: ignore[no-untyped-def]  # (Filtered, Pools)
    batch, pools = _running(cache)
    return filter_batch(batch, [0, 1]), pools


def _sampled(cache: bool) -> Call:
    batch, _ = _filtered(cache)
    return Sampled.of(batch.rows, torch.tensor([7, 8])), batch  # type: ignore[return-value]


def _padded(cache: bool):  # type: ignore[no-untyped-def]
    batch, pools = _running(cache)
    return pad(forward_inputs(batch, pools.table, pools.page_size), [4]).unwrap()


def _window(cache: bool):  # type: ignore[no-untyped-def]
    batch, pools = _running(cache)
    return verify(batch, [1, 0], pools).unwrap()


def _mixed(cache: bool):  # type: ignore[no-untyped-def]
    return mix(idle(CPU), [Req(0, tuple(range(1, 20)))], 8, _pools(cache)).unwrap()


def _two_sampled(cache: bool) -> tuple[Sampled, Sampled]:
    batch, _ = _filtered(cache)
    first = Sampled.of(batch.rows.gather(host_int64([0])), torch.tensor([7]))
    return first, Sampled.of(batch.rows.gather(host_int64([1])), torch.tensor([8]))


def _two_batches(cache: bool):  # type: ignore[no-untyped-def]
    batch, _ = _filtered(cache)
    return filter_batch(batch, [0]), filter_batch(batch, [1])


def _allocated(cache: bool) -> tuple[np.ndarray, Pools]:
    slots, pools = _pools(cache).allocate_slots(2).unwrap()
    return slots, pools.allocate_fresh(slots, [3, 5]).unwrap().pools


def _columns(cache: bool) -> Call:
    names = ("temperature", "top_p", "top_k", "min_p", "seed")
    return build_columns, [Sampling, {name: [0] for name in names}, CPU]


def _leaks(function: Callable[..., object]) -> Callable[[bool], Call]:
    def legal(cache: bool) -> Call:
        batch, pools = _running(cache)
        return function, [pools, [batch]]

    return legal


def _decode_sampled(cache: bool) -> Call:
    batch, pools = _filtered(cache)
    return decode_sampled, [batch, Sampled.of(batch.rows, torch.tensor([7, 8])), pools]


def _forward(cache: bool) -> Call:
    batch, pools = _running(cache)
    return forward_inputs, [batch, pools.table, pools.page_size]


def _hybrid(cache: bool) -> Call:
    kinds = MemoryKinds((SlidingWindow(4, 64), RecurrentState(8, 4)))
    pools = make_pools(8, 64, 256, CPU, 4, prefix_cache=cache, memory=kinds)
    extended, pools = extend(idle(CPU), [Req(0, (1, 2, 3)), Req(1, (4, 5))], pools).unwrap()
    batch, pools = decode(extended, pools).unwrap()
    return hybrid_inputs, [forward_inputs(batch, pools.table, pools.page_size), pools]


def _fill_hybrid_buffers(cache: bool) -> Call:
    # A padded extend on hybrid pools, into its bucket's window and state buffers.
    kinds = MemoryKinds((SlidingWindow(4, 64), RecurrentState(8, 4)))
    pools = make_pools(8, 64, 256, CPU, 4, prefix_cache=cache, memory=kinds)
    batch, pools = extend(idle(CPU), [Req(0, tuple(range(9))), Req(1, (4, 5))], pools).unwrap()
    padded = pad(forward_inputs(batch, pools.table, pools.page_size), [16]).unwrap()
    buffers = HybridBuffers.allocate(CPU, kinds, rows=2, tokens=16, window_pages=32)
    return fill_hybrid_buffers, [buffers, padded.inputs, pools]


def _transfer(cache: bool) -> Call:
    # A prebuilt batch on hybrid pools: where its transferred memory goes.
    kinds = MemoryKinds((SlidingWindow(4, 64), RecurrentState(8, 4)))
    pools = make_pools(8, 64, 256, CPU, 4, prefix_cache=cache, memory=kinds)
    batch, pools = admit_prefilled(
        idle(CPU), [Req(0, tuple(range(9))), Req(1, (4, 5))], pools
    ).unwrap()
    return transfer_targets, [batch, pools]


def _accepted_states(cache: bool) -> Call:
    # A verify window's forward on hybrid pools.
    kinds = MemoryKinds((SlidingWindow(4, 64), RecurrentState(8, 4)))
    pools = make_pools(8, 64, 256, CPU, 4, prefix_cache=cache, memory=kinds)
    extended, pools = extend(idle(CPU), [Req(0, (1, 2, 3)), Req(1, (4, 5))], pools).unwrap()
    batch, pools = decode(extended, pools).unwrap()
    window, pools = verify(batch, [1, 0], pools).unwrap()
    inputs = forward_inputs(window, pools.table, pools.page_size, slot_tokens=pools.slot_tokens)
    return accepted_states, [inputs, hybrid_inputs(inputs, pools), torch.tensor([1, 0])]


def _pad(cache: bool) -> Call:
    batch, pools = _running(cache)
    return pad, [forward_inputs(batch, pools.table, pools.page_size), [4], SGLANG_PAD_VALUES]


def _release(cache: bool) -> Call:
    batch, pools = _running(cache)
    return release, [filter_batch(batch, [0]), filter_batch(batch, [1]), pools]


def _sync(cache: bool) -> Call:
    window, pools = _window(cache)
    return sync, [window, np.array([1, 0]), pools]


def _verify(cache: bool) -> Call:
    batch, pools = _running(cache)
    return verify, [batch, [1, 0], pools]


def _verify_ahead(cache: bool) -> Call:
    window, pools = _window(cache)  # drafts [1, 0]
    return verify_ahead, [window, torch.tensor([1, 0]), [1, 1], pools]


def _exact_window(cache: bool) -> Call:
    window, pools = _window(cache)
    ahead, pools = verify_ahead(window, torch.tensor([1, 0]), [1, 1], pools).unwrap()
    return exact_window, [ahead, np.array([1, 0]), pools]


def _fill_buffers(cache: bool) -> Call:
    batch, pools = _running(cache)
    return fill_buffers, [
        GraphBuffers.for_decode(CPU, pools.page_size, 4, max_pages=16),
        batch,
        pools.table,
    ]


def _on_allocated(
    method: Callable[..., object], *tail: object, fresh: bool = False
) -> Callable[[bool], Call]:
    def legal(cache: bool) -> Call:
        if fresh:
            slots, pools = _pools(cache).allocate_slots(2).unwrap()
        else:
            slots, pools = _allocated(cache)
        return method, [pools, slots, *tail]

    return legal


LEGAL: Final[dict[str, Callable[[bool], Call]]] = {
    "captured_size": lambda c: (captured_size, [[1, 4, 8], 3]),
    "build_columns": _columns,
    "check_batch": lambda c: (check_batch, [_running(c)[0]]),
    "check_forward": lambda c: (check_forward, [*_running(c)]),
    "check_leaks": _leaks(check_leaks),
    "check_pools": lambda c: (check_pools, [_running(c)[1]]),
    "decode": lambda c: (decode, [*_filtered(c)]),
    "decode_sampled": _decode_sampled,
    "extend": lambda c: (extend, [idle(CPU), [Req(0, (1, 2))], _pools(c)]),
    "filter_batch": lambda c: (filter_batch, [_running(c)[0], [0]]),
    "find_leaks": _leaks(find_leaks),
    "flush": lambda c: (flush, [_pools(c)]),
    "gather_sampled": lambda c: (gather_sampled, [*_sampled(c)]),
    "forward_inputs": _forward,
    "hybrid_inputs": _hybrid,
    "transfer_targets": _transfer,
    "fill_hybrid_buffers": _fill_hybrid_buffers,
    "accepted_states": _accepted_states,
    "idle": lambda c: (idle, [CPU]),
    "join_sampled": lambda c: (join_sampled, [*_two_sampled(c)]),
    "keep_indices": lambda c: (keep_indices, [[0, 2], 3]),
    "make_pools": lambda c: (make_pools, [4, 32, 64, CPU, 4]),
    "merge": lambda c: (merge, [*_two_batches(c)]),
    "mix": lambda c: (mix, [idle(CPU), [Req(0, (1, 2))], 8, _pools(c)]),
    "pad": _pad,
    "fill_buffers": _fill_buffers,
    "verify_ahead": _verify_ahead,
    "exact_window": _exact_window,
    "read_verified": lambda c: (
        read_verified,
        [torch.tensor([1, 0]), torch.tensor([[3, 4], [5, 0]])],
    ),
    "admit_prefilled": lambda c: (admit_prefilled, [idle(CPU), [Req(0, (1, 2))], _pools(c)]),
    "read_sampled": lambda c: (read_sampled, [_sampled(c)[0]]),
    "release": _release,
    "finish_mixed": lambda c: (finish_mixed, [_mixed(c).batch]),
    "split": lambda c: (split, [_running(c)[0], [1]]),
    "sync": _sync,
    "unpad": lambda c: (unpad, [_padded(c).wrap(torch.zeros(4, 3))]),
    "unpad_tokens": lambda c: (unpad_tokens, [_padded(c).wrap(torch.zeros(4, 3))]),
    "unwrap": lambda c: (unwrap, [Success(1)]),
    "verify": _verify,
    "Pools.allocate_slots": lambda c: (Pools.allocate_slots, [_pools(c), 2]),
    "Pools.allocate_tokens": _on_allocated(
        Pools.allocate_tokens, host_int64([3, 5]), host_int64([4, 9])
    ),
    "Pools.allocate_fresh": _on_allocated(Pools.allocate_fresh, [3, 5], fresh=True),
    "Pools.allocate_next": _on_allocated(Pools.allocate_next, host_int64([4, 6])),
    "Pools.free": _on_allocated(Pools.free),
    "Pools.shrink": _on_allocated(Pools.shrink, host_int64([2, 5])),
}

# Every kind of bad argument: wrong type, nothing, negative, past int64, a float, a float
# array, a tensor on another device.
BAD: Final[dict[str, Callable[[], object]]] = {
    "str": lambda: "not it",
    "none": lambda: None,
    "negative": lambda: -1,
    "huge": lambda: 2**70,
    "float": lambda: 1.5,
    "float-array": lambda: np.array([1.5, 2.5]),
    "meta-tensor": lambda: torch.zeros(2, dtype=torch.int64, device="meta"),
}


# Bad-looking values that are legal there: they must succeed.
ACCEPTED: Final = {
    ("keep_indices", 1, "huge"): "a row count past int64 is only an upper bound",
    ("make_pools", 3, "none"): "torch's default device",
    ("mix", 2, "huge"): "a budget larger than any prompt admits all",
    ("pad", 2, "none"): "the default fills, SGLANG_PAD_VALUES",
    ("build_columns", 2, "meta-tensor"): "not refused yet: torch reads a tensor's device",
}
ALL: Final = frozenset(BAD)
# The ledger of doors still refusing with a raw error (each raises, changes nothing):
# the arguments are checked where they are first used, not at the door. The test fails
# when one of them becomes typed, so that the ledger only shrinks.
STILL_RAW: Final[dict[tuple[str, int], frozenset[str]]] = {
    ("build_columns", 0): frozenset({"str", "none", "negative", "huge", "float", "meta-tensor"}),
    ("build_columns", 1): frozenset({"meta-tensor"}),
    ("build_columns", 2): ALL - {"meta-tensor"},
    ("check_leaks", 1): frozenset({"float-array"}),
    ("extend", 1): frozenset({"str", "float-array", "meta-tensor"}),
    ("find_leaks", 1): frozenset({"float-array"}),
    ("idle", 0): frozenset({"str", "negative", "huge"}),
    ("keep_indices", 1): frozenset({"float-array", "meta-tensor"}),
    ("make_pools", 0): frozenset({"huge", "float-array", "meta-tensor"}),
    ("make_pools", 1): frozenset({"huge", "float-array", "meta-tensor"}),
    ("make_pools", 2): frozenset({"huge", "float-array", "meta-tensor"}),
    ("make_pools", 3): frozenset({"str", "negative", "huge"}),
    ("make_pools", 4): frozenset({"float-array", "meta-tensor"}),
    ("mix", 1): frozenset({"str", "float-array", "meta-tensor"}),
    ("admit_prefilled", 1): frozenset({"str", "float-array", "meta-tensor"}),
}


def test_the_table_covers_every_public_function_and_pools_method() -> None:
    # The core's functions and every namespace's (deprecated names aside: not in `__all__`).
    namespaces = [batchstate] + [
        importlib.import_module(f"batchstate.{name}")
        for name in ("base", "captured", "checks", "forward", "pools", "speculative", "transitions")
    ]
    functions = {
        name
        for namespace in namespaces
        for name in namespace.__all__
        if inspect.isfunction(getattr(namespace, name))
    }
    methods = {
        f"Pools.{name}"
        for name in ("allocate_slots", "allocate_tokens", "allocate_fresh", "allocate_next")
    } | {"Pools.free", "Pools.shrink"}
    assert functions | methods == set(LEGAL)


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize("name", LEGAL)
def test_every_legal_call_in_the_table_succeeds(name: str, cache: bool) -> None:
    function, args = LEGAL[name](cache)
    result = function(*args)
    assert not isinstance(result, Failure), f"{name}: {result}"


def _cases() -> list[tuple[str, int, str]]:
    cases: list[tuple[str, int, str]] = []
    for name, legal in LEGAL.items():
        _, args = legal(False)
        first = 1 if name.startswith("Pools.") else 0  # not `self`: a method call has one
        for position in range(first, len(args)):
            cases.extend((name, position, kind) for kind in BAD)
    return cases


def _typed(error: BaseException, bad: object, function: Callable[..., object]) -> bool:
    # A batchstate exception, or a builtin one that names what was wrong.
    if type(error).__module__.startswith("batchstate"):
        return True
    if not isinstance(error, TypeError | ValueError):
        return False
    message = str(error)
    names = [*inspect.signature(function).parameters, type(bad).__name__]
    return any(name in message for name in names)


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
@pytest.mark.parametrize(("name", "position", "kind"), _cases())
def test_a_bad_argument_is_refused_typed_and_changes_nothing(
    name: str, position: int, kind: str, cache: bool
) -> None:
    function, args = LEGAL[name](cache)
    bad = BAD[kind]()
    args[position] = bad
    before = snapshot(args)
    if (name, position, kind) in ACCEPTED:
        assert not isinstance(function(*args), Failure)
        return
    raw = kind in STILL_RAW.get((name, position), frozenset())
    try:
        result = function(*args)
    except Exception as error:  # the point: which kind it is
        typed = _typed(error, bad, function)
        assert typed != raw, f"{name}({kind} at {position}): {error!r}" + (
            " is typed now: take it off STILL_RAW" if raw else ""
        )
    else:
        assert isinstance(result, Failure), f"{name}({kind} at {position}) accepted: {result!r}"
    assert_unchanged(before, args)
