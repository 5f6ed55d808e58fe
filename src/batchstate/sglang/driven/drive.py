"""`Drive`: SGLang's own scheduler running on batchstate's batch state and memory.

`Drive(scheduler).attach()` takes one SGLang `Scheduler` instance before it serves a
request and, without editing SGLang's source:

- makes one `Pools` value (held by a `Replica`) the size of the scheduler's pools and
  hands the scheduler, its schedule policy and its result processor the three views
  of it (`memory`) in place of its `ReqToTokenPool`, KV allocator and `RadixCache`;
  SGLang's admission (`PrefillAdder`), retraction check, metrics, and its own
  `release_kv_cache` and `checkpoint_kv_cache` run unmodified over them;
- turns each batch `ScheduleBatch.init_new` makes over those views into a driven
  batch (`batch.RecordFields`): its mirrored fields are reads of its record;
- computes the batch lifecycle with batchstate's transitions in place of SGLang's
  methods, for driven batches only (class-level wrappers that call SGLang's own
  method for any other batch): `prepare_for_extend` is `mix` + `finish_mixed`,
  `prepare_for_decode` is `decode`, `filter_batch` is `split` + `filter_batch`,
  `merge_batch` is `merge`, and `copy` (the overlap scheduler's snapshot for result
  processing) shares the frozen record. `retract_decode` stays SGLang's: it releases
  through the views and filters through the driven `filter_batch`.

What a transition does not hold (SGLang's per-request counters, the sampling
info, the decode's relayed input ids) is still SGLang's, set beside it by the same
rules as SGLang's methods. `detach` restores SGLang's objects and methods.
See docs/sglang.md, "Drive mode".
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import torch

from batchstate import Pools
from batchstate.errors import Error
from batchstate.pools.eviction import evict_leaves, unlocked_leaves
from batchstate.sglang._stubs import install_stubs
from batchstate.sglang.driven.batch import FIELDS, Binding, RecordFields
from batchstate.sglang.driven.memory import KVAllocatorView, RadixCacheView, ReqToTokenView
from batchstate.sglang.driven.support import DriveRefused
from batchstate.sglang.replica import ExtendItem, Replica

__all__ = ["DRIVEN_CALLS", "Drive", "DriveError", "drive_every_scheduler", "driven_batch_class"]

DRIVEN_CALLS: Final = (
    "prepare_for_extend",
    "prepare_for_decode",
    "filter_batch",
    "merge_batch",
    "copy",
)
"""The `ScheduleBatch` methods batchstate computes for a driven batch."""


class DriveError(Error, RuntimeError):
    """batchstate refused a step SGLang's driven scheduler asked for (names the call and
    batchstate's reason); nothing the drive holds changed."""


_class_lock = threading.RLock()  # the class-level wrappers go in and out under it


@functools.cache
def driven_batch_class() -> type:
    """SGLang's `ScheduleBatch` with its mirrored fields read from a record: the class a
    driven batch has (made once, after SGLang is importable)."""
    install_stubs()
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    return type(
        "DrivenScheduleBatch",
        (RecordFields, ScheduleBatch),
        {"__doc__": "A `ScheduleBatch` whose mirrored fields are its record's."},
    )


class _Patches:
    """The class-level wrappers, installed while at least one drive is attached."""

    def __init__(self) -> None:
        self.users = 0
        self.restore: list[Callable[[], None]] = []
        self.originals: dict[str, Callable[..., Any]] = {}  # SGLang's own methods

    def install(self) -> None:
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        driven = driven_batch_class()
        for name in DRIVEN_CALLS:
            self.originals[name] = getattr(ScheduleBatch, name)
            self._replace(ScheduleBatch, name, _dispatch(name, self.originals[name], driven))
        made = ScheduleBatch.__dict__["init_new"].__func__

        def init_new(
            cls: type, reqs: list[Any], req_to_token_pool: object, *args: Any, **kw: Any
        ) -> Any:
            batch = made(cls, reqs, req_to_token_pool, *args, **kw)
            if isinstance(req_to_token_pool, ReqToTokenView):
                owner = req_to_token_pool.owner
                if isinstance(owner, Drive):
                    owner.adopt(batch)
            return batch

        init_new.__doc__ = made.__doc__
        self._replace(ScheduleBatch, "init_new", classmethod(init_new))

    def _replace(self, owner: type, name: str, value: object) -> None:
        original = owner.__dict__[name]
        setattr(owner, name, value)
        self.restore.append(lambda: setattr(owner, name, original))

    def uninstall(self) -> None:
        while self.restore:
            self.restore.pop()()


_patches = _Patches()


def _dispatch(name: str, original: Callable[..., Any], driven: type) -> Callable[..., Any]:
    def call(batch: Any, *args: Any, **kwargs: Any) -> Any:
        kind: object = type(batch)  # not `type(batch) is driven`: mypy would narrow `batch`
        if kind is driven:
            binding: Binding = batch.batchstate_binding
            drive = cast("Drive", binding.owner)
            return getattr(drive, name)(batch, *args, **kwargs)
        return original(batch, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = original.__doc__
    return call


def _require_radix_cache(cache: Any) -> None:
    # What drive stands in for: a radix cache over full attention. A 0.5.23 server builds
    # a UnifiedRadixCache with the full-attention component alone; a hybrid model's (with
    # a window's or a state's component, or a pure-window cache) holds memory the views
    # do not present.
    name = type(cache).__name__
    if name not in ("RadixCache", "UnifiedRadixCache"):
        raise DriveRefused(f"drive mode stands in for SGLang's radix cache, not for {name}")
    if cache.disable:
        raise DriveRefused(f"drive mode does not stand in for a disabled {name}")
    others = [c.name for c in getattr(cache, "tree_components", ()) if c.name != "FULL"]
    if others:
        raise DriveRefused(
            f"drive mode does not run a hybrid model's cache ({name} with {', '.join(others)})"
        )


class Drive:
    """One SGLang scheduler's batch state and memory, as batchstate values.

    `pools` is the one `Pools` value (each transition's result replaces it); `replica`
    holds the record of each driven batch and the requests between chunks.
    `prefills`, `decodes` count the forwards it prepared.
    """

    def __init__(self, scheduler: object) -> None:
        install_stubs()
        s: Any = scheduler
        for name in ("req_to_token_pool", "token_to_kv_pool_allocator", "tree_cache"):
            if getattr(s, name, None) is None:
                raise DriveRefused(f"drive mode needs a scheduler with its {name} made")
        table = s.req_to_token_pool
        allocator = s.token_to_kv_pool_allocator
        if isinstance(table, ReqToTokenView):
            raise DriveRefused("this scheduler is driven already")
        _require_radix_cache(s.tree_cache)
        self.scheduler = s
        self.replica = Replica(
            page_size=int(allocator.page_size),
            kv_tokens=int(allocator.size),
            rows=int(table.size),
            context=int(table.req_to_token.shape[1]),
            device=str(table.device),
        )
        self.prefills = 0
        self.decodes = 0
        self._batches = 0
        self._stock: dict[str, object] = {}
        self._attached = False

    # The owner the memory views read and write.
    @property
    def pools(self) -> Pools:
        """The one `Pools` value."""
        return self.replica.pools

    @pools.setter
    def pools(self, value: Pools) -> None:
        self.replica.pools = value

    def release(self, rid: str, tokens: Sequence[int]) -> None:
        """SGLang released request `rid` (see `RadixCacheView.on_release`): one release
        transition; the whole pages of `tokens` stay cached.

        A request released before SGLang ever checkpointed it (aborted between chunks)
        leaves nothing of what it computed in SGLang's tree; batchstate published its
        whole pages at its extend, so they are evicted again here, where no other row
        reads them: the cache holds what SGLang's would.
        """
        replica = self.replica
        unpublished = rid in replica.unpublished
        computed = replica.tokens(rid) if unpublished else ()
        try:
            replica.release(rid, tokens)
        except Error as refused:
            raise DriveError(str(refused)) from refused
        if computed:
            hit = replica.prefix.get(rid, 0)
            ours = [
                (leaf, max(hit, start))
                for leaf, start in unlocked_leaves(replica.pools)
                if len(leaf) > hit and computed[: len(leaf)] == leaf
            ]
            replica.pools = evict_leaves(replica.pools, ours)

    def checkpoint(self, rid: str) -> None:
        """SGLang published what request `rid` computed."""
        self.replica.checkpoint(rid)

    def attach(self) -> Drive:
        """Put the views in the scheduler's place and drive its batches (idempotent)."""
        if self._attached:
            return self
        s = self.scheduler
        views = {
            "req_to_token_pool": ReqToTokenView(self),
            "token_to_kv_pool_allocator": KVAllocatorView(self),
            "tree_cache": RadixCacheView(self),
        }
        for name, view in views.items():
            self._stock[name] = getattr(s, name)
            setattr(s, name, view)
        policy = getattr(s, "policy", None)  # made after the memory, at a server's start
        if policy is not None:
            self._stock["policy.tree_cache"] = policy.tree_cache
            policy.tree_cache = views["tree_cache"]
        self._rebuild_result_processor()
        # A model runner reads the request-to-token table its pool holds: the pools' own.
        runner_pool = getattr(getattr(s.tp_worker, "model_runner", None), "req_to_token_pool", None)
        if runner_pool is not None and hasattr(runner_pool, "req_to_token"):
            self._stock["runner.req_to_token"] = runner_pool.req_to_token
            runner_pool.req_to_token = self.pools.table.device
        with _class_lock:
            if _patches.users == 0:
                _patches.install()
            _patches.users += 1
        self._attached = True
        return self

    def detach(self) -> None:
        """Give the scheduler back its own objects and SGLang's methods back."""
        if not self._attached:
            return
        s = self.scheduler
        for name in ("req_to_token_pool", "token_to_kv_pool_allocator", "tree_cache"):
            setattr(s, name, self._stock.pop(name))
        if "policy.tree_cache" in self._stock:
            s.policy.tree_cache = self._stock.pop("policy.tree_cache")
        self._rebuild_result_processor()
        if "runner.req_to_token" in self._stock:
            s.tp_worker.model_runner.req_to_token_pool.req_to_token = self._stock.pop(
                "runner.req_to_token"
            )
        with _class_lock:
            _patches.users -= 1
            if _patches.users == 0:
                _patches.uninstall()
        self._attached = False

    def __enter__(self) -> Drive:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _rebuild_result_processor(self) -> None:
        s = self.scheduler
        if getattr(s, "batch_result_processor", None) is not None:
            s.init_batch_result_processor()  # a frozen record of the memory objects

    def adopt(self, batch: Any, binding: Binding | None = None) -> None:
        """Make `batch` (just made by SGLang) a driven batch, reading its fields from
        its record: the one held under a new label, or `binding`'s."""
        batch.__class__ = driven_batch_class()
        for name in FIELDS:
            batch.__dict__.pop(name, None)
        if binding is None:
            label = f"d{self._batches}"
            self._batches += 1
            replica = self.replica
            binding = Binding(self, replica.records, replica.empty, label)
            # The label's record goes with the batch (a batch SGLang dropped, empty).
            weakref.finalize(batch, replica.records.pop, label, None)
        batch.batchstate_binding = binding

    # The lifecycle, for driven batches (`_dispatch` routes SGLang's calls here).
    def prepare_for_extend(self, batch: Any) -> None:
        """SGLang's `prepare_for_extend`, computed by `mix` + `finish_mixed`."""
        from sglang.srt.managers.schedule_batch import (
            compute_extend_logprob_start_len,
            split_cached_prefix_by_tier,
        )
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

        reqs = batch.reqs
        _require_plain(batch, reqs)
        items = [
            ExtendItem(
                r.rid, tuple(r.full_untruncated_fill_ids), int(r.extend_len), int(r.prefix_len)
            )
            for r in reqs
        ]
        binding: Binding = batch.batchstate_binding
        # SGLang's allocation evicts ahead for a page per request more than the tokens.
        page = self.replica.page_size
        demand = sum(i.extend_len for i in items) + (len(items) * page if page > 1 else 0)
        batch.token_to_kv_pool_allocator.evict_to_free_tokens(batch.tree_cache, demand)
        try:
            mixed = self.replica.extend(binding.label, items, exact_hits=True)
        except Error as refused:
            raise DriveError(str(refused)) from refused
        theirs = [(i.prefix_len, i.extend_len) for i in items]
        ours = list(zip(mixed.prefix_lens.tolist(), mixed.extend_lens.tolist(), strict=True))
        if ours != theirs:
            raise DriveError(
                "prepare_for_extend: batchstate split the prompts otherwise than SGLang's "
                f"admission: (prefix, extend) {ours}, SGLang's {theirs}"
            )
        binding.forward = mixed
        self.prefills += 1
        batch.forward_mode = ForwardMode.EXTEND
        slots = mixed.rows.req_pool_indices.host.tolist()
        lens = mixed.rows.seq_lens.host.tolist()
        for req, slot, seq_len, item in zip(reqs, slots, lens, items, strict=True):
            # What SGLang's prepare_for_extend and alloc_for_extend set on each request.
            req.kv.req_pool_idx = slot
            req.kv.kv_allocated_len = req.kv.kv_committed_len = seq_len
            req.extend_batch_idx += 1
            if not req.retracted_stain:
                req.cached_tokens += item.prefix_len - req.already_computed
                if not req._cache_breakdown_computed:  # SGLang's own flag
                    (
                        req.cached_tokens_device,
                        req.cached_tokens_host,
                        req.cached_tokens_storage,
                    ) = split_cached_prefix_by_tier(
                        prefix_len=item.prefix_len,
                        host_hit_len=req.materialized_host_hit_len(),
                        storage_hit_len=req.storage_hit_length,
                        storage_hit_start=req.storage_hit_start,
                        host_hit_is_storage=req.host_hit_is_storage,
                    )
                    req._cache_breakdown_computed = True
                req.already_computed = seq_len
            req.is_retracted = False
        batch.input_ids = mixed.input_ids.device  # the forward's tokens, the record's own
        batch.prefill_input_ids_cpu = None
        batch.input_embeds = batch.replace_embeds = batch.replace_positions = None
        batch.multimodal_inputs = [None] * len(reqs)
        batch.extend_logprob_start_lens = [
            compute_extend_logprob_start_len(
                logprob_start_len=r.logprob_start_len,
                prefix_len=i.prefix_len,
                extend_len=i.extend_len,
                full_untruncated_fill_len=len(r.full_untruncated_fill_ids),
            )
            for r, i in zip(reqs, items, strict=True)
        ]
        batch.extend_input_logprob_token_ids = None
        batch.sampling_info = SamplingBatchInfo.from_schedule_batch(
            batch, batch.model_config.vocab_size
        )

    def prepare_for_decode(self, batch: Any) -> None:
        """SGLang's `prepare_for_decode`, computed by `decode`."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        binding: Binding = batch.batchstate_binding
        if batch.sampling_info.penalizer_orchestrator.is_required:
            batch.cumulate_penalty_output_tokens()
        # SGLang's allocation evicts ahead for a new page per row.
        demand = len(batch.reqs) * self.replica.page_size
        if self.pools.num_free_tokens < demand:
            batch.token_to_kv_pool_allocator.evict_to_free_tokens(batch.tree_cache, demand)
        try:
            self.replica.decode(binding.label)
        except Error as refused:
            raise DriveError(str(refused)) from refused
        binding.forward = None
        self.decodes += 1
        batch.forward_mode = ForwardMode.DECODE
        batch.input_embeds = batch.replace_embeds = batch.replace_positions = None
        for req in batch.reqs:
            req.decode_batch_idx += 1
            req.kv.kv_allocated_len += 1
            req.kv.kv_committed_len += 1

    def filter_batch(
        self, batch: Any, reqs_to_exclude: Any = None, keep_indices: list[int] | None = None
    ) -> None:
        """SGLang's `filter_batch`, computed by `split` + `filter_batch`: emptied, the
        batch's record has no rows (none for a later merge to bring back)."""
        reqs = batch.reqs
        if keep_indices is None:
            if reqs_to_exclude is None:
                excluded: list[Any] = []
            elif isinstance(reqs_to_exclude, list):
                excluded = reqs_to_exclude
            else:
                excluded = [reqs_to_exclude]
            keep_indices = [i for i, r in enumerate(reqs) if not r.finished() and r not in excluded]
        binding: Binding = batch.batchstate_binding
        binding.forward = None
        if len(keep_indices) == len(reqs) == self.replica.num_rows(binding.label):
            return  # every row stays, none released since: the record is the filter's
        kept = [reqs[i] for i in keep_indices]
        try:
            self.replica.filter(binding.label, [r.rid for r in kept])
        except Error as refused:
            raise DriveError(str(refused)) from refused
        if len(kept) == len(reqs):
            return
        batch.reqs = kept
        if not kept:
            batch.input_ids = None
            batch.return_hidden_states = False
            return
        keep_device = torch.tensor(keep_indices, dtype=torch.int64).to(batch.device)
        if batch.input_ids is not None:
            batch.input_ids = batch.input_ids[keep_device]
        batch.return_logprob = any(r.return_logprob for r in kept)
        batch.top_logprobs_nums = batch.token_ids_logprobs = None
        batch.has_grammar = any(r.grammar for r in kept)
        batch.sampling_info.filter_batch(keep_indices, keep_device)

    def merge_batch(self, batch: Any, other: Any) -> None:
        """SGLang's `merge_batch`, computed by `merge`: `other`'s rows after `batch`'s."""
        kind: object = type(other)
        if kind is not driven_batch_class():
            raise DriveError("merge_batch: the other batch is not driven by this scheduler")
        binding: Binding = batch.batchstate_binding
        theirs: Binding = other.batchstate_binding
        try:
            self.replica.merge(binding.label, theirs.label)
        except Error as refused:
            raise DriveError(str(refused)) from refused
        binding.forward = theirs.forward = None
        batch.sampling_info.merge_batch(other.sampling_info)
        if batch.input_ids is not None and other.input_ids is not None:
            batch.input_ids = torch.cat([batch.input_ids, other.input_ids])
        else:
            batch.input_ids = None
        batch.reqs = batch.reqs + other.reqs
        batch.return_logprob = batch.return_logprob or other.return_logprob
        batch.has_grammar = batch.has_grammar or other.has_grammar
        batch.is_prefill_only = batch.is_prefill_only and other.is_prefill_only

    def copy(self, batch: Any) -> Any:
        """SGLang's `copy` (the overlap scheduler's snapshot for result processing): a
        driven batch sharing this step's record, which is frozen."""
        binding: Binding = batch.batchstate_binding
        copied = _patches.originals["copy"](batch)  # SGLang's: reads the fields it copies
        self.adopt(copied, binding.frozen())
        return copied


def _require_plain(batch: Any, reqs: Sequence[Any]) -> None:
    # What a driven extend does not compute: refused by name rather than run wrong.
    if batch.model_config.is_encoder_decoder or batch.is_dllm():
        raise DriveRefused("drive mode does not run encoder-decoder or diffusion batches")
    for r in reqs:
        if r.return_logprob or r.input_embeds is not None or r.multimodal_inputs is not None:
            raise DriveRefused(
                f"drive mode does not run request {r.rid}: input logprobs, input embeddings "
                "and multimodal inputs are not driven"
            )
        if r.positional_embed_overrides is not None:
            raise DriveRefused(f"drive mode does not run request {r.rid}'s embedding overrides")


def drive_every_scheduler() -> Callable[[], None]:
    """Drive each SGLang `Scheduler` made from now on in this process (what
    `python -m batchstate.sglang.launch --drive` turns on in the scheduler's process):
    once the scheduler has made its memory and before it makes its schedule policy, its
    server arguments are checked (`check_drive`: a refused configuration stops the
    scheduler at start, one line naming it) and a `Drive` attached. Returns the undo."""
    install_stubs()
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_server_args

    from batchstate.sglang.driven.support import check_drive

    original = Scheduler.__dict__["init_running_status"]

    def init_running_status(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        check_drive(getattr(self, "server_args", None) or get_server_args())
        Drive(self).attach()
        return result

    init_running_status.__doc__ = original.__doc__
    Scheduler.init_running_status = init_running_status

    def undo() -> None:
        Scheduler.init_running_status = original

    return undo
