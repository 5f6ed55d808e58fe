"""The engine: a continuous-batching loop composed only of batchstate's public transitions.

One step either extends newly admitted requests and merges them into the
running batch, or decodes the running batch (retracting the newest requests
while the KV pool is too small for everyone's next token). Then finished
rows are filtered out and their memory released. With a chunk budget,
mixed steps or overlap (`EngineConfig`), admissions go through `mix`
instead: prompts in chunks, decode rows in the same forward, and with
overlap the sampled tokens stay on the device until the next step is
built. Requests prefilled elsewhere (`RequestSpec.prebuilt`) are admitted
with `prebuilt` in a step of their own that runs no forward: the token
source transfers their KV and first token, and the next step decodes them.
See docs/engine.md.

Each request samples with its own `SamplingParams`, carried by the running
batch as `Sampling` columns: admitted with each extend (or mix, where a held
chunk keeps its own row) and moved by every transition after it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from itertools import islice, takewhile
from time import perf_counter
from typing import TypeAlias, TypeVar, final

import attrs
import torch
from returns.result import Result

from batchstate import (
    Chunked,
    Decoding,
    Departed,
    Extended,
    ExtendError,
    Filtered,
    Idle,
    InvariantViolation,
    Mixed,
    MixError,
    MixStep,
    OutOfKVTokens,
    OutOfReqSlots,
    Pools,
    Req,
    Sampled,
    Sampling,
    Step,
    check_batch,
    check_leaks,
    check_pools,
    decode,
    decode_sampled,
    extend,
    follow,
    idle,
    join_sampled,
    merge,
    mix,
    prebuilt,
    release,
    settle,
    split,
    sync,
    verify,
)
from batchstate.engine._admission import Budget, choose, reserve
from batchstate.engine._reads import ReadCounter
from batchstate.engine._sources import TokenSource
from batchstate.engine._trace import Trace
from batchstate.engine._workload import END_TOKEN, RequestSpec

__all__ = ["Engine", "EngineConfig", "EngineError"]

_T = TypeVar("_T")
# The running batch, carrying each row's sampling parameters.
_Running: TypeAlias = Filtered[Sampling] | Idle[Sampling]


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
    chunk_size: int = 0  # prompt tokens per step, cut into chunks; 0: whole prompts
    mixed: bool = False  # admissions run in the same forward as the decode rows
    overlap: bool = False  # sampled tokens stay on the device; finish checks one step late
    speculative: int = 0  # draft tokens verified per decode step; 0: no speculation

    @property
    def uses_mix(self) -> bool:
        """Whether admissions go through `mix` (chunks, mixed steps or overlap)."""
        return bool(self.chunk_size) or self.mixed or self.overlap


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
        pools: empty pools for the run; with their prefix cache on, prefills
            read cached prefixes and publish their pages, and finished
            requests' KV stays cached.
        tokens: runs the forwards (a model) or draws tokens (meta).
        counter: counts device reads on audited steps; None counts none.
    """

    def __init__(
        self,
        config: EngineConfig,
        specs: Sequence[RequestSpec],
        pools: Pools,
        tokens: TokenSource,
        counter: ReadCounter | None = None,
    ) -> None:
        self.config, self.pools, self.tokens, self.counter = config, pools, tokens, counter
        device = pools.table.device.device
        self.running: _Running = idle(device, Sampling)
        self.pending = deque(sorted(specs, key=lambda spec: spec.arrival_step))
        self.prompts: dict[int, tuple[int, ...]] = {}  # rid -> its whole prompt, once it arrived
        self.sampling = {spec.rid: spec.sampling for spec in specs}  # rid -> its parameters
        self.waiting: deque[Req] = deque()
        self.live: dict[int, _Live] = {}
        self.outputs: dict[int, tuple[int, ...]] = {}
        self.trace = Trace()
        self.clock = 0  # engine steps, the unit of arrival times
        self._bookkeeping_s = 0.0
        self._audited = False
        self.held: deque[Chunked[Sampling]] = deque()  # requests between chunks, oldest first
        # Overlap: the last forward's tokens, not yet read, and whose rows to record.
        self.unread: Sampled | None = None
        self.unread_rids: set[int] = set()
        # Overlap: every running row's last token on the device (it may hold finished rows').
        self.device_tokens: Sampled | None = None
        self._parked: _Running | None = None  # running rows sitting out a prefill step

    def run(self, on_step: Callable[[int], None] | None = None) -> None:
        """Step until every request has finished; `on_step(num_finished)` after each step.

        Raises:
            EngineError: a transition failed in a way the policy rules out.
            InvariantViolation: a periodic or final check failed (prefixed with the step).
        """
        while self.busy:
            if self.pending and not (self.waiting or len(self.running.rows) or self.held):
                self.clock = max(self.clock, self.pending[0].arrival_step)  # skip idle steps
            self.arrive()
            self.step()
            if on_step is not None:
                on_step(len(self.outputs))
        self.check()

    @property
    def busy(self) -> bool:
        """Whether any request is still to come, waiting, held, running or unread."""
        return bool(
            self.pending or self.waiting or len(self.running.rows) or self.held or self.unread
        )

    @property
    def load(self) -> int:
        """Requests this engine holds: pending, waiting, held between chunks and running."""
        return len(self.pending) + len(self.waiting) + len(self.held) + len(self.running.rows)

    def submit(self, spec: RequestSpec) -> None:
        """Hand the engine one more request; it joins the queue at `spec.arrival_step`."""
        self.sampling[spec.rid] = spec.sampling
        self.pending.append(spec)

    def arrive(self) -> None:
        """Queue the requests whose arrival step has come (a follow-up once its turn is due)."""
        while self.pending and self.pending[0].arrival_step <= self.clock:
            spec = self.pending[0]
            if spec.follows is not None and spec.follows not in self.outputs:
                # Waiting, held between chunks, running or unread: its answer will come.
                if spec.follows not in self.live and all(
                    later.rid != spec.follows for later in self.pending
                ):
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

    def step(self) -> None:
        """Run one step over the queued and running requests, then advance the clock.

        Raises:
            EngineError, InvariantViolation: as for `run`.
        """
        self._step()
        self._advance()

    def idle_step(self) -> None:
        """Run one step with nothing to do: the empty running record goes through the forward.

        One process skips such steps; ranks that share a forward must all take
        part in every step, and a rank with no work takes part with no rows
        (an `Idle` record, or a `Filtered` one whose rows all finished).
        """
        running = self.running
        if len(running.rows):
            raise EngineError(f"an idle step with {len(running.rows)} rows running")
        start = perf_counter()
        self.tokens.after_idle(running)
        self.trace.append(
            is_extend=False, batch_size=0, kv_tokens_used=self._used(),
            step_s=perf_counter() - start, bookkeeping_s=0.0, audited=False,
        )  # fmt: skip
        self.trace.idle_steps += 1
        self._advance()

    def _advance(self) -> None:
        self.clock += 1
        self.trace.evicted_pages = self.pools.cache.num_evicted
        self.trace.duplicate_tokens_freed = self.pools.num_retired * self.pools.page_size
        every = self.config.check_every
        if every and len(self.trace) % every == 0:
            self.check()

    def check(self) -> None:
        """Check the running batch and the pools (conservation, ownership of every row).

        Raises:
            InvariantViolation: which invariant, with the step it was found after.
        """
        try:
            check_batch(self.running)
            check_pools(self.pools, [self.running])
            check_leaks(self.pools, [self.running, *self.held])
        except InvariantViolation as error:
            raise InvariantViolation(f"after step {len(self.trace)}: {error}") from error
        self.trace.num_checks += 1

    def _step(self) -> None:
        start = perf_counter()
        self._bookkeeping_s = 0.0
        self._audited = bool(self.config.audit_every) and (
            len(self.trace) % self.config.audit_every == 0
        )
        if self._prebuilt_step(start):
            return
        if self.config.uses_mix:
            self._mixed_step(start)
            return
        extended = self._admit()
        if extended is None and self.config.speculative:
            self._speculative_step(start)
            return
        batch: Extended[Sampling] | Decoding[Sampling]
        if extended is not None:
            batch, sampled = extended, self.tokens.after_extend(extended, self.pools)
        else:
            batch = self._decode()
            last = [self.live[rid].generated[-1] for rid in batch.rows.rids.tolist()]
            sampled = self.tokens.after_decode(batch, self.pools, last)
        rids = batch.rows.rids.tolist()
        done = self._record_tokens(zip(rids, sampled, strict=True))
        keep = [row for row, rid in enumerate(rids) if rid not in done]
        self._timed(lambda: self._retire(batch, keep))
        self.trace.append(
            is_extend=isinstance(batch, Extended),
            batch_size=len(batch.rows),
            kv_tokens_used=self._used(),
            step_s=perf_counter() - start,
            bookkeeping_s=self._bookkeeping_s,
            audited=self._audited,
        )

    def _admit(self) -> Extended[Sampling] | None:
        if not self.waiting:
            return None
        pools, running = self.pools, self.running.rows
        budget = Budget(
            min(self.config.max_running - len(running), pools.num_free_slots),
            pools.num_available_tokens,
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
        reqs = list(islice(self.waiting, choose(self._local(), remaining, budget)))
        while reqs:
            result = self._timed(lambda: self._extend(reqs, pools), audit=False)
            step = result.value_or(None)
            if step is not None:
                self.pools = step.pools
                for _ in reqs:
                    self.waiting.popleft()
                batch = step.batch
                self.trace.prefill_computed += batch.extend_num_tokens
                self.trace.prefill_cached += int(batch.prefix_lens.sum())
                self.trace.cache_hits += int((batch.prefix_lens > 0).sum())
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
        self, reqs: list[Req], pools: Pools
    ) -> Result[Step[Extended[Sampling]], ExtendError]:
        device = self.running.device
        # The admitted rows' own sampling parameters, in row order, in one upload.
        columns = Sampling.of([self.sampling[req.rid] for req in reqs], device)
        return extend(idle(device, Sampling), reqs, pools, columns)

    def _decode(self) -> Decoding[Sampling]:
        while True:
            running = self.running
            if isinstance(running, Idle):
                raise EngineError("decode with nothing running")
            result = self._timed(partial(decode, running, self.pools))
            step = result.value_or(None)
            if step is not None:
                self.pools = step.pools
                return step.batch
            failure = result.failure()
            if not isinstance(failure, OutOfKVTokens) or len(running.rows) == 1:
                raise EngineError(f"decode failed with {len(running.rows)} running: {failure}")
            self._retract(running)

    # ---- speculative decoding: drafts verified by the target ------------------------------

    def _speculative_step(self, start: float) -> None:
        # Overlap: the last forward's tokens first; the drafts start from them.
        done = self._read_unread() if self.unread is not None else set()
        if done and isinstance(self.running, Filtered):
            rids = self.running.rows.rids.tolist()
            self._retire_rows(
                self.running, [row for row, rid in enumerate(rids) if rid not in done]
            )
        if not len(self.running.rows):
            self.tokens.after_idle(self.running)  # every forward's rows finished one step late
            self.trace.append(
                is_extend=False, batch_size=0, kv_tokens_used=self._used(), step_s=0.0,
                bookkeeping_s=0.0, audited=False,
            )  # fmt: skip
            return
        batch = self._decode()
        rids = batch.rows.rids.tolist()
        histories = [self.prompts[rid] + tuple(self.live[rid].generated) for rid in rids]
        counts = [
            self._draft_count(rid, int(n))
            for rid, n in zip(rids, batch.rows.seq_lens.host, strict=True)
        ]
        drafts = self.tokens.draft(histories, counts)
        result = self._timed(partial(verify, batch, [len(row) for row in drafts], self.pools))
        step = result.value_or(None)
        if step is None:  # no room for the drafts' KV: this step decodes one token
            drafts = [[] for _ in rids]
            step = self._timed(partial(verify, batch, [0] * len(rids), self.pools)).unwrap()
        window, self.pools = step
        committed = batch.rows.seq_lens.host
        tokens = [[history[-1], *row] for history, row in zip(histories, drafts, strict=True)]
        verified = self.tokens.after_verify(window, self.pools, committed, tokens)
        running, self.pools = self._timed(partial(sync, window, verified.accepted, self.pools))
        accepted = (running.rows.seq_lens.host - committed).tolist()
        finished = self._record_tokens_each(rids, verified.targets, accepted)
        self._retire_rows(running, [row for row, rid in enumerate(rids) if rid not in finished])
        if self.config.overlap and isinstance(self.running, Filtered):
            # The next step may take its tokens from the device: they are host-known here.
            self.device_tokens = self._uploaded(self.running)
        self.trace.speculative_steps += 1
        self.trace.drafted_tokens += sum(len(row) for row in drafts)
        self.trace.accepted_drafts += sum(accepted)
        self.trace.append(
            is_extend=False, batch_size=len(rids), kv_tokens_used=self._used(),
            step_s=perf_counter() - start, bookkeeping_s=self._bookkeeping_s,
            audited=self._audited,
        )  # fmt: skip

    def _draft_count(self, rid: int, seq_len: int) -> int:
        # No more drafts than the request may still output (past its next token) or
        # than fit in its table row.
        room = self.pools.max_context_len - seq_len
        return max(min(self.config.speculative, self._remaining(rid) - 1, room), 0)

    def _record_tokens_each(
        self, rids: Sequence[int], targets: Sequence[Sequence[int]], accepted: Sequence[int]
    ) -> set[int]:
        # Each row's accepted drafts and the target's token after them, up to a stop.
        done = set()
        for rid, outs, count in zip(rids, targets, accepted, strict=True):
            for token in outs[: count + 1]:
                if self._record_tokens([(rid, token)]):
                    done.add(rid)
                    break
        return done

    def _retire_rows(self, running: Filtered[Sampling], keep: list[int]) -> None:
        self.running = self._kept(running, keep)

    def _kept(
        self, batch: Extended[Sampling] | Decoding[Sampling] | Filtered[Sampling], keep: list[int]
    ) -> Filtered[Sampling]:
        # The rows at `keep`; the others leave, and their memory goes back to the pools.
        kept, left = split(batch, keep)
        if len(keep) < len(batch.rows):
            self.pools = self._release(left, kept)
        return kept

    def _uploaded(self, running: Filtered[Sampling]) -> Sampled:
        last = [self.live[rid].generated[-1] for rid in running.rows.rids.tolist()]
        tokens = torch.tensor(last, dtype=torch.int64, device=running.rows.device)
        return Sampled.of(running.rows, tokens)

    # ---- prebuilt arrivals: KV and first token from a prefill server ------------------------

    def _prebuilt_step(self, start: float) -> bool:
        # The prebuilt arrivals at the front of the queue, if any fit, in a step of their
        # own: no forward; the next step decodes them with the running rows.
        arrivals = list(takewhile(self._arrives_prebuilt, self.waiting))
        if not arrivals:
            return False
        pools = self.pools
        reqs = arrivals[: self._choose_prebuilt(arrivals, pools)]
        step = self._place_prebuilt(reqs, pools)
        if step is None:
            return False  # none fits: the step runs without them
        self.pools = step.pools
        for _ in reqs:
            self.waiting.popleft()
        batch = step.batch
        firsts = self.tokens.transfer(batch, step.pools, [req.input_ids for req in reqs])
        rids = batch.rows.rids.tolist()
        done = self._record_tokens(zip(rids, firsts, strict=True))
        keep = [row for row, rid in enumerate(rids) if rid not in done]
        self._timed(lambda: self._retire_prebuilt(batch, keep))
        self.trace.prebuilt_requests += len(reqs)
        self.trace.prebuilt_steps += 1
        self.trace.append(
            is_extend=False, batch_size=0, kv_tokens_used=self._used(),
            step_s=perf_counter() - start, bookkeeping_s=self._bookkeeping_s,
            audited=self._audited,
        )  # fmt: skip
        return True

    def _arrives_prebuilt(self, req: Req) -> bool:
        # Prefilled elsewhere and not admitted yet. A retracted one has tokens: it
        # re-queues as an ordinary request and is prefilled here.
        live = self.live[req.rid]
        return live.spec.prebuilt and not live.generated

    def _local(self) -> Iterator[Req]:
        # The waiting requests this engine prefills: those before the first prebuilt
        # arrival (first come, first served: the arrival goes first, in a prebuilt step).
        return takewhile(lambda req: not self._arrives_prebuilt(req), self.waiting)

    def _choose_prebuilt(self, arrivals: list[Req], pools: Pools) -> int:
        # As for extend, less what held chunks still need; no prompt is computed here,
        # so the prefill budget does not apply.
        running, config = self.running.rows, self.config
        held_tokens = sum(chunk.remaining for chunk in self.held)
        budget = Budget(
            max(min(config.max_running - len(running) - len(self.held), pools.num_free_slots), 0),
            pools.num_available_tokens - held_tokens,
            reserve(
                map(self._remaining, running.rids.tolist()),
                pools.page_size,
                config.new_token_ratio,
                config.headroom_pages,
            ),
            1 << 62,
            pools.page_size,
            config.new_token_ratio,
            config.headroom_pages,
            anything_running=bool(len(running)) or bool(self.held),
        )
        return choose(arrivals, (self._remaining(req.rid) for req in arrivals), budget)

    def _place_prebuilt(self, reqs: list[Req], pools: Pools) -> Step[Filtered[Sampling]] | None:
        # `reqs` shrinks to the ones that were placed.
        while reqs:
            result = self._timed(partial(self._prebuilt, reqs, pools), audit=False)
            step = result.value_or(None)
            if step is not None:
                return step
            failure = result.failure()
            if not isinstance(failure, OutOfKVTokens | OutOfReqSlots):
                raise EngineError(f"prebuilt failed: {failure}")
            reqs.pop()  # the estimate was off: try one fewer
        return None

    def _prebuilt(
        self, reqs: list[Req], pools: Pools
    ) -> Result[Step[Filtered[Sampling]], ExtendError]:
        device = self.running.device
        columns = Sampling.of([self.sampling[req.rid] for req in reqs], device)
        return prebuilt(idle(device, Sampling), reqs, pools, columns)

    def _retire_prebuilt(self, batch: Filtered[Sampling], keep: list[int]) -> None:
        # Rows whose first token finished them leave at once; the rest join the running batch.
        kept = self._kept(batch, keep)
        if self.config.overlap and len(kept.rows):
            # Their first tokens, known on the host, join the running rows' on the device.
            self.device_tokens = self._joined(self.running, self._uploaded(kept))
        self.running = merge(self.running, kept)

    # ---- chunked, mixed and overlapped steps ----------------------------------------------

    def _mixed_step(self, start: float) -> None:
        batch = self._mix()
        # Nothing admitted: a decode step verifies drafts. A held chunk that could not go on
        # is left to the plain decode, which gives its memory back first when decode runs out.
        if batch is None and self.config.speculative and len(self.running.rows) and not self.held:
            self._speculative_step(start)
            return
        batch = batch or self._decode_mixed()
        if batch is None and self.unread is None and self.held:
            self._retract_held()  # nothing runs beside the held chunk: start it afresh
            batch = self._mix()
        if batch is None and self.unread is None:
            raise EngineError(f"nothing can run: {len(self.waiting)} waiting, none fits")
        sampled = (
            self.tokens.after_mixed(batch, self.pools, self._sampling_of(batch))
            if batch is not None
            else None
        )
        done: set[int] = set()
        if self.config.overlap:
            done = self._read_unread()  # the previous step's tokens, read one step late
        if batch is None:
            self.tokens.after_idle(self.running)  # no rows run; ranks sharing a forward join
            self.trace.append(
                is_extend=False, batch_size=0, kv_tokens_used=self._used(), step_s=0.0,
                bookkeeping_s=0.0, audited=False,
            )  # fmt: skip
            return
        assert sampled is not None
        if self.config.overlap:
            self.device_tokens = self._tokens_after(sampled)
        settled = self._timed(lambda: settle(batch))
        self.held.extend(settled.held)
        running = settled.running
        if not self.config.overlap:
            by_rid = dict(zip(sampled.rids.tolist(), self.tokens.read(sampled), strict=True))
            done = self._record_tokens((rid, by_rid[rid]) for rid in running.rows.rids.tolist())
        keep = [row for row, rid in enumerate(running.rows.rids.tolist()) if rid not in done]
        self.trace.overshoot_tokens += len(running.rows) - len(keep) if self.config.overlap else 0
        self._timed(lambda: self._retire_mixed(running, keep, done))
        if self.config.overlap:
            self.unread = sampled
            partial = {batch.rows.reqs[row].rid for row in batch.partial}
            self.unread_rids = set(running.rows.rids.tolist()) - done - partial
        self.trace.named_reads += 1
        self.trace.num_chunks += len(batch.partial)
        self.trace.prefill_computed += batch.num_extend_tokens
        num_decode = len(batch.rows) - batch.num_extend_rows
        self.trace.num_mixed_steps += bool(batch.num_extend_rows and num_decode)
        self.trace.append(
            is_extend=bool(batch.num_extend_rows), batch_size=len(batch.rows),
            kv_tokens_used=self._used(), step_s=perf_counter() - start,
            bookkeeping_s=self._bookkeeping_s, audited=self._audited,
        )  # fmt: skip

    def _mix(self) -> Mixed[Sampling] | None:
        # Held chunks first, then waiting requests that fit (chosen as for extend).
        if not self.held and not self.waiting:
            return None
        config, pools, running = self.config, self.pools, self.running
        held = list(self.held)
        room = config.max_running - len(running.rows) - len(held)
        chosen = self._choose(max(room, 0), len(held)) if room > 0 else 0
        admit: list[Req | Chunked[Sampling]] = [*held, *islice(self.waiting, chosen)]
        base = running if config.mixed else idle(running.rows.device, Sampling)
        budget = config.chunk_size or config.max_prefill_tokens
        while admit:
            tokens = self._tokens_for(base)
            columns = self._columns_of(admit, base.rows.device)
            result = self._timed(partial(_mix, base, admit, budget, pools, tokens, columns))
            step = result.value_or(None)
            if step is not None:
                return self._admitted(step.batch, step.pools, len(held))
            failure = result.failure()
            if not isinstance(failure, OutOfKVTokens | OutOfReqSlots):
                raise EngineError(f"mix failed: {failure}")
            admit.pop()  # the estimate was off: try one fewer
        return None

    def _admitted(self, batch: Mixed[Sampling], pools: Pools, num_held: int) -> Mixed[Sampling]:
        self.pools = pools
        taken = batch.num_extend_rows
        # Rows past the held chunks are new requests: their prefix is what they read cached.
        cached = batch.prefix_lens[min(taken, num_held) : taken]
        self.trace.prefill_cached += int(cached.sum())
        self.trace.cache_hits += int((cached > 0).sum())
        self.trace.extended_requests += max(taken - num_held, 0)
        for _ in range(min(taken, num_held)):
            self.held.popleft()
        for _ in range(max(taken - num_held, 0)):
            self.waiting.popleft()
        if not self.config.mixed:
            # A prefill-only step: the running rows wait; merged in after settle.
            self._parked = self.running
            self.running = idle(self.running.rows.device, Sampling)
        return batch

    def _decode_mixed(self) -> Mixed[Sampling] | None:
        while len(self.running.rows):
            running = self.running
            assert isinstance(running, Filtered)
            tokens = self._tokens_for(running)
            result: Result[MixStep[Sampling], MixError]
            if isinstance(tokens, Sampled):
                result = self._timed(partial(decode_sampled, running, tokens, self.pools))
            else:
                no_rows = self._columns_of((), running.rows.device)
                result = self._timed(partial(_mix, running, (), 1, self.pools, tokens, no_rows))
            step = result.value_or(None)
            if step is not None:
                self.pools = step.pools
                return step.batch
            failure = result.failure()
            if not isinstance(failure, OutOfKVTokens):
                raise EngineError(f"decode failed with {len(running.rows)} running: {failure}")
            if self.held:
                self._retract_held()
            elif len(running.rows) > 1:
                self._retract(running)
            else:
                raise EngineError(f"decode failed with 1 running: {failure}")
        return None

    def _columns_of(
        self, admit: Sequence[Req | Chunked[Sampling]], device: torch.device
    ) -> Sampling:
        # The new requests' own parameters, one row each (a held chunk carries its own).
        params = [self.sampling[item.rid] for item in admit if isinstance(item, Req)]
        return Sampling.of(params, device)

    @staticmethod
    def _sampling_of(batch: Mixed[Sampling]) -> Sampling | None:
        # The rows' parameters, from the batch's columns; None when every row is greedy
        # (the forward then takes the argmax path, as before columns).
        columns = batch.rows.columns
        return columns if columns.temperature.host.any() else None

    def _tokens_for(self, running: _Running) -> list[int] | Sampled:
        # Each running row's input token: the last one the host knows, or the device's.
        if isinstance(running, Idle):
            return []
        if self.config.overlap and self.unread is not None and self.device_tokens is not None:
            return self._timed(partial(follow, self.device_tokens, running))
        return [self.live[rid].generated[-1] for rid in running.rows.rids.tolist()]

    def _read_unread(self) -> set[int]:
        # The previous forward's tokens reach the host: the one named read of the step.
        if self.unread is None:
            return set()
        tokens = self.tokens.read(self.unread)
        rids = self.unread.rids.tolist()
        wanted = self.unread_rids
        self.unread, self.unread_rids = None, set()
        return self._record_tokens(
            (rid, token) for rid, token in zip(rids, tokens, strict=True) if rid in wanted
        )

    def _record_tokens(self, pairs: Iterable[tuple[int, int]]) -> set[int]:
        done = set()
        for rid, token in pairs:
            live = self.live[rid]
            live.generated.append(token)
            if token == END_TOKEN or len(live.generated) >= live.spec.max_new_tokens:
                done.add(rid)
                self.outputs[rid] = tuple(live.generated)
                del self.live[rid]
        return done

    def _retire_mixed(self, running: Filtered[Sampling], keep: list[int], done: set[int]) -> None:
        kept = self._kept(running, keep)
        parked = self._parked
        self._parked = None
        if parked is None:
            self.running = kept
            return
        if done and isinstance(parked, Filtered):
            # Overlap: rows that sat out this prefill step may have finished one step late.
            stay = [row for row, rid in enumerate(parked.rows.rids.tolist()) if rid not in done]
            parked = self._kept(parked, stay)
        self.running = merge(parked, kept)

    def _tokens_after(self, sampled: Sampled) -> Sampled:
        # Overlap: each running row's last token after this forward. A prefill step's
        # rows join the parked rows, whose tokens are still the last forward's.
        parked = self._parked
        return sampled if parked is None else self._joined(parked, sampled)

    def _joined(self, running: _Running, new: Sampled) -> Sampled:
        # The device tokens of `running`'s rows, then `new`'s.
        if not isinstance(running, Filtered) or self.device_tokens is None:
            return new
        return join_sampled(follow(self.device_tokens, running), new)

    def _retract_held(self) -> None:
        # The newest held chunk gives its KV back and waits for a fresh prefill.
        chunk = self.held.pop()
        result = release(chunk, self.running, self.pools)
        pools = result.value_or(None)
        if pools is None:
            raise EngineError(f"release failed: {result.failure()}")
        self.pools = pools
        self.waiting.appendleft(chunk.req)
        self.trace.num_retractions += 1

    def _choose(self, num_rows: int, num_held: int) -> int:
        pools, running = self.pools, self.running.rows
        held_tokens = sum(chunk.remaining for chunk in self.held)
        budget = Budget(
            min(num_rows, pools.num_free_slots),
            pools.num_available_tokens - held_tokens,
            reserve(
                map(self._remaining, running.rids.tolist()),
                pools.page_size,
                self.config.new_token_ratio,
                self.config.headroom_pages,
            ),
            1 << 62,  # the chunk budget, not the prefill cap, limits a mixed step
            pools.page_size,
            self.config.new_token_ratio,
            self.config.headroom_pages,
            anything_running=bool(len(running)) or bool(num_held),
        )
        remaining = (self._remaining(req.rid) for req in self.waiting)
        return choose(self._local(), remaining, budget)

    def _used(self) -> int:
        pools = self.pools
        # Cached but evictable pages count as free.
        return pools.num_pages * pools.page_size - pools.num_available_tokens

    def _retract(self, running: Filtered[Sampling]) -> None:
        # The newest row goes back to the front of the queue, to re-prefill its
        # prompt and what it generated so far; the oldest rows keep going.
        last = len(running.rows) - 1

        self.running = self._timed(partial(self._kept, running, list(range(last))))
        victim = self.live[running.rows.reqs[last].rid]
        self.unread_rids.discard(victim.spec.rid)  # its unread token is computed again
        self.waiting.appendleft(Req(victim.spec.rid, victim.spec.prompt + tuple(victim.generated)))
        self.trace.num_retractions += 1

    def _retire(self, batch: Extended[Sampling] | Decoding[Sampling], keep: list[int]) -> None:
        kept = self._kept(batch, keep)
        self.running = merge(self.running, kept) if isinstance(batch, Extended) else kept

    def _release(self, left: Departed, running: Filtered[Sampling]) -> Pools:
        tokens = None
        if self.pools.cache.enabled:
            # The KV holds each row's prompt and all it generated but the last token.
            tokens = [self.prompts[req.rid] + self._generated(req.rid) for req in left.reqs]
        result = release(left, running, self.pools, tokens)
        pools = result.value_or(None)
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


def _mix(  # noqa: PLR0917  # mix's own arguments, in its order
    running: _Running,
    admit: Sequence[Req | Chunked[Sampling]],
    budget: int,
    pools: Pools,
    tokens: Sequence[int] | Sampled,
    columns: Sampling,
) -> Result[MixStep[Sampling], MixError]:
    # `mix` for a batch carrying Sampling columns: one signature, for `partial`.
    return mix(running, admit, budget, pools, tokens, columns)
