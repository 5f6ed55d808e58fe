"""The verify window as a record: `Verifying`, and whether pools hold its window.

`Verifying` has no host field for a row's length: after the verify forward
only the device knows how many drafts each row accepted. `window_lens` and
`holds_window` tell, on the host alone, whether pools (or a token table)
still hold the tokens `verify` reserved for the window; `sync`, `release`
and the forward inputs refuse pools that do not.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, final

import attrs
import numpy as np
import torch

from batchstate.base.errors import ColumnError, RecordShapeError
from batchstate.base.mirrored import DeviceOnly, HostArray, Mirrored, same
from batchstate.base.read_only import read_only_copies
from batchstate.columns.arguments import check_column_set
from batchstate.columns.columns import NO_COLUMNS, C
from batchstate.memory.token_table import TokenTable
from batchstate.pools.pools import Pools
from batchstate.records.rows import Req, check_device, check_host

__all__ = [
    "VerifyStep",
    "Verifying",
    "holds_window",
    "window_layout",
    "window_lens",
]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class Verifying(Generic[C]):
    """A decode batch in its verify window: row lengths are known only on the device.

    Built by `verify` before the verify forward. That forward writes KV for
    each row's decode token and its drafts at `out_cache_loc` and decides,
    on the device, how many drafts each row accepts. `sync` reads those
    counts and returns a mirrored `Filtered`. Until then there is no host
    length to read, stale or otherwise: the host knows only what it
    reserved (`draft_lens`, the locations in `out_cache_loc`, and the
    tokens each slot owns in the pools).

    Row i's tokens in `out_cache_loc`, with `c` the length before drafts
    (the decode token included) and `d = draft_lens[i]`:

        positions  [c - 1, c + d)             the decode token, then d drafts
        tokens     [sum(d[:i]) + i, sum(d[:i + 1]) + i + 1)
    """

    device: torch.device
    reqs: tuple[Req, ...]
    rids: HostArray  # read-only int64 [num_reqs], row -> reqs[row].rid
    gens: HostArray  # read-only int64 [num_reqs], row -> the generation it holds its slot at
    req_pool_indices: Mirrored  # int64 [num_reqs], row -> request slot; speculation never moves it
    draft_lens: HostArray  # read-only int64 [num_reqs], row -> draft tokens with KV reserved
    seq_lens: DeviceOnly  # int64 [num_reqs], row -> KV tokens the verify forward attends over
    out_cache_loc: Mirrored  # int64 [num_reqs + sum(draft_lens)], token -> KV location
    columns: C = NO_COLUMNS  # type: ignore[assignment]  # the default C is NoColumns

    def __attrs_post_init__(self) -> None:
        num_reqs = len(self.reqs)
        check_host("Verifying.rids", self.rids, np.int64, num_reqs)
        check_host("Verifying.gens", self.gens, np.int64, num_reqs)
        check_host(
            "Verifying.req_pool_indices.host", self.req_pool_indices.host, np.int64, num_reqs
        )
        check_host("Verifying.draft_lens", self.draft_lens, np.int64, num_reqs)
        # Summed only once checked as a host array: a device draft_lens would be read.
        num_tokens = num_reqs + int(self.draft_lens.sum())
        check_host("Verifying.out_cache_loc.host", self.out_cache_loc.host, np.int64, num_tokens)
        devices = (
            ("req_pool_indices.device", self.req_pool_indices.device, num_reqs),
            ("seq_lens", self.seq_lens.device, num_reqs),
            ("out_cache_loc.device", self.out_cache_loc.device, num_tokens),
        )
        for name, tensor, length in devices:
            check_device(f"Verifying.{name}", tensor, torch.int64, length, self.device)
        try:
            check_column_set(self.columns, num_reqs, self.device, "Verifying")
        except ColumnError as error:
            raise RecordShapeError(str(error)) from error

    def _held_slots(self) -> list[tuple[int, int, int]]:
        # (slot, -1, generation) per row: only the device knows the length it holds.
        slots = self.req_pool_indices.host.tolist()
        return [(slot, -1, gen) for slot, gen in zip(slots, self.gens.tolist(), strict=True)]

    def __repr__(self) -> str:
        return (
            f"Verifying(num_reqs={len(self.reqs)}, num_drafts={int(self.draft_lens.sum())},"
            f" device={self.device})"
        )


class VerifyStep(NamedTuple, Generic[C]):
    """What `verify` returns: the verify window and the pools holding its drafts' KV."""

    batch: Verifying[C]
    pools: Pools


def window_layout(committed: HostArray, drafts: HostArray) -> tuple[HostArray, HostArray]:
    """Row and position of each token of a verify window, in `out_cache_loc` order.

    Per row, its decode token at `committed - 1`, then its drafts at
    `[committed, committed + drafts)`.
    """
    spans = drafts + 1
    rows = np.repeat(np.arange(spans.shape[0]), spans)
    first = np.cumsum(spans) - spans
    return rows, committed[rows] - 1 + np.arange(rows.shape[0]) - first[rows]


def window_lens(pools: Pools, batch: Verifying[C]) -> HostArray | None:
    """The tokens each row's slot holds (drafts included), if `pools` hold `batch`'s window.

    None for pools that do not: a slot out of range or at another
    generation (released and handed out again), or one whose table
    cells from the decode token on are not the locations `verify` wrote
    (counts alone would pass pools from before `verify` whose slots hold
    more tokens than their drafts). Host work only.
    """
    slots = batch.req_pool_indices.host
    if slots.shape[0] and not (int(slots.min()) >= 1 and int(slots.max()) <= pools.max_reqs):
        return None
    if not same(pools.slot_gens[slots], batch.gens):
        return None  # a slot released and handed out again
    held = pools.slot_tokens[slots]
    return held if holds_window(pools.table, held, batch) else None


def holds_window(table: TokenTable, held: HostArray, batch: Verifying[C]) -> bool:
    """Whether slots holding `held` tokens each (drafts included) hold `batch`'s window.

    Each row's table cells `[c - 1, c + d)` must be the locations `verify`
    wrote for its decode token and drafts: locations are never shared
    between positions, so lengths from before `verify` (or another pools')
    fail. One host gather.
    """
    committed = held - batch.draft_lens
    if (committed < 1).any() or (held > table.max_context_len).any():
        return False
    rows, positions = window_layout(committed, batch.draft_lens)
    cells = table.host[batch.req_pool_indices.host[rows], positions]
    return np.array_equal(cells, batch.out_cache_loc.host)
