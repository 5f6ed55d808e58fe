"""Chunked prefill between chunks: a request whose prompt is only partly in the KV cache."""

from __future__ import annotations

from typing import Generic, final

import attrs

from batchstate._columns import NO_COLUMNS, C
from batchstate._rows import Req

__all__ = ["Chunked"]


@final
@attrs.frozen
class Chunked(Generic[C]):
    """A request held between the chunks of its prefill: it owns `slot` and `cached` KV tokens.

    Made by `settle` for each row of a mixed forward whose prompt goes on in
    a later chunk. It can only be continued (handed to `mix` again, which
    computes its next chunk and, on the last one, makes it a running row) or
    released (`release(chunked, running, pools)`). It is not a batch: mypy
    rejects it where `decode`, `filter_batch` or `merge` want one, and
    `find_leaks` counts its slot as held.

    A `Chunked` is good for one continuation: the pools then hold more
    tokens in its slot, and handing it over again is `Failure(NotHeld)`.
    """

    req: Req  # the whole prompt (and any tokens generated before a retraction)
    slot: int  # the request slot it owns
    cached: int  # prompt tokens with KV in the slot, 0 < cached < len(req.input_ids)
    columns: C = NO_COLUMNS  # type: ignore[assignment]  # its own row of the batch's column set

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute."""
        return len(self.req.input_ids) - self.cached
