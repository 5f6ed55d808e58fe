"""The engine's mutable bookkeeping, read and moved on by every stage of a step.

Records (`Filtered`, `Chunked`, `Pools`, ...) are immutable values; what
changes from step to step is which ones the engine holds: the queues, the
running batch, the pools, the chunks held between steps, each request's
tokens so far and, with overlap, the last forward's tokens still on the
device. `EngineState` holds them, with the few primitives every stage
shares (record a token, drop rows and release their memory, time a
transition).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from time import perf_counter
from typing import TypeAlias, TypeVar, final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate import (
    Chunked,
    Decoding,
    Departed,
    Extended,
    Filtered,
    Idle,
    Pools,
    Req,
    Sampled,
    Sampling,
    Verifying,
    gather_sampled,
    idle,
    join_sampled,
    release,
    split,
)
from batchstate.engine._config import EngineConfig, EngineError
from batchstate.engine._policy import SchedulerPolicy
from batchstate.engine._reads import ReadCounter
from batchstate.engine._sources import TokenSource
from batchstate.engine._trace import Trace
from batchstate.engine._verify import UnreadAcceptance
from batchstate.engine._workload import END_TOKEN, RequestSpec

__all__ = ["EngineState", "Live", "Running", "UnreadWindow"]

_T = TypeVar("_T")
# The running batch, carrying each row's sampling parameters.
Running: TypeAlias = Filtered[Sampling] | Idle[Sampling]


@final
@attrs.define
class Live:
    """A request that arrived and has not finished: its spec and the tokens it generated."""

    spec: RequestSpec
    generated: list[int]


@final
@attrs.frozen
class UnreadWindow:
    """Overlap: a verify window whose forward ran, its acceptance still on the device."""

    window: Verifying[Sampling]
    rids: list[int]  # the rows' requests, in row order
    committed: npt.NDArray[np.int64]  # each row's length before its drafts
    unread: UnreadAcceptance


class EngineState:
    """The queues, the running batch, the pools and each request's tokens, between steps."""

    def __init__(
        self,
        config: EngineConfig,
        specs: Sequence[RequestSpec],
        pools: Pools,
        tokens: TokenSource,
        counter: ReadCounter | None,
        *,
        policy: SchedulerPolicy,
    ) -> None:
        self.config, self.pools, self.tokens, self.counter = config, pools, tokens, counter
        self.policy = policy
        device = pools.table.device.device
        self.running: Running = idle(device, Sampling)
        self.pending = deque(sorted(specs, key=lambda spec: spec.arrival_step))
        self.prompts: dict[int, tuple[int, ...]] = {}  # rid -> its whole prompt, once it arrived
        self.sampling = {spec.rid: spec.sampling for spec in specs}  # rid -> its parameters
        self.waiting: deque[Req] = deque()
        self.live: dict[int, Live] = {}
        self.outputs: dict[int, tuple[int, ...]] = {}
        self.trace = Trace()
        self.clock = 0  # engine steps, the unit of arrival times
        self.bookkeeping_s = 0.0  # this step's time inside batchstate transitions
        self.audited = False  # this step's decode path runs under the read counter
        self.held: deque[Chunked[Sampling]] = deque()  # requests between chunks, oldest first
        # Overlap: the last forward's tokens, not yet read, and whose rows to record.
        self.unread: Sampled | None = None
        self.unread_rids: set[int] = set()
        # Overlap: every running row's last token on the device (it may hold finished rows').
        self.device_tokens: Sampled | None = None
        self.parked: Running | None = None  # running rows sitting out a prefill step
        # Overlap with speculation: the last verify window, read next step (the running
        # batch is then empty: the window holds the rows).
        self.window: UnreadWindow | None = None

    def timed(self, work: Callable[[], _T], *, audit: bool = True) -> _T:
        """Run a batchstate call, timed into this step's bookkeeping.

        On audited steps the decode-path calls also run under the read
        counter (and are not timed into the per-step average, see Trace).
        """
        start = perf_counter()
        if audit and self.audited and self.counter is not None:
            with self.counter() as reads:
                result = work()
            self.trace.device_reads += reads[0]
        else:
            result = work()
        self.bookkeeping_s += perf_counter() - start
        return result

    def record_tokens(self, pairs: Iterable[tuple[int, int]]) -> set[int]:
        """Append each `(rid, token)`; the requests that finished (end token or length)."""
        done = set()
        for rid, token in pairs:
            live = self.live[rid]
            live.generated.append(token)
            if token == END_TOKEN or len(live.generated) >= live.spec.max_new_tokens:
                done.add(rid)
                self.outputs[rid] = tuple(live.generated)
                del self.live[rid]
        return done

    def kept(
        self, batch: Extended[Sampling] | Decoding[Sampling] | Filtered[Sampling], keep: list[int]
    ) -> Filtered[Sampling]:
        """The rows at `keep`; the others leave, and their memory goes back to the pools."""
        kept, left = split(batch, keep)
        if len(keep) < len(batch.rows):
            self.pools = self._release(left, kept)
        return kept

    def _release(self, left: Departed, running: Filtered[Sampling]) -> Pools:
        tokens = None
        if self.pools.cache.enabled:
            # The KV holds each row's prompt and all it generated but the last token.
            tokens = [self.prompts[req.rid] + self.generated(req.rid) for req in left.reqs]
        result = release(left, running, self.pools, tokens)
        pools = result.value_or(None)
        if pools is None:
            raise EngineError(f"release failed: {result.failure()}")
        return pools

    def last_tokens(self, rids: Iterable[int]) -> list[int]:
        """Each request's last generated token, as the host knows it."""
        return [self.live[rid].generated[-1] for rid in rids]

    def uploaded(self, running: Filtered[Sampling]) -> Sampled:
        """The running rows' last tokens, known on the host, put on the device."""
        last = self.last_tokens(running.rows.rids.tolist())
        tokens = torch.tensor(last, dtype=torch.int64, device=running.rows.device)
        return Sampled.of(running.rows, tokens)

    def joined(self, running: Running, new: Sampled) -> Sampled:
        """Overlap: the device tokens of `running`'s rows, then `new`'s."""
        if not isinstance(running, Filtered) or self.device_tokens is None:
            return new
        return join_sampled(gather_sampled(self.device_tokens, running), new)

    def generated(self, rid: int) -> tuple[int, ...]:
        """What request `rid` generated so far (all of it, once finished)."""
        live = self.live.get(rid)
        return tuple(live.generated) if live is not None else self.outputs[rid]

    def remaining(self, rid: int) -> int:
        """Output tokens request `rid` may still generate."""
        live = self.live[rid]
        return live.spec.max_new_tokens - len(live.generated)

    def used(self) -> int:
        """KV tokens owned (whole pages); cached but evictable pages count as free."""
        pools = self.pools
        return pools.num_pages * pools.page_size - pools.num_available_tokens
