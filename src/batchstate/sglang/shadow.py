"""`Shadow`: every SGLang lifecycle call replayed as batchstate transitions, and compared.

Attached before SGLang's scheduler serves its first request, it wraps
`ScheduleBatch.prepare_for_extend`, `prepare_for_decode`, `filter_batch`,
`merge_batch`, `retract_decode` (on the class) and `release_kv_cache` (in every
SGLang module that imported it), from outside: SGLang's source is not edited and
`detach` restores them. Each wrapper calls SGLang's function with the same
arguments and returns its result unchanged, then records what SGLang holds
(`sglang_state`, host mirrors and pool counters only), replays the call on a
`Replica` and compares the two. The first difference raises `ShadowDivergence`
(or is logged) and writes the trace of every call so far.

With `full_check_every=N` every call is still replayed and its counts compared
(rows, their total, the mirror's order, free request rows, pool counts), but the
rows request by request only at every Nth batch call (and at every extend); a
difference is then named at the first check that sees it, with the range of calls
since the last full check that passed.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import attrs

from batchstate.errors import Error
from batchstate.sglang._detach import Unsupported, call_detaching, detach_on_unsupported
from batchstate.sglang._fields import require_shadowed
from batchstate.sglang._sglang_reads import (
    evicted_by_sglang,
    mirror_order,
    mirror_rows,
    pool_state,
    sglang_state,
)
from batchstate.sglang._stubs import install_stubs
from batchstate.sglang.replica import ExtendItem, Replica
from batchstate.sglang.trace import (
    Checked,
    Mismatch,
    Operation,
    PoolsConfig,
    apply,
    check,
    dumps,
)

_log = logging.getLogger("batchstate.sglang")
BATCH_CALLS = (
    "prepare_for_extend",
    "prepare_for_decode",
    "filter_batch",
    "merge_batch",
    "retract_decode",
    "mix_with_running",
    "prepare_for_idle",
)
"""The `ScheduleBatch` methods a `Shadow` replays (a call made inside another, such as
`mix_with_running`'s own `merge_batch`, is replayed as part of the outer one)."""


class ShadowDivergence(Error, AssertionError):
    """SGLang and batchstate hold different things after a call: `mismatch` names the
    step, the call, the request, the field and both values; `trace` where it was written."""

    def __init__(self, mismatch: Mismatch, trace: Path | None) -> None:
        self.mismatch = mismatch
        self.trace = trace
        where = f"; trace of every call so far: {trace}" if trace is not None else ""
        super().__init__(f"{mismatch}{where}")


class Shadow:
    """batchstate beside a live SGLang scheduler (`with Shadow(): ...`).

    `on_divergence="raise"` raises `ShadowDivergence` at the first difference;
    `"log"` logs each (logger `batchstate.sglang`) and goes on. `trace_path`, when
    set, receives the trace (JSON lines, `batchstate replay` reads it) at the first
    divergence and on `detach`.

    `full_check_every=N` (default 1: every call) compares the rows request by request
    (rids, tokens in the KV cache) after every Nth `ScheduleBatch` call and after every
    `prepare_for_extend`; every other call is still replayed, and its row count,
    `seq_lens_sum`, the mirror's order, held chunks, free request rows and pool counts
    compared. A difference only a full
    check sees is named at the next one, `mismatch.since` to `mismatch.step` being the
    calls it arose in.

    `on_unsupported="raise"` raises what it cannot read (`UnsupportedSGLang`, or any
    other error of its own that is not a divergence); `"detach"` logs it once and
    detaches, leaving SGLang to run on (the launcher's choice).

    A shadow follows one scheduler: the one whose radix cache is `tree_cache` or, when
    that is None, the first whose batch it sees; the calls of other schedulers in the
    process (data-parallel ranks) are not its own.
    """

    def __init__(
        self,
        *,
        on_divergence: Literal["raise", "log"] = "raise",
        trace_path: str | Path | None = None,
        full_check_every: int = 1,
        on_unsupported: Unsupported = "raise",
        tree_cache: object = None,
    ) -> None:
        if full_check_every < 1:
            raise ValueError(f"full_check_every must be at least 1, not {full_check_every}")
        self.on_divergence = on_divergence
        self.full_check_every = full_check_every
        self.on_unsupported = on_unsupported
        self.trace_path = None if trace_path is None else Path(trace_path)
        self.config: PoolsConfig | None = None
        self.replica: Replica | None = None
        self.operations: list[Operation] = []
        self.divergences: list[ShadowDivergence] = []
        self._labels: dict[int, tuple[weakref.ref[Any], str]] = {}
        self._restore: list[Callable[[], None]] = []
        self._batches = 0
        self._tree: Any = tree_cache
        self._evicted = False  # SGLang's tree evicted since the last call was replayed
        self._batch_calls = 0  # ScheduleBatch calls replayed: every Nth is compared in full
        self.checked = Checked()  # where the two sides were last seen equal
        self._inside = threading.local()  # .call: a wrapped call runs in this thread

    def attach(self) -> Shadow:
        """Wrap SGLang's lifecycle calls (idempotent)."""
        install_stubs()
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache import common

        if self._restore:
            return self
        if self._tree is not None:  # attached again after a detach: follow its tree's evictions
            kind = type(self._tree)
            self._replace(kind, "evict", self._wrap_evict(kind.evict))
        # The scheduler's modules import the cache calls by name: load them first, so
        # that their names are the ones replaced.
        importlib.import_module("sglang.srt.managers.scheduler")
        for name in BATCH_CALLS:
            self._replace(ScheduleBatch, name, self._wrap_batch(name, getattr(ScheduleBatch, name)))
        for name, wrapped in (
            ("release_kv_cache", self._wrap_release(common.release_kv_cache)),
            ("checkpoint_kv_cache", self._wrap_checkpoint(common.checkpoint_kv_cache)),
        ):
            original = getattr(common, name)
            for module in list(sys.modules.values()):
                named = module.__name__.startswith("sglang")
                if named and getattr(module, name, None) is original:
                    self._replace(module, name, wrapped)
        return self

    def _wrap_checkpoint(self, original: Callable[..., object]) -> Callable[..., object]:
        shadow = self

        def replayed(req: Any, tree_cache: Any, *args: object, **kwargs: object) -> object:
            result = original(req, tree_cache, *args, **kwargs)
            if shadow.replica is not None and tree_cache is shadow._tree:
                shadow._checkpointed(req, tree_cache)
            return result

        replayed.__name__ = original.__name__
        replayed.__doc__ = original.__doc__
        return replayed

    def _checkpointed(self, req: Any, tree_cache: Any) -> None:
        with detach_on_unsupported(self, self.on_unsupported, (ShadowDivergence,)):
            assert self.replica is not None
            state = pool_state(tree_cache, (), (), (), ())
            op = Operation(len(self.operations), "checkpoint_kv_cache", "", state, rid=req.rid)
            self._check(self.replica, op)

    def _replace(self, owner: object, name: str, value: object) -> None:
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._restore.append(lambda: setattr(owner, name, original))

    def detach(self) -> None:
        """Restore SGLang's functions and write the trace (when `trace_path` is set)."""
        while self._restore:
            self._restore.pop()()
        if self.trace_path is not None:
            self.write_trace(self.trace_path)

    def __enter__(self) -> Shadow:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def write_trace(self, path: Path) -> None:
        """Write the pools line and every operation so far, one JSON object per line."""
        head = [] if self.config is None else [dumps(self.config)]
        path.write_text("".join(head + [dumps(op) for op in self.operations]))

    def _label(self, batch: object) -> str:
        known = self._labels.get(id(batch))
        if known is not None and known[0]() is batch:
            return known[1]
        label = f"b{self._batches}"  # ids of dead batches come back: count instead
        self._batches += 1
        self._labels[id(batch)] = (weakref.ref(batch), label)
        return label

    def _replica(self, batch: Any) -> Replica:
        if self.replica is None:
            self._tree = batch.tree_cache if self._tree is None else self._tree
            kind = type(self._tree)
            self._replace(kind, "evict", self._wrap_evict(kind.evict))
            table = batch.req_to_token_pool.req_to_token
            self.config = PoolsConfig(
                page_size=int(batch.token_to_kv_pool_allocator.page_size),
                kv_tokens=int(batch.token_to_kv_pool_allocator.size),
                rows=int(batch.req_to_token_pool.size),
                context=int(table.shape[1]),
            )
            config = self.config
            self.replica = Replica(
                page_size=config.page_size,
                kv_tokens=config.kv_tokens,
                rows=config.rows,
                context=config.context,
            )
        return self.replica

    def _wrap_batch(self, name: str, original: Callable[..., object]) -> Callable[..., object]:
        shadow = self

        joins = name in ("merge_batch", "mix_with_running")  # decided once, not per call
        inside = shadow._inside

        def replayed(batch: Any, *args: object, **kwargs: object) -> object:
            if getattr(inside, "call", False):  # part of an outer call, replayed whole
                return original(batch, *args, **kwargs)
            inside.call = True
            try:
                result = original(batch, *args, **kwargs)
            finally:
                inside.call = False
            other = None
            if joins:
                other = args[0] if args else kwargs.get("other", kwargs.get("running_batch"))
            call_detaching(
                shadow,
                shadow.on_unsupported,
                (ShadowDivergence,),
                shadow._after,
                name,
                batch,
                other,
            )
            return result

        replayed.__name__ = name
        replayed.__doc__ = original.__doc__
        return replayed

    def _wrap_evict(self, original: Callable[..., object]) -> Callable[..., object]:
        shadow = self

        def noted(tree: object, *args: object, **kwargs: object) -> object:
            shadow._evicted = shadow._evicted or tree is shadow._tree
            return original(tree, *args, **kwargs)

        noted.__name__ = "evict"
        return noted

    def _wrap_release(self, original: Callable[..., object]) -> Callable[..., object]:
        shadow = self

        def replayed(req: Any, tree_cache: Any, *args: object, **kwargs: object) -> object:
            checkpoint = bool(kwargs.get("checkpoint", args[0] if args else False))
            tokens = [*req.origin_input_ids, *req.output_ids]
            kept = req.kv.cache_protected_len
            if checkpoint and not req.skip_radix_cache_insert:
                kept = req.owned_kv_len()
            held = req.kv.req_pool_idx is not None
            result = original(req, tree_cache, *args, **kwargs)
            if held and shadow.replica is not None and tree_cache is shadow._tree:
                with detach_on_unsupported(shadow, shadow.on_unsupported, (ShadowDivergence,)):
                    shadow._after_release(req, tree_cache, tuple(tokens[:kept]))
            return result

        replayed.__name__ = original.__name__
        replayed.__doc__ = original.__doc__
        return replayed

    def _after(self, name: str, batch: Any, other: Any) -> None:
        if getattr(batch, "req_to_token_pool", None) is None:  # an empty placeholder batch
            return
        if self._tree is not None and batch.tree_cache is not self._tree:
            return  # another scheduler's batch (a data-parallel rank's)
        extend = name == "prepare_for_extend"
        known = self._labels.get(id(batch))
        label = known[1] if known is not None and known[0]() is batch else None
        if extend or label is None:
            # A clear error where SGLang's fields moved: each batch at its first call, each
            # request at the extend that brings it in (no other call adds one to a batch).
            require_shadowed(batch, batch.reqs if extend else ())
        replica = self._replica(batch)
        reqs = batch.reqs
        # Each request's row read once: it picks the live requests and is what the mirror
        # is checked against.
        slots = [r.kv.req_pool_idx for r in reqs]
        if None in slots:
            live = [r for r, slot in zip(reqs, slots, strict=True) if slot is not None]
            slots = [slot for slot in slots if slot is not None]
        else:
            live = list(reqs)
        items: tuple[ExtendItem, ...] = ()
        if extend:
            items = tuple(
                ExtendItem(
                    r.rid,
                    tuple(r.full_untruncated_fill_ids),
                    int(r.extend_len),
                    int(r.prefix_len),
                )
                for r in live
            )
        # A request between chunks is held, not a row: in its extend and, in a mixed step,
        # in the batch its middle chunk ran in until the scheduler filters it out (a batch
        # keeps naming its last chunked request after that request's prompt is done).
        chunked = batch.chunked_req
        chunks = []
        if chunked is not None:  # at most one: found by identity, not per request
            at = next((i for i, r in enumerate(live) if r is chunked), None)
            if at is not None and (extend or chunked.inflight_middle_chunks > 0):
                chunks = [chunked]
                del live[at], slots[at]
        full = extend or self._batch_calls % self.full_check_every == 0
        self._batch_calls += 1
        kept = tuple([r.rid for r in live])
        if full:
            state = sglang_state(batch, live, extend, chunks, kept)
        else:  # counts only: the rows' rids are `kept`, their total `seq_lens_sum`
            state = pool_state(batch.tree_cache, (), (), (), ())
        op = Operation(
            step=len(self.operations),
            op=name,
            batch=self._label(batch) if label is None else label,
            state=state,
            other="" if other is None else self._label(other),
            items=items,
            kept=kept,
            mirror_rows=mirror_rows(batch, live),
            mirror_order=mirror_order(batch, live, slots),
            seq_lens_sum=batch.seq_lens_sum if reqs else None,
            full=full,
        )
        self._check(replica, op)

    def _after_release(self, req: Any, tree_cache: Any, tokens: tuple[int, ...]) -> None:
        assert self.replica is not None
        # A request released before SGLang ever checkpointed it (aborted between chunks,
        # or retracted before its prefill's result) leaves in SGLang's tree nothing of what
        # it computed, which batchstate published at its extend (policy, docs/sglang.md):
        # the next call first evicts from batchstate's cache what SGLang's tree lacks.
        never_published = req.rid in self.replica.unpublished
        state = pool_state(tree_cache, (), (), (), ())
        op = Operation(
            len(self.operations), "release_kv_cache", "", state, rid=req.rid, tokens=tokens
        )
        self._check(self.replica, op)
        self._evicted = self._evicted or never_published

    def _check(self, replica: Replica, op: Operation) -> None:
        try:
            # What SGLang's call evicted goes first: batchstate's own allocation then finds
            # the same free pages and evicts nothing by its own least-recently-used order.
            if self._evicted:
                op = attrs.evolve(op, evicted=evicted_by_sglang(replica, self._tree))
                self._evicted = False
            apply(replica, op)
        except Exception as error:  # batchstate refused what SGLang did: that is the divergence
            mismatch: Mismatch | None = Mismatch(
                op.step, op.op, "refused", "done", repr(error), op.rid
            )
        else:
            published = not replica.unpublished
            mismatch = check(op, replica, pools=published)
            if mismatch is None:
                self.checked.passed(op, pools=published)
        self.operations.append(op)
        if mismatch is None:
            return
        mismatch = attrs.evolve(mismatch, since=self.checked.since(op))
        if self.trace_path is not None and not self.divergences:
            self.write_trace(self.trace_path)
        divergence = ShadowDivergence(mismatch, self.trace_path)
        self.divergences.append(divergence)
        if self.on_divergence == "raise":
            raise divergence
        _log.error("%s", divergence)
