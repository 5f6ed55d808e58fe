"""Release: give back the memory of requests that left the batch."""

from __future__ import annotations

from collections.abc import Sequence

from returns.result import Failure, Result

from batchstate.base.errors import NotOwned, PhaseError, ReleaseError, StillRunning
from batchstate.base.intersection import overlap
from batchstate.base.mirrored import HostArray, host_int64
from batchstate.columns.columns import C, D
from batchstate.pools.pools import Pools, expect_pools
from batchstate.records.chunked import Chunked
from batchstate.records.phases import Batch, Decoding, Extended, Filtered, Idle
from batchstate.records.rows import Req
from batchstate.records.verifying import Verifying, window_lens
from batchstate.transitions.filtering import Departed

__all__ = ["release"]


def release(
    left: Departed | Batch[C] | Chunked[C] | Verifying[C],
    running: Batch[D],
    pools: Pools,
    tokens: Sequence[Sequence[int]] | None = None,
) -> Result[Pools, ReleaseError]:
    """Free the request slots and KV pages of every row of `left`.

    With the prefix cache on, each row's tokens, in whole pages, go into the
    cache at the row's pages instead (and the row stops reading its cached
    prefix); pages whose tokens the cache holds already, and a partly
    filled last page, are freed. A retracted row's computed prefix stays
    cached, so admitting it again hits it.

    Args:
        left: the rows that left: `split(batch, keep).left`, or a batch whose
            rows all leave (a retracted or abandoned one), a `Chunked`
            request given up between chunks, or a `Verifying` window given
            up before `sync`.
        running: the batch that goes on; none of `left`'s slots may be in it.
        pools: the pools that own `left`'s memory.
        tokens: per row of `left`, the tokens whose KV its slot holds, from
            position 0: the prompt followed by generated tokens (only the
            first tokens the slot holds count). Default: each row's
            `input_ids`. Used only with the cache on.

    Returns:
        `Success(Pools)` with the memory free (or cached); `Failure(StillRunning)`
        if a slot is still in `running`; `Failure(NotOwned)` if a slot was
        already released, is held at another generation (released and handed
        out again) or now holds another count of tokens (`left` is stale):
        releasing twice is always refused. `pools` is unchanged either way.
        Reads nothing from the device.

    Raises:
        PhaseError: `left` or `running` is not a batch (arguments swapped, say).
        TypeError: `pools` is not `Pools`.
        StalePools: `pools` is not the newest pools.
        ValueError: `tokens` has another number of rows, or a row's tokens
            do not start with its `input_ids`.
    """
    if not isinstance(left, Departed | Idle | Extended | Decoding | Filtered | Chunked | Verifying):
        raise PhaseError(
            "release takes Departed, Chunked, Verifying or a batch as left,"
            f" got {type(left).__name__}"
        )
    if not isinstance(running, Idle | Extended | Decoding | Filtered):
        raise PhaseError(f"release takes a batch as running, got {type(running).__name__}")
    expect_pools(pools)
    reqs, slots, seq_lens, gens = _held(left, pools)
    if tokens is not None:
        _expect_tokens(reqs, tokens)
    # Rows that stayed in the same split as `left` cannot share its slots.
    if not (isinstance(left, Departed) and left.stayed is running.rows):
        still = overlap(slots, running.rows.req_pool_indices.host)
        if still.shape[0]:
            return Failure(StillRunning(tuple(still.tolist())))
    if seq_lens is None:
        return Failure(NotOwned(tuple(slots.tolist())))
    row_tokens = None  # the cache off takes none
    if pools.cache.enabled:
        row_tokens = (
            [req.input_ids for req in reqs] if tokens is None else [tuple(t) for t in tokens]
        )
    return pools.free(slots, seq_lens, row_tokens, gens=gens)


def _held(
    left: Departed | Batch[C] | Chunked[C] | Verifying[C], pools: Pools
) -> tuple[tuple[Req, ...], HostArray, HostArray | None, HostArray]:
    # The rows' requests, slots, the tokens each holds (None: pools without the window),
    # and the generation each holds its slot at.
    if isinstance(left, Departed):
        return left.reqs, left.slots, left.seq_lens, left.gens
    if isinstance(left, Chunked):
        one = host_int64([left.slot]), host_int64([left.cached]), host_int64([left.gen])
        return (left.req,), *one
    if isinstance(left, Verifying):
        slots = left.req_pool_indices.host
        return left.reqs, slots, window_lens(pools, left), left.gens
    rows = left.rows
    return rows.reqs, rows.req_pool_indices.host, rows.seq_lens.host, rows.gens


def _expect_tokens(reqs: Sequence[Req], tokens: Sequence[Sequence[int]]) -> None:
    if len(tokens) != len(reqs):
        raise ValueError(f"tokens for {len(tokens)} rows, {len(reqs)} rows left")
    for req, ids in zip(reqs, tokens, strict=True):
        if tuple(ids[: len(req.input_ids)]) != req.input_ids:
            raise ValueError(f"request {req.rid}: its tokens do not start with its input_ids")
