"""The engine: a continuous-batching loop composed only of batchstate's public transitions.

One step either extends newly admitted requests and merges them into the
running batch, or decodes the running batch (retracting the newest requests
while the KV pool is too small for everyone's next token). Then finished
rows are filtered out and their memory released. See docs/engine.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from itertools import islice
from time import perf_counter
from typing import TypeVar, final

import attrs
from returns.result import Result

from batchstate import (
    AllocError,
    CachedPools,
    CachedStep,
    DecodeError,
    Decoding,
    Departed,
    Extended,
    Filtered,
    Idle,
    InvariantViolation,
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    Pools,
    ReleaseError,
    Req,
    Step,
    check_batch,
    check_cached_pools,
    check_pools,
    decode,
    decode_cached,
    extend,
    extend_cached,
    idle,
    merge,
    release,
    release_cached,
    split,
)
from batchstate.engine._admission import Budget, choose, reserve
from batchstate.engine._reads import ReadCounter
from batchstate.engine._sources import TokenSource
from batchstate.engine._trace import Trace
from batchstate.engine._workload import END_TOKEN, RequestSpec

__all__ = ["Engine", "EngineConfig", "EngineError"]

_T = TypeVar("_T")


class EngineError(RuntimeError):
    """The engine cannot go on: a transition failed in a way its policy rules out (a bug)."""


@final
@attrs.frozen
class EngineConfig:
    """Scheduling knobs; the pools' sizes live in the `Pools` handed to the engine."""

    max_running: int = 32
    max_prefill_tokens: int = 1024
    new_token_ratio: float = 0.3  # share of remaining output reserved at admission
    headroom_pages: int = 1  # pages reserved per request at admission
    check_every: int = 0  # check_batch/check_pools every N steps; 0 = only at the end
    audit_every: int = 16  # count device reads on every Nth step's decode path


@final
@attrs.define
class _Live:
    spec: RequestSpec
    generated: list[int]


@final
class Engine:
    """Runs a workload to the end. Holds the mutable loop state around immutable records.

    Args:
        specs: the workload, in arrival order.
        pools: empty pools for the run; `CachedPools` runs with a prefix cache
            (finished requests' KV is cached, extends read cached prefixes).
        tokens: runs the forwards (a model) or draws tokens (meta).
        counter: counts device reads on audited steps; None counts none.
    """

    def __init__(
        self,
        config: EngineConfig,
        specs: Sequence[RequestSpec],
        pools: Pools | CachedPools,
        tokens: TokenSource,
        counter: ReadCounter | None = None,
    ) -> None:
        self.config, self.pools, self.tokens, self.counter = config, pools, tokens, counter
        self.running: Filtered | Idle = idle(pools.table.device.device)
        self.pending = deque(sorted(specs, key=lambda spec: spec.arrival_step))
        self.prompts: dict[int, tuple[int, ...]] = {}  # rid -> its whole prompt, once it arrived
        self.waiting: deque[Req] = deque()
        self.live: dict[int, _Live] = {}
        self.outputs: dict[int, tuple[int, ...]] = {}
        self.trace = Trace()
        self.clock = 0  # engine steps, the unit of arrival times
        self._bookkeeping_s = 0.0
        self._audited = False

    def run(self, on_step: Callable[[int], None] | None = None) -> None:
        """Step until every request has finished; `on_step(num_finished)` after each step.

        Raises:
            EngineError: a transition failed in a way the policy rules out.
            InvariantViolation: a periodic or final check failed (prefixed with the step).
        """
        while self.pending or self.waiting or len(self.running.rows):
            if not self.waiting and not len(self.running.rows):
                self.clock = max(self.clock, self.pending[0].arrival_step)  # skip idle steps
            while self.pending and self.pending[0].arrival_step <= self.clock:
                spec = self.pending[0]
                if spec.follows is not None and spec.follows not in self.outputs:
                    if not self.waiting and not len(self.running.rows):
                        raise EngineError(f"request {spec.rid} follows one that never ran")
                    break  # a follow-up turn waits for the conversation's last answer
                self.pending.popleft()
                prompt = spec.prompt
                if spec.follows is not None:
                    # The conversation so far (its prompt and answer), then the new turn.
                    prompt = self.prompts[spec.follows] + self.outputs[spec.follows] + prompt
                self.prompts[spec.rid] = prompt
                self.live[spec.rid] = _Live(attrs.evolve(spec, prompt=prompt, follows=None), [])
                self.waiting.append(Req(spec.rid, prompt))
            self._step()
            self.clock += 1
            every = self.config.check_every
            if every and len(self.trace) % every == 0:
                self.check()
            if on_step is not None:
                on_step(len(self.outputs))
        self.check()

    def check(self) -> None:
        """Check the running batch and the pools (conservation, ownership of every row).

        Raises:
            InvariantViolation: which invariant, with the step it was found after.
        """
        try:
            check_batch(self.running)
            if isinstance(self.pools, CachedPools):
                check_cached_pools(self.pools, [self.running])
            else:
                check_pools(self.pools, [self.running])
        except InvariantViolation as error:
            raise InvariantViolation(f"after step {len(self.trace)}: {error}") from error
        self.trace.num_checks += 1

    def _step(self) -> None:
        start = perf_counter()
        self._bookkeeping_s = 0.0
        self._audited = bool(self.config.audit_every) and (
            len(self.trace) % self.config.audit_every == 0
        )
        extended = self._admit()
        batch: Extended | Decoding
        if extended is not None:
            batch, sampled = extended, self.tokens.after_extend(extended, self.pools)
        else:
            batch = self._decode()
            last = [self.live[rid].generated[-1] for rid in batch.rows.rids.tolist()]
            sampled = self.tokens.after_decode(batch, self.pools, last)
        keep, done = self._record(batch, sampled)
        self._timed(lambda: self._retire(batch, keep, done))
        used = (self.pools.num_pages * self.pools.page_size) - self.pools.num_free_tokens
        if isinstance(self.pools, CachedPools):  # cached but evictable pages count as free
            used = (self.pools.num_pages * self.pools.page_size) - self.pools.num_available_tokens
        self.trace.append(
            is_extend=isinstance(batch, Extended),
            batch_size=len(batch.rows),
            kv_tokens_used=used,
            step_s=perf_counter() - start,
            bookkeeping_s=self._bookkeeping_s,
            audited=self._audited,
        )

    def _admit(self) -> Extended | None:
        if not self.waiting:
            return None
        pools, running = self.pools, self.running.rows
        budget = Budget(
            min(self.config.max_running - len(running), pools.num_free_slots),
            pools.num_available_tokens if isinstance(pools, CachedPools) else pools.num_free_tokens,
            reserve(
                map(self._remaining, running.rids.tolist()),
                pools.page_size,
                self.config.new_token_ratio,
                self.config.headroom_pages,
            ),
            self.config.max_prefill_tokens,
            pools.page_size,
            self.config.new_token_ratio,
            self.config.headroom_pages,
            anything_running=bool(len(running)),
        )
        # Lazily: `choose` stops early, so a long queue costs nothing past its front.
        remaining = (self._remaining(req.rid) for req in self.waiting)
        reqs = list(islice(self.waiting, choose(self.waiting, remaining, budget)))
        while reqs:
            result = self._timed(lambda: self._extend(reqs, pools), audit=False)
            step = result.value_or(None)
            if step is not None:
                self._count_cache(pools, step.pools)
                self.pools = step.pools
                for _ in reqs:
                    self.waiting.popleft()
                batch = step.batch
                self.trace.prefill_computed += batch.extend_num_tokens
                self.trace.prefill_cached += sum(batch.prefix_lens)
                self.trace.cache_hits += sum(1 for length in batch.prefix_lens if length)
                self.trace.extended_requests += len(reqs)
                return batch
            failure = result.failure()
            if not isinstance(failure, OutOfKVTokens | OutOfReqSlots):
                raise EngineError(f"extend failed: {failure}")
            reqs.pop()  # the estimate was off: try one fewer
        if not len(running):
            raise EngineError(f"nothing running and request {self.waiting[0].rid} does not fit")
        return None

    def _extend(
        self, reqs: list[Req], pools: Pools | CachedPools
    ) -> Result[Step[Extended] | CachedStep[Extended], AllocError | NotOwned]:
        device = self.running.device
        if isinstance(pools, CachedPools):
            return extend_cached(idle(device), reqs, pools)
        return extend(idle(device), reqs, pools)

    def _count_cache(self, before: Pools | CachedPools, after: Pools | CachedPools) -> None:
        # An allocation only takes pages out of the cache: what it lost was evicted.
        if isinstance(before, CachedPools) and isinstance(after, CachedPools):
            self.trace.evicted_pages += before.cache.num_pages - after.cache.num_pages

    def _decode(self) -> Decoding:
        while True:
            running = self.running
            if isinstance(running, Idle):
                raise EngineError("decode with nothing running")
            pools = self.pools
            result: Result[Step[Decoding] | CachedStep[Decoding], DecodeError] = (
                self._timed(partial(decode_cached, running, pools))
                if isinstance(pools, CachedPools)
                else self._timed(partial(decode, running, pools))
            )
            step = result.value_or(None)
            if step is not None:
                self._count_cache(pools, step.pools)
                self.pools = step.pools
                return step.batch
            failure = result.failure()
            if not isinstance(failure, OutOfKVTokens) or len(running.rows) == 1:
                raise EngineError(f"decode failed with {len(running.rows)} running: {failure}")
            self._retract(running)

    def _retract(self, running: Filtered) -> None:
        # The newest row goes back to the front of the queue, to re-prefill its
        # prompt and what it generated so far; the oldest rows keep going.
        last = len(running.rows) - 1

        def drop_last() -> Filtered:
            kept, left = split(running, list(range(last)))
            self.pools = self._release(left, kept)
            return kept

        self.running = self._timed(drop_last)
        victim = self.live[running.rows.reqs[last].rid]
        self.waiting.appendleft(Req(victim.spec.rid, victim.spec.prompt + tuple(victim.generated)))
        self.trace.num_retractions += 1

    def _record(
        self, batch: Extended | Decoding, sampled: list[int]
    ) -> tuple[list[int], list[int]]:
        keep: list[int] = []
        done: list[int] = []
        for row, (rid, token) in enumerate(zip(batch.rows.rids.tolist(), sampled, strict=True)):
            live = self.live[rid]
            live.generated.append(token)
            if token == END_TOKEN or len(live.generated) >= live.spec.max_new_tokens:
                done.append(row)
                self.outputs[rid] = tuple(live.generated)
                del self.live[rid]
            else:
                keep.append(row)
        return keep, done

    def _retire(self, batch: Extended | Decoding, keep: list[int], done: list[int]) -> None:
        kept, left = split(batch, keep)
        if done:
            self.pools = self._release(left, kept)
        self.running = merge(self.running, kept) if isinstance(batch, Extended) else kept

    def _release(self, left: Departed, running: Filtered) -> Pools | CachedPools:
        result: Result[Pools, ReleaseError] | Result[CachedPools, ReleaseError]
        if isinstance(self.pools, CachedPools):
            # The KV holds each row's prompt and all it generated but the last token.
            tokens = [self.prompts[req.rid] + self._generated(req.rid) for req in left.reqs]
            result = release_cached(left, running, self.pools, tokens)
        else:
            result = release(left, running, self.pools)
        pools: Pools | CachedPools | None = result.value_or(None)
        if pools is None:
            raise EngineError(f"release failed: {result.failure()}")
        return pools

    def _timed(self, work: Callable[[], _T], *, audit: bool = True) -> _T:
        # Bookkeeping time is the batchstate calls alone; on audited steps the
        # decode-path calls also run under the read counter (and are not timed
        # into the per-step average, see Trace).
        start = perf_counter()
        if audit and self._audited and self.counter is not None:
            with self.counter() as reads:
                result = work()
            self.trace.device_reads += reads[0]
        else:
            result = work()
        self._bookkeeping_s += perf_counter() - start
        return result

    def _generated(self, rid: int) -> tuple[int, ...]:
        live = self.live.get(rid)
        return tuple(live.generated) if live is not None else self.outputs[rid]

    def _remaining(self, rid: int) -> int:
        live = self.live[rid]
        return live.spec.max_new_tokens - len(live.generated)
