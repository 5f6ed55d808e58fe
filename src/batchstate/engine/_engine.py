"""The engine: a continuous-batching loop composed only of batchstate's public transitions.

Every step runs the same stages, in order (see docs/engine.md):

1. admit (`_admit`): prebuilt arrivals at the front of the queue, else held
   chunks and waiting requests, as the scheduler policy orders and counts
   them, through `admit_prefilled`, `extend` or `mix`;
2. plan (`_plan`): choose the forward (transfer, extend, mixed, decode,
   verify), retracting the policy's victims while decode runs out of KV;
3. run (`_run`): the token source builds the forward's inputs, pads them to
   a captured size, runs the model and samples;
4. record (`_record`): each row's tokens, read at once or, with overlap,
   one step late;
5. finish (`_finish`): finished rows are split off and released, the rest
   run on.

Capabilities (`EngineConfig`: the prefix cache in the pools, chunks, mixed
steps, overlap, speculation; padding in the token source; data-parallel
ranks around the engine) change what a stage does, never which stages run.
Each request samples with its own `SamplingParams`, carried by the running
batch as `Sampling` columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import final

import attrs

from batchstate import (
    InvariantViolation,
    Pools,
    Req,
    SlotHolder,
    check_batch,
    check_leaks,
    check_pools,
)
from batchstate.engine._admit import admit
from batchstate.engine._config import EngineConfig, EngineError
from batchstate.engine._finish import finish
from batchstate.engine._plan import plan
from batchstate.engine._policy import FirstComeFirstServed, SchedulerPolicy
from batchstate.engine._reads import ReadCounter
from batchstate.engine._record import record
from batchstate.engine._run import run_forward
from batchstate.engine._sources import TokenSource
from batchstate.engine._state import EngineState, Live
from batchstate.engine._workload import RequestSpec

__all__ = ["Engine", "EngineConfig", "EngineError"]


@final
class Engine(EngineState):
    """Runs a workload to the end. Holds the mutable loop state around immutable records.

    Args:
        specs: the workload, in arrival order.
        pools: empty pools for the run; with their prefix cache on, prefills
            read cached prefixes and publish their pages, and finished
            requests' KV stays cached.
        tokens: runs the forwards (a model) or draws tokens (meta).
        counter: counts device reads on audited steps; None counts none.
        policy: admission order and count, retraction victim, chunk budget.
    """

    def __init__(  # the engine's arguments, the policy last
        self,
        config: EngineConfig,
        specs: Sequence[RequestSpec],
        pools: Pools,
        tokens: TokenSource,
        counter: ReadCounter | None = None,
        *,
        policy: SchedulerPolicy | None = None,
    ) -> None:
        super().__init__(
            config, specs, pools, tokens, counter, policy=policy or FirstComeFirstServed()
        )

    def run(self, on_step: Callable[[int], None] | None = None) -> None:
        """Step until every request has finished; `on_step(num_finished)` after each step.

        Raises:
            EngineError: a transition failed in a way the policy rules out.
            InvariantViolation: a periodic or final check failed (prefixed with the step).
        """
        while self.busy:
            if self.pending and not (self.waiting or self.num_running or self.held):
                self.clock = max(self.clock, self.pending[0].arrival_step)  # skip idle steps
            self.arrive()
            self.step()
            if on_step is not None:
                on_step(len(self.outputs))
        self.check()

    @property
    def busy(self) -> bool:
        """Whether any request is still to come, waiting, held, running or unread."""
        return bool(self.pending or self.waiting or self.num_running or self.held or self.unread)

    @property
    def num_running(self) -> int:
        """Rows running: the running batch's, or an unread verify window's."""
        window = self.window
        return len(self.running.rows) if window is None else len(window.rids)

    @property
    def load(self) -> int:
        """Requests this engine holds: pending, waiting, held between chunks and running."""
        return len(self.pending) + len(self.waiting) + len(self.held) + self.num_running

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
            self.live[spec.rid] = Live(attrs.evolve(spec, prompt=prompt, follows=None), [])
            self.waiting.append(Req(spec.rid, prompt))

    def step(self) -> None:
        """Run one step over the queued and running requests, then advance the clock.

        The stages, in order: admit, plan the forward (retracting if decode
        runs out of KV), run it, record its tokens, finish and release.

        Raises:
            EngineError, InvariantViolation: as for `run`.
        """
        start = perf_counter()
        every = self.config.audit_every
        self.bookkeeping_s, self.audited = 0.0, bool(every) and len(self.trace) % every == 0
        admitted = admit(self)
        forward = plan(self, admitted)
        ran = run_forward(self, forward)
        recorded = record(self, ran)
        finish(self, ran, recorded, start)
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
            is_extend=False, batch_size=0, kv_tokens_used=self.used(),
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
        # An unread verify window holds the running rows (its lengths are the pools').
        window = self.window
        holders: list[SlotHolder] = [self.running if window is None else window.window, *self.held]
        try:
            check_batch(self.running)
            check_pools(self.pools, [self.running] if window is None else [])
            check_leaks(self.pools, holders)
        except InvariantViolation as error:
            raise InvariantViolation(f"after step {len(self.trace)}: {error}") from error
        self.trace.num_checks += 1
