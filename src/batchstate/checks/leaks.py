"""Leak detection: memory the pools count as owned that no live record holds."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, final

import attrs

from batchstate.base.errors import InvariantViolation
from batchstate.checks.hybrid import unheld_hybrid
from batchstate.pools.pools import Pools, expect_pools

__all__ = ["Leaks", "SlotHolder", "check_leaks", "find_leaks"]


class SlotHolder(Protocol):
    """Anything that holds request slots between two calls, of any column set.

    The records (`Idle`, `Extended`, `Decoding`, `Filtered`, `Mixed`), a held
    `Chunked`, a `Verifying` window and an unreleased `Departed`: each says
    which slots it holds, at which lengths and generations, without reading
    the device.
    """

    def _held_slots(self) -> list[tuple[int, int, int]]: ...


@final
@attrs.frozen
class Leaks:
    """What `find_leaks` found; falsy when nothing leaked.

    `unheld` slots are owned in the pools (taken directly with
    `Pools.allocate_slots` included) but held by no record given: their
    `unheld_tokens` KV tokens (`unheld_pages` pages) can never come back.
    `held_twice` slots are held by two records; `wrong_length` slots are
    held at another length than the pools own (a stale record); `stale`
    slots are held at another generation than the slot's (a record from
    before the slot was released and handed out again, whatever its length).
    With hybrid pools, `unheld_window_pages` and `unheld_states` count the
    window pages and state slots the unheld slots hold, lost with them.
    """

    unheld: tuple[int, ...] = ()
    unheld_tokens: int = 0
    unheld_pages: int = 0
    held_twice: tuple[int, ...] = ()
    wrong_length: tuple[int, ...] = ()
    stale: tuple[int, ...] = ()
    unheld_window_pages: int = 0
    unheld_states: int = 0

    def __bool__(self) -> bool:
        return bool(self.unheld or self.held_twice or self.wrong_length or self.stale)

    def __str__(self) -> str:
        if not self:
            return "no leaks"
        parts = []
        if self.unheld:
            parts.append(
                f"slots {list(self.unheld)} are owned but held by no record"
                f" ({self.unheld_tokens} KV tokens, {self.unheld_pages} pages"
                + (
                    f", {self.unheld_window_pages} window pages, {self.unheld_states} states)"
                    if self.unheld_window_pages or self.unheld_states
                    else ")"
                )
            )
        if self.held_twice:
            parts.append(f"slots {list(self.held_twice)} are held twice")
        if self.wrong_length:
            parts.append(f"slots {list(self.wrong_length)} are held at another length")
        if self.stale:
            parts.append(
                f"slots {list(self.stale)} are held at another generation"
                " (released and handed out again)"
            )
        return "; ".join(parts)


def find_leaks(pools: Pools, holders: Iterable[SlotHolder]) -> Leaks:
    """Compare the slots the pools own with the slots `holders` hold: host data only.

    Pass every live record: the running batch, each held `Chunked`, a
    `Mixed` or `Verifying` between its transition and the next, and each
    `Departed` not yet released. A `Verifying` holds its slots at a length
    only the device knows, so its lengths are not compared (its generations
    are). A slot is owned from its allocation (its generation is not 0),
    before it holds any token.

    Raises:
        StalePools: `pools` is not the newest pools.
    """
    expect_pools(pools)
    owned, slot_gens = pools.slot_tokens, pools.slot_gens
    seen: dict[int, int] = {}
    twice: set[int] = set()
    wrong: set[int] = set()
    stale: set[int] = set()
    for holder in holders:
        for slot, length, gen in _held(holder):
            if slot in seen:
                twice.add(slot)
            seen[slot] = length
            in_table = 1 <= slot < owned.shape[0]
            if in_table and int(slot_gens[slot]) != gen:
                stale.add(slot)
            elif not in_table or (length >= 0 and int(owned[slot]) != length):
                wrong.add(slot)
    owned_slots = slot_gens.nonzero()[0].tolist()
    unheld = tuple(slot for slot in owned_slots if slot not in seen)
    page = pools.page_size
    tokens = [int(owned[slot]) for slot in unheld]
    return Leaks(
        unheld,
        sum(tokens),
        sum(-(-count // page) for count in tokens),
        tuple(sorted(twice)),
        tuple(sorted(wrong)),
        tuple(sorted(stale)),
        *(unheld_hybrid(pools, list(unheld)) if pools.memory.kinds.is_hybrid else ()),
    )


def check_leaks(pools: Pools, holders: Iterable[SlotHolder]) -> None:
    """Raise `InvariantViolation` unless `find_leaks` finds nothing."""
    leaks = find_leaks(pools, holders)
    if leaks:
        raise InvariantViolation(f"leak check: {leaks}")


def _held(holder: SlotHolder) -> list[tuple[int, int, int]]:
    # (slot, tokens it holds, generation) per row; -1 where only the device knows the length.
    if not hasattr(holder, "_held_slots"):
        raise TypeError(f"find_leaks: {type(holder).__name__} holds no request slots")
    return holder._held_slots()
