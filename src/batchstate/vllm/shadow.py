"""`Shadow`: every block allocation and free of vLLM's scheduler replayed, and compared.

Attached to a live v1 `Scheduler` (or `AsyncScheduler`), it wraps, on that one
instance and from outside (vLLM's source is not edited; `detach` restores
them), the scheduler's `schedule`, `update_from_output` and `finish_requests`,
its `KVCacheManager`'s `allocate_slots` and `free`, and its block pool's eviction
of a cached block. Each wrapper calls
vLLM's method with the same arguments and returns its result unchanged. The
manager's calls are recorded as events; after each scheduler call the events
are replayed on a `Replica` and what vLLM holds (each request's computed
tokens, blocks and prefix hit; the free blocks) is compared with batchstate's.
`check_input_batch` compares a model runner's `InputBatch` the same way after it
applied a schedule. The first difference raises `ShadowDivergence` (or is logged)
and writes the trace of every step so far.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from batchstate.errors import Error
from batchstate.vllm.replica import Allocation, Event, Evict, Free, Row, State
from batchstate.vllm.trace import (
    INPUT_BATCH_OPS,
    Mismatch,
    PoolsConfig,
    Step,
    check,
    dumps,
    make_replica,
)

_log = logging.getLogger("batchstate.vllm")
SCHEDULER_CALLS = ("schedule", "update_from_output", "finish_requests")
"""The scheduler methods after which a `Shadow` compares."""


class ShadowDivergence(Error, AssertionError):
    """vLLM and batchstate hold different things after a step: `mismatch` names the
    step, the call, the request, the field and both values; `trace` where it was written."""

    def __init__(self, mismatch: Mismatch, trace: Path | None) -> None:
        self.mismatch = mismatch
        self.trace = trace
        where = f"; trace of every step so far: {trace}" if trace is not None else ""
        super().__init__(f"{mismatch}{where}")


class ShadowError(Error, ValueError):
    """The scheduler is not one a `Shadow` can follow: names what it lacks."""


class Shadow:
    """batchstate beside a live vLLM v1 scheduler (`with Shadow(scheduler): ...`).

    `on_divergence="raise"` raises `ShadowDivergence` at the first difference;
    `"log"` logs each (logger `batchstate.vllm`) and goes on. `trace_path`, when set,
    receives the trace (JSON lines, `batchstate replay` reads it) at the first
    divergence and on `detach`. `steps` counts the scheduler calls compared.
    """

    def __init__(
        self,
        scheduler: Any,
        *,
        on_divergence: Literal["raise", "log"] = "raise",
        trace_path: str | Path | None = None,
    ) -> None:
        manager = getattr(scheduler, "kv_cache_manager", None)
        groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None)
        if manager is None or groups is None:
            raise ShadowError(
                f"Shadow follows a vLLM v1 Scheduler; got {type(scheduler).__name__}, which has"
                " no kv_cache_manager and kv_cache_config"
            )
        if len(groups) != 1 or not manager.enable_caching:
            raise ShadowError(
                "Shadow follows one full-attention KV cache group with prefix caching on;"
                f" this scheduler has {len(groups)} group(s), caching"
                f" {'on' if manager.enable_caching else 'off'}"
            )
        self.scheduler = scheduler
        self.on_divergence = on_divergence
        self.trace_path = None if trace_path is None else Path(trace_path)
        self._blocks = manager.coordinator.single_type_managers[0]
        self._pool = manager.block_pool
        self.block_size = int(self._blocks.block_size)
        self.config = PoolsConfig(
            num_blocks=int(self._pool.num_gpu_blocks),
            block_size=self.block_size,
            max_reqs=int(scheduler.max_num_running_reqs),
            context=int(scheduler.vllm_config.model_config.max_model_len),
        )
        self.replica = make_replica(self.config)
        self.steps: list[Step] = []
        self.divergences: list[ShadowDivergence] = []
        self._events: list[Event] = []
        # Each cached block's tokens, as (the request's token list, where the block ends):
        # what an eviction of it takes from batchstate's cache.
        self._cached: dict[int, tuple[Any, int]] = {}
        self._registered: dict[str, int] = {}  # blocks of each request looked at
        self._hits: dict[str, int] = {}
        self._scheduled: frozenset[str] = frozenset()  # allocated for by the last schedule
        self._restore: list[Callable[[], None]] = []

    def attach(self) -> Shadow:
        """Wrap the scheduler's and its KV cache manager's calls (idempotent)."""
        if self._restore:
            return self
        manager = self.scheduler.kv_cache_manager
        self._replace(manager, "allocate_slots", self._wrap_allocate(manager.allocate_slots))
        self._replace(manager, "free", self._wrap_free(manager.free))
        evict = self._pool._maybe_evict_cached_block  # the one eviction door
        self._replace(self._pool, "_maybe_evict_cached_block", self._wrap_evict(evict))
        for name in SCHEDULER_CALLS:
            self._replace(self.scheduler, name, self._wrap_step(name))
        return self

    def detach(self) -> None:
        """Restore vLLM's methods and write the trace (when `trace_path` is set)."""
        while self._restore:
            self._restore.pop()()
        if self.trace_path is not None:
            self.write_trace(self.trace_path)

    def __enter__(self) -> Shadow:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def write_trace(self, path: Path) -> None:
        """Write the pools line and every step so far, one JSON object per line."""
        path.write_text("".join([dumps(self.config)] + [dumps(step) for step in self.steps]))

    def _replace(self, owner: Any, name: str, value: object) -> None:
        # Set on the instance: the class, and every other scheduler, stay vLLM's.
        own = vars(owner)
        if name in own:  # already set on the instance (another wrapper): put it back
            kept = own[name]
            self._restore.append(lambda: setattr(owner, name, kept))
        else:
            self._restore.append(lambda: delattr(owner, name))
        setattr(owner, name, value)

    def _wrap_allocate(self, original: Callable[..., Any]) -> Callable[..., Any]:
        shadow = self

        def allocate_slots(
            request: Any,
            num_new_tokens: int,
            num_new_computed_tokens: int = 0,
            *args: object,
            **kwargs: object,
        ) -> Any:
            # A request with nothing computed holds no block: new, or back from preemption.
            fresh = request.num_computed_tokens == 0
            tokens = tuple(request.all_token_ids) if fresh else ()
            result = original(request, num_new_tokens, num_new_computed_tokens, *args, **kwargs)
            if result is not None:
                rid = request.request_id
                if fresh:
                    shadow._hits[rid] = num_new_computed_tokens
                event = Allocation(rid, tokens, num_new_tokens, num_new_computed_tokens)
                shadow._events.append(event)
                shadow._register(request)
            return result

        return allocate_slots

    def _wrap_free(self, original: Callable[..., Any]) -> Callable[..., Any]:
        shadow = self

        def free(request: Any) -> Any:
            rid = request.request_id
            if shadow._blocks.req_to_blocks.get(rid):
                cached = shadow._blocks.num_cached_block.get(rid, 0) * shadow.block_size
                shadow._events.append(Free(rid, tuple(request.all_token_ids[:cached])))
                shadow._hits.pop(rid, None)
            shadow._registered.pop(rid, None)
            return original(request)

        return free

    def _register(self, request: Any) -> None:
        # Blocks vLLM hashed (cached) since the request was last looked at.
        blocks = self._blocks.req_to_blocks[request.request_id]
        start = self._registered.get(request.request_id, 0)
        done = start
        for index in range(start, len(blocks)):
            if blocks[index].block_hash is None:
                break
            self._cached[blocks[index].block_id] = (
                request.all_token_ids,
                (index + 1) * self.block_size,
            )
            done = index + 1
        self._registered[request.request_id] = done

    def _wrap_evict(self, original: Callable[..., bool]) -> Callable[..., bool]:
        shadow = self

        def evicted(block: Any) -> bool:
            key = block.block_hash
            gone = original(block)
            held = shadow._cached.pop(block.block_id, None)
            # vLLM caches a block whose hash another block already holds (a request that
            # recomputes a prefix it could only partly hit: its hit stops a token short of
            # its prompt), and evicting one copy leaves the prefix cached in the other;
            # batchstate keeps one page a prefix, so only the last copy's eviction is one.
            copies = shadow._pool.cached_block_hash_to_block
            kept = key is not None and copies.get_one_block(key) is not None
            if gone and held is not None and not kept:
                tokens, end = held
                shadow._events.append(Evict(tuple(tokens[:end])))
            return gone

        return evicted

    def _wrap_step(self, name: str) -> Callable[..., Any]:
        shadow = self
        original = getattr(self.scheduler, name)

        def stepped(*args: object, **kwargs: object) -> Any:
            result = original(*args, **kwargs)
            shadow._check(name)
            return result

        stepped.__name__ = name
        stepped.__doc__ = original.__doc__
        return stepped

    def vllm_state(self) -> State:
        """What vLLM's scheduler holds now: each request with blocks or computed tokens
        (one with computed tokens and no block is a bookkeeping error batchstate cannot
        hold), and the free blocks."""
        held = self._blocks.req_to_blocks
        rows = []
        for rid, request in self.scheduler.requests.items():
            blocks = held.get(rid)
            computed = int(request.num_computed_tokens)
            if blocks or computed:
                ids = tuple(block.block_id for block in blocks or ())
                rows.append(Row(rid, computed, ids, self._hits.get(rid, 0)))
        rows.sort(key=lambda row: row.rid)
        return State(tuple(rows), int(self._pool.get_num_free_blocks()))

    def check_input_batch(self, input_batch: Any, output: Any) -> None:
        """Compare a model runner's `InputBatch` after it applied `output` (the last
        `schedule()`'s): its rows must be the requests scheduled, and each row's computed
        tokens (its `num_computed_tokens_cpu` plus those scheduled) and block table row
        must be batchstate's, first as the block table's CPU tensor holds them, then as
        its device copy does (read once, all rows: on a GPU, one device-to-host copy)."""
        scheduled = output.num_scheduled_tokens
        count = int(input_batch.num_reqs)
        rids = list(input_batch.req_ids[:count])
        table = input_batch.block_table.block_tables[0]
        widths = table.num_blocks_per_row[:count].tolist()
        computed = input_batch.num_computed_tokens_cpu[:count].tolist()
        free = int(self._pool.get_num_free_blocks())
        for op, side in zip(
            INPUT_BATCH_OPS, (table.block_table.cpu, table.block_table.gpu), strict=True
        ):
            held = side[:count].cpu().tolist()
            rows = tuple(
                Row(
                    rid,
                    int(computed[i]) + int(scheduled.get(rid, 0)),
                    tuple(held[i][: widths[i]]),
                    self._hits.get(rid, 0),
                )
                for i, rid in enumerate(rids)
            )
            self._check_step(Step(len(self.steps), op, (), State(rows, free)))

    def _check(self, name: str) -> None:
        step = Step(len(self.steps), name, tuple(self._events), self.vllm_state())
        self._events.clear()
        self._check_step(step)

    def _check_step(self, step: Step) -> None:
        self.steps.append(step)
        mismatch, self._scheduled = check(self.replica, step, self._scheduled)
        if mismatch is None:
            return
        if self.trace_path is not None and not self.divergences:
            self.write_trace(self.trace_path)
        divergence = ShadowDivergence(mismatch, self.trace_path)
        self.divergences.append(divergence)
        if self.on_divergence == "raise":
            raise divergence
        _log.error("%s", divergence)
