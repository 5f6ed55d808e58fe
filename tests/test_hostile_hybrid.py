"""The generated hostile-input table again, every pools made hybrid: window pages and states.

Each case of `test_hostile_generated.py`, with the prefix cache off and on,
runs with `make_pools` giving the table's pools a sliding window and a
state per request slot:
every bad argument to every public function is still refused with a typed
error, and every input, the window pages and state slots included, is
unchanged bit for bit after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import pytest
import torch

import tests.test_hostile_generated as table
from batchstate import FULL_ATTENTION, MemoryKinds, Pools, RecurrentState, SlidingWindow
from batchstate import make_pools as plain_make_pools

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
