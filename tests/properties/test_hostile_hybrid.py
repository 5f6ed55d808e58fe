"""The generated hostile-input table again, every pools made hybrid: window pages and states.

Each case of `test_hostile_generated.py`, with the prefix cache off and on,
runs with `make_pools` giving the table's pools a sliding window and a
state per request slot:
every bad argument to every public function is still refused with a typed
error, and every input, the window pages and state slots included, is
unchanged bit for bit after it. Then the doors a cached prefix comes
through on hybrid pools: a prefix whose anchor (window tail and state) is
gone is refused by `hybrid_inputs`, a `read_at_most` cap between anchors
reads nothing rather than a partial tail, and an evicted anchor is never
matched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import attrs
import pytest
import torch

import tests.properties.test_hostile_generated as table
from batchstate import (
    FULL_ATTENTION,
    ForwardInputsError,
    MemoryKinds,
    Pools,
    RecurrentState,
    Req,
    SlidingWindow,
    check_pools,
    extend,
    finish_mixed,
    forward_inputs,
    hybrid_inputs,
    idle,
    mix,
    release,
    split,
    unwrap,
)
from batchstate import make_pools as plain_make_pools

CPU: Final = torch.device("cpu")

KINDS: Final = MemoryKinds((SlidingWindow(4, 64), RecurrentState(8, 8)))


def _hybrid_make_pools(  # make_pools' own signature
    max_reqs: int,
    max_context_len: int,
    num_kv_tokens: int,
    device: torch.device,
    page_size: int = 1,
    *,
    prefix_cache: bool = False,
    memory: MemoryKinds = FULL_ATTENTION,
) -> Pools:
    kinds = memory if memory.is_hybrid else KINDS
    return plain_make_pools(
        max_reqs, max_context_len, num_kv_tokens, device, page_size,
        prefix_cache=prefix_cache, memory=kinds,
    )  # fmt: skip


@pytest.fixture
def hybrid_tables(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The table's builders make their pools through this module-level name.
    monkeypatch.setattr(table, "make_pools", _hybrid_make_pools)
    yield


# make_pools itself is the plain one's case: the table checks it.
CASES: Final = [case for case in table._cases() if case[0] != "make_pools"]


@pytest.mark.usefixtures("hybrid_tables")
def test_the_table_builds_hybrid_pools() -> None:
    _, args = table.LEGAL["decode"](False)
    pools = args[1]
    assert isinstance(pools, Pools) and pools.memory_kinds == KINDS
    assert pools.memory.states[0].num_free == 6  # two rows running, a state each


@pytest.mark.usefixtures("hybrid_tables")
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("name", [name for name in table.LEGAL if name != "make_pools"])
def test_every_legal_call_succeeds_on_hybrid_pools(name: str, cache: bool) -> None:
    table.test_every_legal_call_in_the_table_succeeds(name, cache=cache)


@pytest.mark.usefixtures("hybrid_tables")
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize(("name", "position", "kind"), CASES)
def test_a_bad_argument_is_refused_on_hybrid_pools(
    name: str, position: int, kind: str, cache: bool
) -> None:
    table.test_a_bad_argument_is_refused_typed_and_changes_nothing(name, position, kind, cache)


HEADER: Final = tuple(range(100, 140))  # 40 tokens: an anchor at 40 with pages of 4


def _anchored(num_states: int = 8) -> Pools:
    # Pools whose cache keeps an anchor at the header's end (a finished row published it).
    kinds = MemoryKinds((SlidingWindow(8, 512), RecurrentState(16, num_states)))
    pools = plain_make_pools(4, 128, 256, CPU, 4, prefix_cache=True, memory=kinds)
    first, pools = unwrap(extend(idle(CPU), [Req(0, (*HEADER, 1))], pools))
    kept, left = split(first, [])
    pools = unwrap(release(left, kept, pools))
    assert tuple(pools.memory.cached.anchors) == (HEADER,)
    return pools


def test_hybrid_inputs_refuse_a_prefix_whose_anchor_is_gone() -> None:
    """A resuming row whose anchor the pools no longer keep (forged here: eviction never
    drops a locked anchor) is refused, typed, rather than read as if it were whole."""
    resumed, pools = unwrap(extend(idle(CPU), [Req(1, (*HEADER, 2))], _anchored()))
    assert resumed.prefix_lens.tolist() == [40]
    inputs = forward_inputs(resumed, pools.table, pools.page_size)
    assert hybrid_inputs(inputs, pools).cached  # the copies, named while the anchor is kept
    memory = pools.memory
    cached = memory.cached
    forged = attrs.evolve(cached, anchors=cached.anchors.delete(HEADER))
    gone = pools.next_version(memory=attrs.evolve(memory, cached=forged)).commit()
    before = gone.memory.cached
    with pytest.raises(ForwardInputsError, match="no longer keeps"):
        hybrid_inputs(inputs, gone)
    assert gone.memory.cached is before and gone.is_newest


def test_a_cap_between_anchors_reads_nothing_rather_than_a_partial_tail() -> None:
    """`mix`'s `read_at_most` below an anchor cuts the match back to an earlier anchor (none
    here), never to a cached prefix whose window tail and state are not kept."""
    pools = _anchored()
    capped, pools = unwrap(
        mix(idle(CPU), [Req(1, (*HEADER, 2))], 64, pools, [], read_at_most={1: 36})
    )
    assert capped.prefix_lens.tolist() == [0]
    running = finish_mixed(capped)[0]
    check_pools(pools, [running])
    again, pools = unwrap(mix(running, [Req(2, (*HEADER, 3))], 64, pools, [0]))
    assert again.prefix_lens.tolist()[0] == 40  # uncapped: it resumes at the anchor


def test_an_evicted_anchor_is_never_matched() -> None:
    """State pressure evicts the (unlocked) anchor: its pages stay cached, no match ends there."""
    pools = _anchored(num_states=2)
    both, pools = unwrap(extend(idle(CPU), [Req(1, (5, 6)), Req(2, (7, 8))], pools))
    assert not pools.memory.cached.anchors and pools.cache.num_pages == 10
    check_pools(pools, [both])
    kept, left = split(both, [])
    pools = unwrap(release(left, kept, pools))
    again, pools = unwrap(extend(idle(CPU), [Req(3, (*HEADER, 2))], pools))
    assert again.prefix_lens.tolist() == [0]
    check_pools(pools, [again])
