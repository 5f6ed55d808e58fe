"""Stage one of a step: admit. Prebuilt arrivals, then whole prompts (extend) or chunks (mix).

The policy orders the queue and says how many fit the budget (`Budget`:
free slots and KV tokens less the running rows' reserve); this stage runs
the transition, and when the pools refuse (the estimate was off) runs it
again with as many as the refusal says fit. Prebuilt arrivals at the front
of the queue go first, in a step of their own (a `Transfer`); held chunks
go before new requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from itertools import islice, takewhile
from typing import Protocol, TypeVar

import torch
from returns.result import Result

from batchstate import (
    BatchAndPools,
    Chunked,
    Extended,
    ExtendError,
    Filtered,
    Idle,
    Mixed,
    MixError,
    MixStep,
    OutOfKVTokens,
    OutOfReqSlots,
    Pools,
    Req,
    Sampled,
    Sampling,
    admit_prefilled,
    extend,
    gather_sampled,
    idle,
    mix,
)
from batchstate.engine._admission import Budget, reserve
from batchstate.engine._config import EngineError
from batchstate.engine._forwards import ExtendForward, MixedForward, Transfer
from batchstate.engine._overlap_verify import close_window
from batchstate.engine._state import EngineState, Running

__all__ = ["admit", "admit_chunks", "columns_of", "mix_rows", "running_tokens"]


class _Stepped(Protocol):
    # What an admitting transition returns: `BatchAndPools` and `MixStep` both.
    @property
    def pools(self) -> Pools: ...


_Item = TypeVar("_Item", Req, Req | Chunked[Sampling])
_Step = TypeVar("_Step", bound=_Stepped)


def admit(state: EngineState) -> Transfer | ExtendForward | MixedForward | None:
    """The step's admissions, their memory taken from the pools; None: nobody admitted."""
    if state.window is not None and (state.waiting or state.held):
        close_window(state)  # admissions join a running batch: the verify window syncs first
    ordered = state.policy.order(state.waiting)
    if ordered is not state.waiting:
        state.waiting = deque(ordered)
    arrivals = _admit_prebuilt(state)
    if arrivals is not None:
        return arrivals
    if state.config.uses_mix:
        batch = admit_chunks(state)
        return None if batch is None else MixedForward(batch)
    extended = _admit_whole(state)
    return None if extended is None else ExtendForward(extended)


def _budget(state: EngineState, num_rows: int, max_prefill_tokens: int) -> Budget:
    # What the pools can give, less what held chunks still need and the running rows' reserve.
    pools, running, config = state.pools, state.running.rows, state.config
    return Budget(
        min(num_rows, pools.num_free_slots),
        pools.num_available_tokens - sum(chunk.remaining for chunk in state.held),
        reserve(
            map(state.remaining, running.rids.tolist()),
            pools.page_size,
            config.new_token_ratio,
            config.headroom_pages,
        ),
        max_prefill_tokens,
        pools.page_size,
        config.new_token_ratio,
        config.headroom_pages,
        anything_running=bool(len(running)) or bool(state.held),
    )


def _chosen(state: EngineState, budget: Budget) -> int:
    # The policy's count over the requests this engine prefills (lazily: it stops early).
    remaining = (state.remaining(req.rid) for req in state.waiting)
    return state.policy.admit(_local(state), remaining, budget)


def _admit_whole(state: EngineState) -> Extended[Sampling] | None:
    # Whole prompts, extended in one forward; merged into the running rows after it.
    if not state.waiting:
        return None
    running = state.running.rows
    budget = _budget(
        state, state.config.max_running - len(running), state.config.max_prefill_tokens
    )
    reqs = list(islice(state.waiting, _chosen(state, budget)))
    device = state.running.device

    def attempt(
        reqs: list[Req],
    ) -> Callable[[], Result[BatchAndPools[Extended[Sampling]], ExtendError]]:
        # The admitted rows' own sampling parameters, in row order, in one upload.
        return partial(_extend, device, reqs, state.pools, columns_of(state, reqs, device))

    step = _fewer_until_it_fits(state, reqs, attempt, "extend", audit=False)
    if step is not None:
        for _ in reqs:
            state.waiting.popleft()
        batch = step.batch
        state.trace.prefill_computed += batch.extend_num_tokens
        state.trace.prefill_cached += int(batch.prefix_lens.sum())
        state.trace.cache_hits += int((batch.prefix_lens > 0).sum())
        state.trace.extended_requests += len(reqs)
        return batch
    if not len(running):
        raise EngineError(f"nothing running and request {state.waiting[0].rid} does not fit")
    return None


def admit_chunks(state: EngineState) -> Mixed[Sampling] | None:
    """Held chunks first, then waiting requests that fit, in one `mix` under the chunk budget.

    With mixed steps the running rows decode in the same forward; without,
    they sit the prefill step out (parked) and join after it.
    """
    if not state.held and not state.waiting:
        return None
    config, running = state.config, state.running
    held = list(state.held)
    room = config.max_running - len(running.rows) - len(held)
    chosen = _chosen(state, _budget(state, room, 1 << 62)) if room > 0 else 0
    # The chunk budget, not the prefill cap, limits a mixed step (1 << 62 above).
    admit: list[Req | Chunked[Sampling]] = [*held, *islice(state.waiting, chosen)]
    base = running if config.mixed else idle(running.rows.device, Sampling)
    budget = state.policy.chunk_budget(config)

    def attempt(
        admit: list[Req | Chunked[Sampling]],
    ) -> Callable[[], Result[MixStep[Sampling], MixError]]:
        tokens = running_tokens(state, base)
        columns = columns_of(state, admit, base.rows.device)
        return partial(mix_rows, base, admit, budget, state.pools, tokens, columns)

    step = _fewer_until_it_fits(state, admit, attempt, "mix")
    return None if step is None else _admitted(state, step.batch, len(held))


def _admitted(state: EngineState, batch: Mixed[Sampling], num_held: int) -> Mixed[Sampling]:
    taken = batch.num_extend_rows
    # Rows past the held chunks are new requests: their prefix is what they read cached.
    cached = batch.prefix_lens[min(taken, num_held) : taken]
    state.trace.prefill_cached += int(cached.sum())
    state.trace.cache_hits += int((cached > 0).sum())
    state.trace.extended_requests += max(taken - num_held, 0)
    for _ in range(min(taken, num_held)):
        state.held.popleft()
    for _ in range(max(taken - num_held, 0)):
        state.waiting.popleft()
    if not state.config.mixed:
        # A prefill-only step: the running rows wait; merged in after finish_mixed.
        state.parked = state.running
        state.running = idle(state.running.rows.device, Sampling)
    return batch


def running_tokens(state: EngineState, running: Running) -> list[int] | Sampled:
    """Each running row's input token: the last one the host knows, or (overlap) the device's."""
    if isinstance(running, Idle):
        return []
    if state.config.overlap and state.unread is not None and state.device_tokens is not None:
        return state.timed(partial(gather_sampled, state.device_tokens, running))
    return state.last_tokens(running.rows.rids.tolist())


def _admit_prebuilt(state: EngineState) -> Transfer | None:
    # The prebuilt arrivals at the front of the queue, if any fit, in a step of their
    # own: no forward; the next step decodes them with the running rows.
    arrivals = list(takewhile(lambda req: _arrives_prebuilt(state, req), state.waiting))
    if not arrivals:
        return None
    config = state.config
    num_rows = config.max_running - len(state.running.rows) - len(state.held)
    # No prompt is computed here, so the prefill budget does not apply.
    budget = _budget(state, max(num_rows, 0), 1 << 62)
    remaining = (state.remaining(req.rid) for req in arrivals)
    reqs = arrivals[: state.policy.admit(arrivals, remaining, budget)]
    device = state.running.device

    def attempt(
        reqs: list[Req],
    ) -> Callable[[], Result[BatchAndPools[Filtered[Sampling]], ExtendError]]:
        return partial(_prebuilt, device, reqs, state.pools, columns_of(state, reqs, device))

    step = _fewer_until_it_fits(state, reqs, attempt, "prebuilt", audit=False)
    if step is None:
        return None  # none fits: the step runs without them
    for _ in reqs:
        state.waiting.popleft()
    return Transfer(step.batch, [req.input_ids for req in reqs])


def _fewer_until_it_fits(
    state: EngineState,
    items: list[_Item],
    attempt: Callable[[list[_Item]], Callable[[], Result[_Step, ExtendError | MixError]]],
    what: str,
    *,
    audit: bool = True,
) -> _Step | None:
    # Run the transition `attempt` builds for `items` (its inputs built untimed, the
    # call timed); when the pools run short (the policy's estimate was off), run it
    # again with the requests its failure says fit (`fits`, from the first). `items`
    # ends as the ones admitted. The pools move on with the step that succeeded;
    # None: not even one fits.
    while items:
        result = state.timed(attempt(items), audit=audit)
        step = result.value_or(None)
        if step is not None:
            state.pools = step.pools
            return step
        failure = result.failure()
        if not isinstance(failure, OutOfKVTokens | OutOfReqSlots):
            raise EngineError(f"{what} failed: {failure}")
        del items[failure.fits :]
    return None


def _arrives_prebuilt(state: EngineState, req: Req) -> bool:
    # Prefilled elsewhere and not admitted yet. A retracted one has tokens: it
    # re-queues as an ordinary request and is prefilled here.
    live = state.live[req.rid]
    return live.spec.prebuilt and not live.generated


def _local(state: EngineState) -> Iterator[Req]:
    # The waiting requests this engine prefills: those before the first prebuilt
    # arrival (first come, first served: the arrival goes first, in a prebuilt step).
    return takewhile(lambda req: not _arrives_prebuilt(state, req), state.waiting)


def columns_of(
    state: EngineState, admit: Sequence[Req | Chunked[Sampling]], device: torch.device
) -> Sampling:
    """The new requests' own parameters, one row each (a held chunk carries its own)."""
    params = [state.sampling[item.rid] for item in admit if isinstance(item, Req)]
    return Sampling.of(params, device)


# The transitions for records carrying Sampling columns: one signature each, for `partial`.


def _extend(
    device: torch.device, reqs: Sequence[Req], pools: Pools, columns: Sampling
) -> Result[BatchAndPools[Extended[Sampling]], ExtendError]:
    return extend(idle(device, Sampling), reqs, pools, columns)


def _prebuilt(
    device: torch.device, reqs: Sequence[Req], pools: Pools, columns: Sampling
) -> Result[BatchAndPools[Filtered[Sampling]], ExtendError]:
    return admit_prefilled(idle(device, Sampling), reqs, pools, columns)


def mix_rows(  # noqa: PLR0917  # mix's own arguments, in its order
    running: Running,
    admit: Sequence[Req | Chunked[Sampling]],
    budget: int,
    pools: Pools,
    tokens: Sequence[int] | Sampled,
    columns: Sampling,
) -> Result[MixStep[Sampling], MixError]:
    """`mix` for a batch carrying Sampling columns."""
    return mix(running, admit, budget, pools, tokens, columns)
