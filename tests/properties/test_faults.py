"""Faults midway through a transition: allocations that fail, exceptions from inside.

Two kinds. An allocation that fails partway through a multi-request extend
(request slots granted, KV tokens not; or the reverse) must return a
`Failure` and leave the pools and the request-to-token table as they were.
And an exception raised from inside a transition, at any of its seams (an
allocation, a host-to-device copy, a device gather or concatenation, the
device side of the table write), must leave every input valid and unchanged.

The sweep counts the seam calls of a clean run, then reruns the transition
once per call, raising at that call. Seams are the operations that can fail
in production: allocating, copying to the device, device ops that allocate.
The host side of the table write is not a seam: it indexes CPU memory at
cells the device write just accepted (see `TokenTable.write`).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final, NamedTuple

import numpy as np
import pytest
import torch
from returns.result import Failure, Success

import batchstate.base.mirrored
import batchstate.pools.pools
import batchstate.records.rows
import batchstate.speculative.verification
import batchstate.transitions.admission
import batchstate.transitions.decoding
import batchstate.transitions.mixing
from batchstate import (
    Chunked,
    Decoding,
    Filtered,
    Mirrored,
    OutOfKVTokens,
    OutOfReqSlots,
    Pools,
    Req,
    TokenTable,
    admit_prefilled,
    check_batch,
    check_pools,
    decode,
    extend,
    filter_batch,
    idle,
    merge,
    release,
    split,
    sync,
    verify,
)
from tests.builders import CPU, make_extended, make_phase, make_reqs, make_test_pools
from tests.strategies import assert_unchanged, snapshot

# Setup for one transition: the call, and every value it is handed.
Setup = tuple[Callable[[], object], tuple[object, ...]]


class _Injected(RuntimeError):
    """The fault the tests raise; nothing in batchstate catches it."""


_UPLOAD: Final = batchstate.base.mirrored.upload
for _module in pkgutil.walk_packages(batchstate.__path__, "batchstate."):
    skipped = ("mypy", "sglang", "engine", "cli", "__main__")
    if not _module.ispkg and not any(part in _module.name for part in skipped):
        importlib.import_module(_module.name)  # so that every binding of `upload` is seen

# (owner, attribute): every seam the sweep may raise at.
_SEAMS: Final[tuple[tuple[object, str], ...]] = (
    # The allocators, the trusted Pools methods every transition allocates and frees through.
    (Pools, "take_slots"),
    (Pools, "take_fresh"),
    (Pools, "take_tokens"),
    (Pools, "take_next"),
    (batchstate.pools.pools, "_take_pages"),
    (Pools, "give_back_slots"),  # what `free` and `release` call
    (Pools, "shrink_slots"),  # what `shrink` and `sync` call
    (TokenTable, "write"),
    (TokenTable, "write_rows"),
    (Mirrored, "from_hosts"),
    # `upload`, in every module that binds it by name (a call through any of them).
    *(
        (module, "upload")
        for name, module in sorted(sys.modules.items())
        if name.startswith("batchstate") and getattr(module, "upload", None) is _UPLOAD
    ),
    (batchstate.transitions.decoding, "build_rows"),
    (batchstate.transitions.admission, "build_rows"),
    (batchstate.records.rows, "host_int64"),
    (batchstate.transitions.admission, "host_int64"),
    (np, "concatenate"),
    (torch, "from_numpy"),
    (torch.Tensor, "to"),
)


class _Injector:
    """Counts seam calls while armed; raises `_Injected` at call number `fail_at`."""

    def __init__(self) -> None:
        self.armed = False
        self.calls = 0
        self.fail_at: int | None = None
        self.device_table: torch.Tensor | None = None  # its writes are a seam too

    def tick(self, where: str) -> None:
        if not self.armed:
            return
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise _Injected(f"injected at call {self.fail_at}: {where}")

    def wrap(self, owner: object, name: str) -> Callable[..., object]:
        original: Callable[..., object] = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            self.tick(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)

        return wrapper

    def wrap_setitem(self) -> Callable[..., None]:
        original = torch.Tensor.__setitem__

        def setitem(tensor: torch.Tensor, index: object, value: object) -> None:
            if tensor is self.device_table:
                self.tick("table.device[...] = ...")
            original(tensor, index, value)  # type: ignore[arg-type]  # torch's index union

        return setitem


@contextmanager
def _seams(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Injector]:
    injector = _Injector()
    with monkeypatch.context() as patch:
        for owner, name in _SEAMS:
            patch.setattr(owner, name, injector.wrap(owner, name))
        patch.setattr(torch.Tensor, "__setitem__", injector.wrap_setitem())
        yield injector


def _make_chunked(page_size: int) -> tuple[Pools, int]:
    """Pools where request 7 owns a slot holding 5 cached tokens, out of any batch."""
    pools = make_test_pools(page_size)
    batch, pools = extend(idle(CPU), [Req(7, tuple(range(5)))], pools).unwrap()
    return pools, int(batch.rows.req_pool_indices.host[0])


def _extend_mixed(page_size: int) -> Setup:
    pools, slot = _make_chunked(page_size)
    items: list[Req | Chunked] = [*make_reqs([3, 20], first_rid=10)]
    items.append(Chunked(Req(7, tuple(range(22))), slot, 5, gen=int(pools.slot_gens[slot])))
    return (lambda: extend(idle(CPU), items, pools)), (pools, items)


def _admit_prefilled(page_size: int) -> Setup:
    pools = make_test_pools(page_size)
    reqs = make_reqs([4, 17, 16])
    return (lambda: admit_prefilled(idle(CPU), reqs, pools)), (pools, reqs)


def _decode(page_size: int) -> Setup:
    # Lengths 16 and 5: with pages of 16 one row starts a page, the other does not.
    batch, pools = make_extended(make_test_pools(page_size), [16, 5])
    return (lambda: decode(batch, pools)), (batch, pools)


def _filter(page_size: int) -> Setup:
    batch, _ = make_phase(Decoding, make_test_pools(page_size), [3, 5, 7, 9])
    return (lambda: filter_batch(batch, [0, 3])), (batch,)  # type: ignore[arg-type]  # a Decoding


def _merge(page_size: int) -> Setup:
    pools = make_test_pools(page_size)
    running, pools = make_phase(Filtered, pools, [3, 5, 7])
    incoming, pools = make_extended(pools, [4, 6], first_rid=20)
    return (lambda: merge(running, incoming)), (running, incoming)  # type: ignore[arg-type]  # a Filtered


def _release(page_size: int) -> Setup:
    batch, pools = make_phase(Decoding, make_test_pools(page_size), [3, 5, 17])
    left, running = filter_batch(batch, [0, 2]), filter_batch(batch, [1])  # type: ignore[arg-type]  # a Decoding
    return (lambda: release(left, running, pools)), (left, running, pools)


def _split(page_size: int) -> Setup:
    batch, _ = make_phase(Decoding, make_test_pools(page_size), [3, 5, 7, 9])
    return (lambda: split(batch, [1, 2])), (batch,)  # type: ignore[arg-type]  # a Decoding


def _release_departed(page_size: int) -> Setup:
    batch, pools = make_phase(Decoding, make_test_pools(page_size), [3, 17, 5, 20])
    # Released against a later batch, not the split's own kept rows: the slots are compared.
    kept, left = split(batch, [1, 3])  # type: ignore[arg-type]  # a Decoding
    running = filter_batch(kept, [0])
    return (lambda: release(left, running, pools)), (left, running, pools)


def _verify(page_size: int) -> Setup:
    batch, pools = make_phase(Decoding, make_test_pools(page_size), [15, 5, 30])
    return (lambda: verify(batch, [2, 0, 5], pools)), (batch, pools)  # type: ignore[arg-type]  # a Decoding


def _sync(page_size: int) -> Setup:
    batch, pools = make_phase(Decoding, make_test_pools(page_size), [15, 5, 30])
    window, pools = verify(batch, [2, 0, 5], pools).unwrap()  # type: ignore[arg-type]  # a Decoding
    accepted = torch.tensor([1, 0, 0])  # frees the last row's draft-only page (pages of 16)
    return (lambda: sync(window, accepted, pools)), (window, accepted, pools)


_TRANSITIONS: Final[dict[str, Callable[[int], Setup]]] = {
    "extend-new-and-chunked": _extend_mixed,  # three allocations and the table write
    "admit_prefilled": _admit_prefilled,  # the same admission without a forward
    "decode": _decode,  # the per-step hot path: allocate_next, copy, table write
    "filter": _filter,  # gathers on both sides
    "merge": _merge,  # concatenations on both sides
    "release": _release,  # the free list grows
    "split": _split,  # gathers on both sides, the rows that left on the host
    "release-departed": _release_departed,  # a Departed, compared against the running rows
    "verify": _verify,  # allocate_tokens, the table write, one copy for the forward
    "sync": _sync,  # the device read, shrink, the mirror copy
}


def _device_table(inputs: tuple[object, ...]) -> torch.Tensor | None:
    pools = [value for value in inputs if isinstance(value, Pools)]
    return pools[0].table.device if pools else None


def _assert_valid(inputs: tuple[object, ...]) -> None:
    for value in inputs:
        if isinstance(value, Pools):
            check_pools(value, compare_device=True)
        elif hasattr(value, "rows"):
            check_batch(value, compare_device=True)  # type: ignore[arg-type]  # a record


_PAGE_SIZES: Final = (
    1,  # one token per page: the fast paths
    16,  # partly filled pages, read back from the host table
)


@pytest.mark.parametrize("page_size", _PAGE_SIZES)
@pytest.mark.parametrize("name", _TRANSITIONS)
def test_exception_at_every_seam(
    monkeypatch: pytest.MonkeyPatch, name: str, page_size: int
) -> None:
    """An exception at any seam of a transition leaves every input valid and unchanged."""
    setup = _TRANSITIONS[name]
    with _seams(monkeypatch) as injector:
        num_calls = _count_seam_calls(injector, name, page_size)
        assert num_calls, f"{name} passed no seam: the sweep would prove nothing"
        print(f"{name}, page size {page_size}: {num_calls} faults injected")
        for fail_at in range(num_calls):
            call, inputs = setup(page_size)
            injector.device_table = _device_table(inputs)
            before = snapshot(inputs)
            injector.calls, injector.fail_at, injector.armed = 0, fail_at, True
            try:
                with pytest.raises(_Injected) as raised:
                    call()
            finally:
                injector.armed = False
            assert_unchanged(before, inputs, f"{name} inputs after a fault {raised.value}")
            _assert_valid(inputs)


def _count_seam_calls(injector: _Injector, name: str, page_size: int) -> int:
    # A clean run, counting its seam calls: the sweep injects one fault per call.
    call, inputs = _TRANSITIONS[name](page_size)
    injector.device_table = _device_table(inputs)
    injector.calls, injector.fail_at, injector.armed = 0, None, True
    try:
        call()
    finally:
        injector.armed = False
    return injector.calls


def test_reliability_doc_states_the_number_of_faults_injected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/reliability.md's fault count is what the sweep above injects, at both page sizes."""
    with _seams(monkeypatch) as injector:
        total = sum(
            _count_seam_calls(injector, name, page_size)
            for name in _TRANSITIONS
            for page_size in _PAGE_SIZES
        )
    print(f"fault sweep: {total} faults over {len(_TRANSITIONS)} transitions")
    doc = (Path(__file__).parents[2] / "docs" / "reliability.md").read_text()
    stated = {int(count) for count in re.findall(r"(\d+) (?:injected faults|faults in all)", doc)}
    assert stated == {total}, (
        f"docs/reliability.md states {sorted(stated)}, the sweep injects {total}"
    )


class _AllocFault(NamedTuple):
    lengths: tuple[int, ...]  # fresh requests, admitted with request 7's chunk continued
    max_reqs: int
    num_pages: int
    expected: type


@pytest.mark.parametrize(
    "fault",
    [
        # slots granted (two of three free), KV short by one page: the slots must go back
        _AllocFault((16, 16), max_reqs=3, num_pages=3, expected=OutOfKVTokens),
        # KV plenty, one slot short: nothing allocated at all
        _AllocFault((1, 1, 1), max_reqs=3, num_pages=32, expected=OutOfReqSlots),
        # both short: slots are checked first
        _AllocFault((16, 16, 16), max_reqs=3, num_pages=1, expected=OutOfReqSlots),
    ],
)
def test_allocation_fails_midway(fault: _AllocFault) -> None:
    """A multi-request extend that runs out partway leaves pools and the table as they were."""
    pools = make_test_pools(16, max_reqs=fault.max_reqs, num_kv_tokens=16 * fault.num_pages)
    first, pools = extend(idle(CPU), [Req(7, tuple(range(5)))], pools).unwrap()
    slot = int(first.rows.req_pool_indices.host[0])
    items: list[Req | Chunked] = [*make_reqs(fault.lengths, first_rid=10)]
    items.append(Chunked(Req(7, tuple(range(30))), slot, 5, gen=int(first.rows.gens[0])))
    before = snapshot((pools, items))
    result = extend(idle(CPU), items, pools)
    assert isinstance(result, Failure)
    assert type(result.failure()) is fault.expected
    assert_unchanged(before, (pools, items), "pools, table and requests after the failure")
    check_pools(pools, compare_device=True)
    # Nothing leaked: the same pools still admit what fits.
    if pools.num_free_tokens:
        assert isinstance(extend(idle(CPU), make_reqs([1], first_rid=30), pools), Success)


@pytest.mark.parametrize(
    ("method", "failure"),
    [
        # the request slots were granted, then the KV allocator fails
        ("take_fresh", OutOfKVTokens(1, 0, 16)),
        ("take_slots", OutOfReqSlots(3, 0)),  # the first allocation fails
    ],
)
def test_allocator_failure_value(
    monkeypatch: pytest.MonkeyPatch, method: str, failure: OutOfKVTokens | OutOfReqSlots
) -> None:
    """An allocator that fails for its own reasons (not counted here) leaks nothing."""
    pools = make_test_pools(16)
    items = make_reqs([3, 20, 7])

    def fail(*args: object, **kwargs: object) -> OutOfKVTokens | OutOfReqSlots:
        return failure  # what the transitions' internal allocators return

    before = snapshot(pools)
    monkeypatch.setattr(Pools, method, fail)
    result = extend(idle(CPU), items, pools)
    monkeypatch.undo()
    assert result == Failure(failure)
    assert_unchanged(before, pools, "pools after the allocator failed")
    check_pools(pools, compare_device=True)
