"""Speculative decoding under overlap: the next verify window, opened before the last one's
acceptance reaches the host.

An overlap scheduler launches step N+1 while step N's verify forward still
decides, on the device, how many drafts each row accepts. Step N+1's
window then has lengths the host knows only from above: every draft of
step N accepted. `verify_ahead` opens it from the device's counts, which
it does not read: KV is reserved for the bound, and each token's position
and KV location are computed on the device. When the counts reach the
host (`read_verified`, one read for them and the accepted tokens),
`exact_window` turns the window into an exact `Verifying` and gives back
what the bound reserved and acceptance did not use.

    Verifying(N) --verify_ahead(accepted on device)--> WindowAhead(N+1) --(forward N+1)-->
        read_verified(N) --exact_window(counts)--> Verifying(N+1) --> sync | verify_ahead

Row i, with `c` its length before step N's drafts (its decode token
included), `d` step N's drafts, `a` the accepted ones and `e` step N+1's:
step N+1's tokens are the token after the accepted ones, at position
`c + a`, then `e` drafts; its length is `c + a + 1 + e`, at most
`c + d + 1 + e`, which is what is reserved.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, final

import attrs
import numpy as np
import numpy.typing as npt
import torch
from returns.result import Failure, Result, Success

from batchstate.base.errors import ContextTooLong, DraftError, OutOfKVTokens, PhaseError
from batchstate.base.mirrored import DeviceOnly, HostArray, Mirrored, frozen, same, upload
from batchstate.base.read_only import read_only_copies
from batchstate.base.upper_bound import UpperBound
from batchstate.columns.columns import NO_COLUMNS, C
from batchstate.pools.pools import Pools, expect_pools
from batchstate.records.rows import Req
from batchstate.records.verifying import Verifying, VerifyStep, window_lens
from batchstate.speculative.verification import Drafts, _draft_lens
from batchstate.transitions.decoding import DecodeError

__all__ = ["WindowAhead", "WindowAheadStep", "exact_window", "verify_ahead"]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class WindowAhead(Generic[C]):
    """A verify window opened before the previous window's accepted counts are on the host.

    Built by `verify_ahead`. Its lengths are an `UpperBound` (exact on the
    device); its tokens' positions and KV locations exist only on the
    device; the query layout (`qo_indptr`: one token after the accepted
    ones and `draft_lens[i]` drafts a row) is known on the host. No
    transition that needs exact host lengths takes it: `exact_window` it
    first, with the counts.
    """

    device: torch.device
    reqs: tuple[Req, ...]
    rids: HostArray  # read-only int64 [num_reqs]
    gens: HostArray  # read-only int64 [num_reqs], row -> its slot's generation
    req_pool_indices: Mirrored  # int64 [num_reqs], row -> request slot
    floor: HostArray  # int64 [num_reqs], c: the length before the previous window's drafts
    prior_drafts: HostArray  # int64 [num_reqs], d: the previous window's drafts
    draft_lens: HostArray  # int64 [num_reqs], e: this window's drafts
    prior_accepted: DeviceOnly  # int32 or int64 [num_reqs], a: not read
    seq_lens: UpperBound  # int64 [num_reqs]: c + a + 1 + e on the device, bound c + d + 1 + e
    qo_indptr: Mirrored[np.int32]  # [num_reqs + 1], each row's 1 + e query tokens
    positions: DeviceOnly  # int64 [num_tokens], c + a + j for a row's j-th token
    out_cache_loc: DeviceOnly  # int64 [num_tokens], the table's cell at each position
    columns: C = NO_COLUMNS  # type: ignore[assignment]  # the default C is NoColumns

    @property
    def num_tokens(self) -> int:
        """Query tokens of the window's forward: host-known."""
        return int(self.qo_indptr.host[-1])

    def _held_slots(self) -> list[tuple[int, int, int]]:
        # (slot, -1, generation) per row: only the device knows the length.
        slots = self.req_pool_indices.host.tolist()
        return [(slot, -1, gen) for slot, gen in zip(slots, self.gens.tolist(), strict=True)]

    def __repr__(self) -> str:
        shape = f"num_reqs={len(self.reqs)}, num_tokens={self.num_tokens}, device={self.device}"
        return f"WindowAhead({shape})"


class WindowAheadStep(NamedTuple, Generic[C]):
    """What `verify_ahead` returns: the window and the pools holding its bound's KV."""

    batch: WindowAhead[C]
    pools: Pools


def verify_ahead(
    window: Verifying[C], num_accepted: torch.Tensor, draft_lens: Drafts, pools: Pools
) -> Result[WindowAheadStep[C], DecodeError]:
    """Open the next verify window from `window`'s accepted counts on the device, unread.

    Reserves KV up to each row's bound (every draft of `window` accepted,
    one token after them, `draft_lens[i]` drafts), writes the table, and
    computes each token's position and KV location on the device from
    `num_accepted` (a gather by row and two adds; no read).

    Args:
        window: the verify window whose forward wrote `num_accepted`.
        num_accepted: int32 or int64 `[num_reqs]` on `window.device`.
        draft_lens: the next window's drafts per row, >= 0 (as `verify`'s).
        pools: the pools that hold `window` (`verify`'s, or `exact_window`'s).

    Returns:
        `Success(WindowAheadStep(WindowAhead, Pools))`; `Failure(OutOfKVTokens)` or
        `Failure(ContextTooLong)` (for the bound), with `window` and `pools` unchanged.

    Raises:
        PhaseError: `window` is not `Verifying`.
        BatchConflict: the pools' table lives on another device.
        DraftError: bad `num_accepted` or `draft_lens`, or `pools` do not hold `window`.
    """
    if not isinstance(window, Verifying):
        raise PhaseError(f"verify_ahead takes Verifying, got {type(window).__name__}")
    num_reqs = len(window.reqs)
    given: object = num_accepted  # callers without mypy may pass anything
    if (
        not isinstance(given, torch.Tensor)
        or num_accepted.shape != (num_reqs,)
        or num_accepted.dtype not in (torch.int32, torch.int64)
        or num_accepted.device != window.device
    ):
        raise DraftError(
            f"num_accepted: expected an int32 or int64 tensor [{num_reqs}] on {window.device}"
        )
    expect_pools(pools)
    pools.table.expect_on(window.device)
    drafts = _draft_lens(draft_lens, num_reqs)
    held = window_lens(pools, window)
    if held is None:
        raise DraftError(
            "the pools do not hold this window's drafts: pass the pools verify returned"
        )
    floor, slots = held - window.draft_lens, window.req_pool_indices.host
    bound = held + 1 + drafts
    too_long = bound > pools.max_context_len
    if too_long.any():
        row = int(too_long.argmax())
        return Failure(ContextTooLong(window.reqs[row].rid, int(bound[row]), pools.max_context_len))
    # The next window's forward queries from `floor + accepted` on: `floor` at the least.
    allocation = pools.take_tokens(slots, held, bound, floor)
    if isinstance(allocation, OutOfKVTokens):
        return Failure(allocation)
    new_locs, after = allocation
    spans = drafts + 1  # tokens per row, and new cells per row: the same layout
    qo_indptr = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(spans, out=qo_indptr[1:])
    token_rows = np.repeat(np.arange(num_reqs), spans)
    within = np.arange(token_rows.shape[0]) - qo_indptr[:-1][token_rows]
    hosts = (
        floor[token_rows] + within,  # positions before the accepted count is added
        token_rows,
        slots[token_rows],
        floor + spans,  # lengths before the accepted count is added
        held[token_rows] + within,  # the new cells' positions
        new_locs.astype(np.int32),
        qo_indptr.astype(np.int32),
    )
    base, rows_side, token_slots, lens, cell_positions, cell_locs, qo_side = upload(
        hosts, window.device
    )
    # NOTE: the table write first: the gathers below read the cells it writes, in stream order.
    after.table.write(
        Mirrored.trusted(frozen(hosts[2]), token_slots),
        Mirrored.trusted(frozen(hosts[4]), cell_positions),
        Mirrored.trusted(frozen(hosts[5]), cell_locs),
    )
    accepted = num_accepted.to(torch.int64)
    positions = base + accepted.index_select(0, rows_side)
    locs = after.table.device[token_slots, positions].to(torch.int64)
    ahead = WindowAhead(
        window.device,
        window.reqs,
        window.rids,
        window.gens,
        window.req_pool_indices,
        frozen(floor),
        window.draft_lens,
        frozen(drafts),
        DeviceOnly(num_accepted),
        UpperBound(frozen(bound), lens + accepted),
        Mirrored.trusted(frozen(hosts[6]), qo_side),
        DeviceOnly(positions),
        DeviceOnly(locs),
        window.columns,
    )
    return Success(WindowAheadStep(ahead, after.commit()))


def exact_window(
    ahead: WindowAhead[C], num_accepted: npt.NDArray[np.integer], pools: Pools
) -> VerifyStep[C]:
    """The window with exact lengths, once the previous window's counts are on the host.

    Gives back each row's KV past its exact length (whole pages only) and
    returns a `Verifying` whose `out_cache_loc` mirrors what the device
    computed. Reads nothing: the counts come from `read_verified`.

    Args:
        ahead: the window `verify_ahead` opened.
        num_accepted: the previous window's accepted counts, a 1-D numpy
            integer array `[num_reqs]`, each in `[0, prior_drafts[i]]`.
        pools: the pools `verify_ahead` returned, or their successors.

    Raises:
        PhaseError: `ahead` is not `WindowAhead`.
        DraftError: counts of the wrong shape or out of range, or pools that
            do not hold the window.
    """
    if not isinstance(ahead, WindowAhead):
        raise PhaseError(f"exact_window takes WindowAhead, got {type(ahead).__name__}")
    num_reqs = len(ahead.reqs)
    given: object = num_accepted  # callers without mypy may pass anything
    if (
        not isinstance(given, np.ndarray)
        or num_accepted.dtype.kind not in "iu"
        or num_accepted.shape != (num_reqs,)
    ):
        raise DraftError(f"num_accepted: expected a numpy integer array [{num_reqs}]")
    accepted = num_accepted.astype(np.int64)
    bad = (accepted < 0) | (accepted > ahead.prior_drafts)
    if bad.any():
        row = int(bad.argmax())
        raise DraftError(
            f"row {row} accepted {int(accepted[row])} of {int(ahead.prior_drafts[row])} drafts"
        )
    expect_pools(pools)
    slots = ahead.req_pool_indices.host
    if (
        (slots.shape[0] and not (int(slots.min()) >= 1 and int(slots.max()) <= pools.max_reqs))
        or not same(pools.slot_gens[slots], ahead.gens)
        or not same(pools.slot_tokens[slots], ahead.seq_lens.bound)
    ):
        raise DraftError("the pools do not hold this window: pass the pools verify_ahead returned")
    committed = ahead.floor + accepted + 1  # the token after the accepted ones included
    held = committed + ahead.draft_lens
    shrunk = pools.shrink_slots(slots, held)
    if not isinstance(shrunk, Success):
        raise DraftError(f"the pools do not own this window's slots: {shrunk.failure()}")
    qo_indptr = ahead.qo_indptr.host.astype(np.int64)
    token_rows = np.repeat(np.arange(num_reqs), ahead.draft_lens + 1)
    within = np.arange(token_rows.shape[0]) - qo_indptr[:-1][token_rows]
    cells = pools.table.host[slots[token_rows], committed[token_rows] - 1 + within]
    out_cache_loc: HostArray = cells.astype(np.int64)
    out_side, lens_side = upload((out_cache_loc, held), ahead.device)
    verifying = Verifying(
        ahead.device,
        ahead.reqs,
        ahead.rids,
        ahead.gens,
        ahead.req_pool_indices,
        ahead.draft_lens,
        DeviceOnly(lens_side),
        Mirrored.trusted(frozen(out_cache_loc), out_side),
        ahead.columns,
    )
    return VerifyStep(verifying, shrunk.unwrap().commit())
