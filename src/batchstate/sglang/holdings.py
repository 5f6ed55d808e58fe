"""`Holdings`: what each live SGLang request holds, kept per call, so that a pool-level
difference is named at the call that made it and attributed to the requests it touched.

Each request holds a row of `req_to_token_pool` and the KV tokens of that row beyond its
radix-tree prefix (whole pages: the part its release frees). `Watch` updates the
holdings of the requests a call touched (an extend's and a decode's rows, a released
or checkpointed request) and then checks, at that call, what must balance:

- no row is held by two live requests, and a release gives its row back once;
- free rows + rows held = the pool's rows;
- free + evictable + protected tokens + every row's own KV = the allocator's size;
- protected tokens = the tokens on the live requests' locked tree paths.

The first three cost O(requests touched) per call (running totals, the freed rows at the
tail of SGLang's free list); the lock count walks each live request's tree path. A
difference found once is not reported again at later calls: the totals it broke are
taken as the new baseline.

Over SGLang's hybrid stacks (a `UnifiedRadixCache`, whose tree is not walked) a request
also holds the window slots paired with its own KV (SWA) and a Mamba state slot, and
each component balances on its own counters instead of the lock count:

- full KV: free + full evictable + full protected + rows' own KV = the full size;
- window KV: free + SWA evictable + SWA protected + rows' window slots = the SWA size;
- Mamba slots: free + Mamba evictable + Mamba protected + live slots never exceeds the
  pool, and a release gives back to free + tree exactly the slot it held. (SGLang may
  take a slot for a request still waiting for its row, outside any call a `Watch`
  sees, so the sum may fall short between calls without a leak.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from batchstate.sglang._free_group import free_tokens
from batchstate.sglang.audit import Violation, locked_tokens
from batchstate.sglang.hybrid import (
    components,
    full_counts,
    is_swa,
    mamba_counts,
    mamba_slot,
    swa_counts,
    swa_tokens,
)


@attrs.frozen
class Holding:
    """A live request's row of `req_to_token_pool` and the KV tokens it owns outside the
    radix tree (whole pages from its cached prefix to its allocated length)."""

    row: int
    own: int
    swa: int = 0  # window slots paired with the own KV (SWA stacks)
    mamba: int | None = None  # the Mamba state slot (Mamba stacks)


def own_tokens(req: Any, page_size: int) -> int:
    """The KV tokens `req`'s row owns outside the tree: what its release frees."""
    end = int(req.kv.kv_allocated_len)
    return -(-end // page_size) * page_size - int(req.kv.cache_protected_len)


class Holdings:
    """Every live request's `Holding` (by rid), with running totals over them."""

    def __init__(self) -> None:
        self.held: dict[str, Holding] = {}
        self._reqs: dict[str, Any] = {}
        self._owners: dict[int, list[str]] = {}  # row -> the live rids that hold it
        self._own = 0
        self._swa = 0
        self._mamba = 0
        # A broken total stays broken: the difference already reported is the new baseline.
        self._rows_drift = 0
        self._kv_drift = 0
        self._lock_drift = 0
        self._swa_drift = 0
        self._mamba_drift = 0

    def update(self, reqs: Iterable[Any], page_size: int, tree: Any = None) -> list[Violation]:
        """Take each of `reqs`' current row and own KV (and, over `tree`'s hybrid pools,
        its window slots and Mamba slot); a row another live request already holds is a
        violation naming both."""
        found: list[Violation] = []
        allocator = None if tree is None else tree.token_to_kv_pool_allocator
        swa = allocator is not None and is_swa(allocator)
        for req in reqs:
            self._forget(req.rid)
            row = req.kv.req_pool_idx
            if row is None:
                continue
            row = int(row)
            holders = self._owners.setdefault(row, [])
            if holders:
                found.append(
                    Violation(
                        "row shared",
                        "req.kv.req_pool_idx",
                        f"row {row} held by {holders[0]} alone",
                        f"row {row} held by {', '.join([*holders, req.rid])}",
                        ", ".join([*holders, req.rid]),
                    )
                )
            holders.append(req.rid)
            window = swa_tokens(req, tree.req_to_token_pool.req_to_token, allocator) if swa else 0
            holding = Holding(row, own_tokens(req, page_size), window, mamba_slot(req))
            self.held[req.rid] = holding
            self._reqs[req.rid] = req
            self._own += holding.own
            self._swa += holding.swa
            self._mamba += holding.mamba is not None
        return found

    def live(self) -> list[Any]:
        """The live requests (SGLang `Req`s), in the order they were first seen."""
        return list(self._reqs.values())

    def _forget(self, rid: str) -> None:
        old = self.held.pop(rid, None)
        self._reqs.pop(rid, None)
        if old is None:
            return
        self._own -= old.own
        self._swa -= old.swa
        self._mamba -= old.mamba is not None
        holders = self._owners[old.row]
        holders.remove(rid)
        if not holders:
            del self._owners[old.row]

    def returned(self, pool: Any, free_before: int, released: dict[int, str]) -> list[Violation]:
        """After a release: each row it gave back (`released`: row -> rid) must be on the
        free list once, and no longer held. SGLang appends freed rows to the tail of
        `free_slots`, so the rows this call freed are the tail past `free_before`."""
        tail = pool.free_slots[free_before:]
        found: list[Violation] = []
        for row, times in Counter(int(r) for r in tail).items():
            who = released.get(row) or ", ".join(self._owners.get(row, ())) or f"row {row}"
            if times > 1:
                found.append(
                    Violation(
                        "row given back twice",
                        "req_to_token_pool.free_slots",
                        f"row {row} freed once",
                        f"row {row} freed {times} times",
                        who,
                    )
                )
            elif row in self._owners:
                found.append(
                    Violation(
                        "row freed while held",
                        "req_to_token_pool.free_slots",
                        f"row {row} held by {', '.join(self._owners[row])}",
                        f"row {row} on the free list",
                        who,
                    )
                )
        return found

    def balance(self, tree: Any, touched: Sequence[str]) -> list[Violation]:
        """The pool-wide balances of `tree` (SGLang's radix cache) and its pools, attributed
        to `touched` (the rids whose holdings this call changed)."""
        pool, allocator = tree.req_to_token_pool, tree.token_to_kv_pool_allocator
        who = ", ".join(touched)
        found: list[Violation] = []
        free_rows = int(pool.available_size())
        rows = len(self._owners) + free_rows - int(pool.size)
        if rows != self._rows_drift:
            self._rows_drift = rows
            found.append(
                Violation(
                    "row conservation",
                    "req_to_token_pool.available_size() + rows held",
                    f"req_to_token_pool.size = {pool.size}",
                    f"{free_rows} + {len(self._owners)} = {free_rows + len(self._owners)}",
                    who,
                )
            )
        parts = components(tree)
        if parts:
            available, evictable, protected, size = full_counts(tree)
        else:
            available, evictable, protected, size = (
                free_tokens(allocator),
                int(tree.evictable_size()),
                int(tree.protected_size()),
                int(allocator.size),
            )
        total = available + evictable + protected + self._own
        if total - size != self._kv_drift:
            self._kv_drift = total - size
            found.append(
                Violation(
                    "conservation",
                    "available + evictable + protected + rows' own KV",
                    f"allocator.size = {size}",
                    f"{available} + {evictable} + {protected} + {self._own} = {total}",
                    who,
                )
            )
        if parts:  # the tree is not walked: the components' own balances, no lock count
            return found + self._hybrid_balance(tree, parts, who)
        locked = locked_tokens(self.live())
        if protected - locked != self._lock_drift:
            self._lock_drift = protected - locked
            found.append(
                Violation(
                    "lock leaked",
                    "tree_cache.protected_size()",
                    f"{locked}, the live rows' tree paths",
                    str(protected),
                    who,
                )
            )
        return found

    def _hybrid_balance(self, tree: Any, parts: tuple[str, ...], who: str) -> list[Violation]:
        found: list[Violation] = []
        if "SWA" in parts:
            available, evictable, protected, size = swa_counts(tree)
            total = available + evictable + protected + self._swa
            if total - size != self._swa_drift:
                self._swa_drift = total - size
                found.append(
                    Violation(
                        "window conservation",
                        "swa available + swa evictable + swa protected + rows' window slots",
                        f"allocator.size_swa = {size}",
                        f"{available} + {evictable} + {protected} + {self._swa} = {total}",
                        who,
                    )
                )
        if "MAMBA" in parts:
            available, evictable, protected, size = mamba_counts(tree)
            # Short of the pool is a slot a waiting request took (not seen); past it, a
            # slot counted twice.
            over = max(0, available + evictable + protected + self._mamba - size)
            if over != self._mamba_drift:
                self._mamba_drift = over
                found.append(
                    Violation(
                        "mamba conservation",
                        "mamba free + mamba evictable + mamba protected + live slots",
                        f"at most mamba_allocator.size = {size}",
                        f"{available} + {evictable} + {protected} + {self._mamba}"
                        f" = {available + evictable + protected + self._mamba}",
                        who,
                    )
                )
        return found

    def mamba_returned(self, tree: Any, before: int, slot: int | None, rid: str) -> list[Violation]:
        """After a cache call on `rid`: the Mamba slots free or in the tree (`before` the
        call) must have grown by what the request gave up (`slot`, the one it held, if it
        holds none now): a state the tree forks or takes over moves between the two, and
        a fork the tree already holds goes back to the free list."""
        available, evictable, protected, _ = mamba_counts(tree)
        grown = available + evictable + protected - before
        held = self.held.get(rid)
        now = None if held is None else held.mamba
        expected = int(slot is not None) - int(now is not None)
        if grown == expected:
            return []
        return [
            Violation(
                "mamba slot returned",
                "mamba free + mamba evictable + mamba protected",
                f"{before} + {expected} (slot {slot} held before, {now} after)",
                f"{before} + {grown}",
                rid,
            )
        ]
