"""`Watch`: audit a live SGLang scheduler after every batch lifecycle call, naming the
first call that breaks an invariant, with a compact trace of every call so far.

It wraps `ScheduleBatch`'s lifecycle methods on the class and the cache calls
`release_kv_cache` and `checkpoint_kv_cache` in every SGLang module that holds them,
from outside (SGLang's source is not edited), and restores them on `detach`. The
wrappers only read: they call the original with the same arguments and return its
result unchanged. After each call it updates the `Holdings` of the requests the call
touched and checks the pools' balances there, so a pool-level finding names the call
that made it and those requests.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from batchstate.errors import Error
from batchstate.sglang._detach import Unsupported, detach_on_unsupported
from batchstate.sglang._stubs import install_stubs
from batchstate.sglang.audit import AuditReport, Violation, audit, verify_window
from batchstate.sglang.holdings import Holdings
from batchstate.sglang.hybrid import components, mamba_counts, mamba_slot

LIFECYCLE = (
    "prepare_for_extend",
    "prepare_for_decode",
    "filter_batch",
    "merge_batch",
    "retract_decode",
    "mix_with_running",
    "prepare_for_idle",
)
"""The `ScheduleBatch` methods a `Watch` checks after (a call made inside another, such
as `mix_with_running`'s own `merge_batch`, is checked after the outer one)."""
CACHE_CALLS = ("release_kv_cache", "checkpoint_kv_cache")
"""The functions of `sglang.srt.mem_cache.common` a `Watch` checks after: they change what
a request holds outside any batch call (its row, its KV, its lock)."""
_BALANCES = frozenset({"lock leaked", "conservation"})  # audit's checks the holdings make
_TOUCHING = ("prepare_for_extend", "prepare_for_decode")  # batch calls that change holdings

_log = logging.getLogger("batchstate.sglang")


class Divergence(Error, AssertionError):
    """SGLang's state broke an invariant: names the call, the request, the field and
    both values (`violation`), and where the trace was written."""

    def __init__(self, step: int, operation: str, violation: Violation, trace: Path | None) -> None:
        self.step = step
        self.operation = operation
        self.violation = violation
        self.trace = trace
        where = f"; trace of every call so far: {trace}" if trace is not None else ""
        super().__init__(f"step {step}, after ScheduleBatch.{operation}: {violation}{where}")


@attrs.frozen
class TraceStep:
    """One lifecycle call and the state it left: rows, lengths, pool counts."""

    step: int
    operation: str
    rids: tuple[str, ...]
    rows: tuple[int, ...]
    seq_lens: tuple[int, ...]
    available: int
    evictable: int
    protected: int
    violations: tuple[str, ...]


class Watch:
    """Checks every SGLang batch lifecycle call and cache call while attached
    (`with Watch(): ...`); `holdings` is what each live request holds.

    `on_divergence="raise"` raises `Divergence` at the first broken invariant;
    `"log"` logs it (logger `batchstate.sglang`) and goes on. `trace_path`, when set,
    receives the trace (JSON lines) at the first divergence and on `detach`.
    `on_unsupported="raise"` raises what it cannot read (`UnsupportedSGLang`, or any
    other error of its own that is not a divergence); `"detach"` logs it once and
    detaches, leaving SGLang to run on (the launcher's choice). A watch follows one
    scheduler: the one whose radix cache is `tree_cache` or, when that is None, the
    first whose call it sees; other schedulers' calls in the process (data-parallel
    ranks) are not its own.
    """

    def __init__(
        self,
        *,
        on_divergence: Literal["raise", "log"] = "raise",
        trace_path: str | Path | None = None,
        on_unsupported: Unsupported = "raise",
        tree_cache: object = None,
    ) -> None:
        self.on_divergence = on_divergence
        self.on_unsupported = on_unsupported
        self.trace_path = None if trace_path is None else Path(trace_path)
        self.trace: list[TraceStep] = []
        self.divergences: list[Divergence] = []
        self.holdings = Holdings()
        self._originals: dict[str, Callable[..., object]] = {}
        self._cache_calls: dict[str, tuple[Callable[..., object], Callable[..., object]]] = {}
        self._inside = threading.local()  # .call: a wrapped batch call runs in this thread
        self._tree: Any = tree_cache  # the scheduler followed (its radix cache)

    def attach(self) -> Watch:
        """Wrap the lifecycle methods of SGLang's `ScheduleBatch` class and the cache calls
        (`CACHE_CALLS`) in every loaded SGLang module that holds them (idempotent)."""
        install_stubs()
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache import common

        if self._originals:
            return self
        for name in LIFECYCLE:
            original = getattr(ScheduleBatch, name)
            self._originals[name] = original
            setattr(ScheduleBatch, name, self._wrap(name, original))
        for name in CACHE_CALLS:
            original = getattr(common, name)
            # SGLang's modules import these by name: replace every copy loaded so far;
            # a module loaded later imports the wrapper from `common`.
            _swap(name, original, self._wrap_cache_call(name, original))
        return self

    def detach(self) -> None:
        """Restore SGLang's methods and write the trace (when `trace_path` is set)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        for name, original in self._originals.items():
            setattr(ScheduleBatch, name, original)
        self._originals.clear()
        # Modules loaded while attached hold the wrapper too: every copy goes back.
        for name, (original, wrapped) in self._cache_calls.items():
            _swap(name, wrapped, original)
        self._cache_calls.clear()
        if self.trace_path is not None:
            self.write_trace(self.trace_path)

    def __enter__(self) -> Watch:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def write_trace(self, path: Path) -> None:
        """Write every call so far, one JSON object per line."""
        path.write_text("".join(json.dumps(attrs.asdict(s)) + "\n" for s in self.trace))

    def _wrap(self, name: str, original: Callable[..., object]) -> Callable[..., object]:
        watch = self

        def checked(batch: Any, *args: object, **kwargs: object) -> object:
            if getattr(watch._inside, "call", False):  # part of an outer call, checked after it
                return original(batch, *args, **kwargs)
            watch._inside.call = True
            try:
                result = original(batch, *args, **kwargs)
            finally:
                watch._inside.call = False
            with detach_on_unsupported(watch, watch.on_unsupported, (Divergence,)):
                watch._after(name, batch)
            return result

        checked.__name__ = name
        checked.__doc__ = original.__doc__
        return checked

    def _wrap_cache_call(self, name: str, original: Callable[..., object]) -> Callable[..., object]:
        watch = self

        def checked(req: Any, tree_cache: Any, *args: object, **kwargs: object) -> object:
            if not watch._originals or not watch._follows(tree_cache):
                # A copy someone kept past detach, or another scheduler's cache: SGLang alone.
                return original(req, tree_cache, *args, **kwargs)
            row = req.kv.req_pool_idx
            free_before = len(tree_cache.req_to_token_pool.free_slots)
            # Mamba: the slot the request holds, and the slots free or in the tree.
            mamba = "MAMBA" in components(tree_cache)
            slot = mamba_slot(req) if mamba else None
            mamba_before = sum(mamba_counts(tree_cache)[:3]) if mamba else None
            result = original(req, tree_cache, *args, **kwargs)
            with detach_on_unsupported(watch, watch.on_unsupported, (Divergence,)):
                watch._after_cache_call(
                    name, req, tree_cache, row, free_before, mamba_before=mamba_before, slot=slot
                )
            return result

        checked.__name__ = name
        checked.__doc__ = original.__doc__
        self._cache_calls[name] = (original, checked)
        return checked

    def _after_cache_call(
        self,
        operation: str,
        req: Any,
        tree: Any,
        row: int | None,
        free_before: int,
        *,
        mamba_before: int | None = None,
        slot: int | None = None,
    ) -> None:
        page = int(tree.token_to_kv_pool_allocator.page_size)
        found = self.holdings.update([req], page, tree)
        if operation == "release_kv_cache" and row is not None:
            found += self.holdings.returned(
                tree.req_to_token_pool, free_before, {int(row): req.rid}
            )
        if mamba_before is not None:
            found += self.holdings.mamba_returned(tree, mamba_before, slot, req.rid)
        found += self.holdings.balance(tree, [req.rid])
        rows = () if row is None else (int(row),)
        self._record(
            operation,
            TraceStep(
                len(self.trace),
                operation,
                (req.rid,),
                rows,
                (),
                *_counts(tree),
                tuple(map(str, found)),
            ),
            found,
        )

    def _after(self, operation: str, batch: Any) -> None:
        if getattr(batch, "req_to_token_pool", None) is None:  # the scheduler's empty placeholder
            return
        if not self._follows(batch.tree_cache):
            return  # another scheduler's batch (a data-parallel rank's): other pools
        found: list[Violation] = []
        touched: Sequence[Any] = batch.reqs if operation in _TOUCHING else ()
        if not self.trace:  # attached while requests were live: learn what this batch holds
            chunked = getattr(batch, "chunked_req", None)
            touched = [*batch.reqs, *([] if chunked is None else [chunked])]
        page = int(batch.token_to_kv_pool_allocator.page_size)
        found += self.holdings.update(touched, page, batch.tree_cache)
        # Every request holding a row until its release, in a batch or not (a chunked
        # request between chunks; under overlap, a finishing one its batch dropped first).
        report = audit(batch, also_live=self.holdings.live())
        # The pool-wide balances are the holdings': at the call that broke them, naming the
        # requests it touched, each difference once.
        found += [v for v in report.violations if v.check not in _BALANCES]
        if operation == "prepare_for_decode":  # until the verify: its window is reserved
            found += verify_window(batch).violations
        found += self.holdings.balance(batch.tree_cache, [r.rid for r in touched])
        step = _snapshot(len(self.trace), operation, batch, AuditReport(tuple(found)))
        self._record(operation, step, found)

    def _follows(self, tree: object) -> bool:
        # The first scheduler seen is the one followed, unless one was given.
        if self._tree is None:
            self._tree = tree
        return tree is self._tree

    def _record(self, operation: str, step: TraceStep, found: Sequence[Violation]) -> None:
        self.trace.append(step)
        if not found:
            return
        first = found[0]
        if self.trace_path is not None and not self.divergences:
            self.write_trace(self.trace_path)
        divergence = Divergence(step.step, operation, first, self.trace_path)
        self.divergences.append(divergence)
        if self.on_divergence == "raise":
            raise divergence
        _log.error("%s", divergence)


def _swap(name: str, old: object, new: object) -> None:
    """Point every loaded SGLang module's `name` that is `old` at `new`."""
    for module in list(sys.modules.values()):
        if module.__name__.startswith("sglang") and getattr(module, name, None) is old:
            setattr(module, name, new)


def _counts(tree: Any) -> tuple[int, int, int]:
    """Free, evictable and protected tokens."""
    return (
        int(tree.token_to_kv_pool_allocator.available_size()),
        int(tree.evictable_size()),
        int(tree.protected_size()),
    )


def _snapshot(step: int, operation: str, batch: Any, report: AuditReport) -> TraceStep:
    def host(values: Any) -> tuple[int, ...]:
        return () if values is None else tuple(int(v) for v in values.tolist())

    allocator, tree = batch.token_to_kv_pool_allocator, batch.tree_cache
    return TraceStep(
        step=step,
        operation=operation,
        rids=tuple(r.rid for r in batch.reqs),
        rows=host(batch.req_pool_indices_cpu) if batch.reqs else (),
        seq_lens=host(batch.seq_lens_cpu) if batch.reqs else (),
        available=int(allocator.available_size()),
        evictable=int(tree.evictable_size()),
        protected=int(tree.protected_size()),
        violations=tuple(map(str, report.violations)),
    )
