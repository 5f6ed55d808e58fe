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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from batchstate.sglang._free_group import free_tokens
from batchstate.sglang.audit import Violation, locked_tokens


@attrs.frozen
class Holding:
    """A live request's row of `req_to_token_pool` and the KV tokens it owns outside the
    radix tree (whole pages from its cached prefix to its allocated length)."""

    row: int
    own: int


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
        # A broken total stays broken: the difference already reported is the new baseline.
        self._rows_drift = 0
        self._kv_drift = 0
        self._lock_drift = 0

    def update(self, reqs: Iterable[Any], page_size: int) -> list[Violation]:
        """Take each of `reqs`' current row and own KV; a row another live request already
        holds is a violation naming both."""
        found: list[Violation] = []
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
            holding = Holding(row, own_tokens(req, page_size))
            self.held[req.rid] = holding
            self._reqs[req.rid] = req
            self._own += holding.own
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
        available, evictable, protected = (
            free_tokens(allocator),
            int(tree.evictable_size()),
            int(tree.protected_size()),
        )
        total = available + evictable + protected + self._own
        if total - int(allocator.size) != self._kv_drift:
            self._kv_drift = total - int(allocator.size)
            found.append(
                Violation(
                    "conservation",
                    "available + evictable + protected + rows' own KV",
                    f"allocator.size = {allocator.size}",
                    f"{available} + {evictable} + {protected} + {self._own} = {total}",
                    who,
                )
            )
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
