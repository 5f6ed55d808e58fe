"""Chunked prefill between chunks: a request whose prompt is only partly in the KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, final

import attrs

from batchstate.base.errors import NotHeld
from batchstate.base.read_only import read_only_copies
from batchstate.columns.columns import NO_COLUMNS, C, NoColumns
from batchstate.columns.rows import slice_columns
from batchstate.pools.pools import Pools
from batchstate.records.rows import Req

__all__ = ["Chunked", "columns_in_order"]


@read_only_copies
@final
@attrs.frozen
class Chunked(Generic[C]):
    """A request held between the chunks of its prefill: it owns `slot` and `cached` KV tokens.

    Made by `finish_mixed` for each row of a mixed forward whose prompt goes on in
    a later chunk. It can only be continued (handed to `mix` again, which
    computes its next chunk and, on the last one, makes it a running row;
    or to `extend`, which computes the rest of its prompt) or released
    (`release(chunked, running, pools)`). With the prefix cache on, its
    whole pages were published when its chunk ended: it keeps its slot and
    reads them from the cache. It is not a batch: mypy
    rejects it where `decode`, `filter_batch` or `merge` want one, and
    `find_leaks` counts its slot as held.

    A `Chunked` is good for one continuation: the pools then hold more
    tokens in its slot, and handing it over again is `Failure(NotHeld)`.
    It carries the generation it holds its slot at (`gen`, keyword-only):
    once the slot is released and handed out again, to a request whose
    chunk holds as many tokens, the chunk is still `NotHeld` (`stale`).
    """

    req: Req  # the whole prompt (and any tokens generated before a retraction)
    slot: int  # the request slot it owns
    cached: int  # prompt tokens with KV in the slot, 0 < cached < len(req.input_ids)
    columns: C = NO_COLUMNS  # type: ignore[assignment]  # its own row of the batch's column set
    # The generation it holds `slot` at (`pools.slot_gens[slot]` when it was allocated).
    gen: int = attrs.field(kw_only=True)
    # The request it was made for: a copy with `req` swapped (`attrs.evolve`) keeps it,
    # so a continuation with other tokens is refused with the cache off too.
    _made_for: Req = attrs.field(
        kw_only=True, repr=False, default=attrs.Factory(lambda self: self.req, takes_self=True)
    )

    def _held_slots(self) -> list[tuple[int, int, int]]:
        # (slot, tokens it holds, generation): what `find_leaks` compares with the pools.
        return [(self.slot, self.cached, self.gen)]

    def not_held(self, pools: Pools) -> NotHeld | None:
        # None if `pools` hold exactly `cached` tokens in `slot` at this chunk's generation.
        slot, in_table = self.slot, 1 <= self.slot <= pools.max_reqs
        owned = int(pools.slot_tokens[slot]) if in_table else 0
        if not in_table or not pools.slot_gens[slot] or owned != self.cached:
            return NotHeld(self.req.rid, slot, self.cached, owned)
        if int(pools.slot_gens[slot]) != self.gen:
            return NotHeld(self.req.rid, slot, self.cached, owned, stale=True)
        # The slot's KV is for the tokens of the request it was computed for.
        made_for = self._made_for
        if self.req is not made_for and tuple(self.req.input_ids[: self.cached]) != tuple(
            made_for.input_ids[: self.cached]
        ):
            return NotHeld(self.req.rid, slot, self.cached, owned, other_tokens=True)
        # With the cache on the pools know the tokens the slot's row reads: a chunk whose
        # request was swapped for another would publish tokens the cache does not hold.
        prefix = pools.prefixes.get(slot)
        if prefix is not None and tuple(self.req.input_ids[: len(prefix)]) != tuple(prefix):
            return NotHeld(self.req.rid, slot, self.cached, owned, other_tokens=True)
        return None

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute."""
        return len(self.req.input_ids) - self.cached


def columns_in_order(items: Sequence[Req | Chunked[C]], columns: C) -> list[C]:
    """Each item's own row of columns, in order: a chunk's own, or the next `Req`'s of `columns`.

    Views: the caller joins them in its one upload. Empty for `NoColumns`.
    """
    if type(columns) is NoColumns:
        return []
    parts: list[C] = []
    next_new = 0
    for item in items:
        if isinstance(item, Chunked):
            parts.append(item.columns)
        else:
            parts.append(slice_columns(columns, next_new, next_new + 1))
            next_new += 1
    return parts
