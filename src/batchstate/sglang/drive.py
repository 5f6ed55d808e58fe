"""A seeded workload driven through SGLang's own scheduler bookkeeping on CPU.

No model: a "forward" appends one seeded token per request. Everything else is
SGLang's: `PrefillAdder` admits from the waiting queue against the radix cache and
the KV budget, `ScheduleBatch.prepare_for_extend` / `prepare_for_decode` allocate,
`check_decode_mem` / `retract_decode` retract under memory pressure,
`release_kv_cache` / `checkpoint_kv_cache` move KV into the radix cache,
`filter_batch` / `merge_batch` reshape the running batch. The step order is
`Scheduler.get_next_batch_to_run` + `update_running_batch` +
`process_batch_result`'s, for the default (non-speculative, non-mixed) path.
"""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace
from typing import Any, Final

import torch

from batchstate.sglang._stubs import install_stubs


class Driver:
    """SGLang's pools, radix cache and batches, stepped with seeded tokens.

    Requires an active `cpu_topology()`.
    """

    def __init__(
        self,
        *,
        page_size: int,
        kv_tokens: int,
        rows: int,
        context: int = 1024,
        seed: int = 0,
        chunk: int | None = None,
        unified_cache: bool = False,
    ) -> None:
        self.page_size = page_size
        self.rng = random.Random(seed)
        self.req_to_token_pool, self.allocator, self.tree_cache = cpu_memory(
            page_size=page_size,
            kv_tokens=kv_tokens,
            rows=rows,
            context=context,
            cache=True,
            unified=unified_cache,
        )
        self.model_config = MODEL_CONFIG
        self.waiting: list[Any] = []
        self.running: Any = self._batch([])
        self.chunk = chunk  # chunked prefill's token budget per prefill; None: off
        self.chunked_req: Any = None
        self.last_batch: Any = None  # held as the scheduler holds it, until the next step
        self.finished = 0
        self.chunks = 0  # prefills that left a request mid-prompt
        self.retracted = 0
        self._next_rid = 0
        # Result processing inside the allocator's free group, as SGLang's scheduler runs
        # it: what a release frees shows in the allocator only at the group's end.
        self.free_group = False

    def submit(self, prompt: list[int], max_new_tokens: int) -> None:
        """Queue one request (SGLang `Req`) with greedy sampling."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
        params.normalize(None)
        req = Req(f"r{self._next_rid}", "", array("q", prompt), params, vocab_size=32000)
        self._next_rid += 1
        self.waiting.append(req)

    def _batch(self, reqs: list[Any], chunked_req: Any = None) -> Any:
        return new_batch(self, reqs, chunked_req)

    def step(self) -> str:
        """One scheduler step: a prefill when one is admitted, else a decode. Returns
        'prefill', 'decode' or 'idle'."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        batch = self._prefill()
        if batch is not None:
            self._forward(batch)
            self.last_batch = batch
            if self.chunked_req is not None:
                # Scheduler.get_next_batch_to_run: stash the chunk, keep it out of the merge.
                checkpoint_kv_cache(self.chunked_req, self.tree_cache)
                batch.filter_batch(reqs_to_exclude=[self.chunked_req])
            else:
                batch.filter_batch()
            if self.running.is_empty():
                self.running = batch
            elif not batch.is_empty():
                self.running.merge_batch(batch)
            return "prefill"
        if self.running.is_empty():
            return "idle"
        self.running.filter_batch()
        if self.running.is_empty():
            return "idle"
        if not self.running.check_decode_mem():
            retracted, _, _ = self.running.retract_decode()
            self.retracted += len(retracted)
            self.waiting.extend(retracted)
        self.running.prepare_for_decode()
        self._forward(self.running)
        return "decode"

    def _prefill(self) -> Any:
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        if self.chunked_req is None and (
            not self.waiting or self.req_to_token_pool.available_size() == 0
        ):
            return None
        adder = PrefillAdder(
            self.page_size, self.tree_cache, self.allocator, self.running, 0.5, 4096, self.chunk
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting:
            if self.chunked_req is not None or adder.new_chunked_req is not None:
                break
            if len(adder.can_run_list) >= self.req_to_token_pool.available_size():
                break
            req.init_next_round_input(self.tree_cache)
            if (
                adder.add_one_req(
                    req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None
                )
                != AddReqResult.CONTINUE
            ):
                break
        if not adder.can_run_list:
            return None
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
            self.chunks += 1
        batch = self._batch(adder.can_run_list, self.chunked_req)
        batch.prepare_for_extend()
        return batch

    def _forward(self, batch: Any) -> None:
        """The fake model: one seeded token per row, then SGLang's result processing."""
        if not self.free_group:
            self._results(batch)
            return
        self.allocator.free_group_begin()
        try:
            self._results(batch)
        finally:
            self.allocator.free_group_end()

    def _results(self, batch: Any) -> None:
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        for req in batch.reqs:
            if req.finished() or req.kv.req_pool_idx is None:
                continue  # under overlap: finished, or retracted, since this batch ran
            if req.inflight_middle_chunks > 0:  # a middle chunk samples nothing
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(self.rng.randrange(100, 32000))
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.tree_cache, checkpoint=True)
                self.finished += 1
            elif batch.forward_mode.is_extend() and req not in (batch.decoding_reqs or ()):
                # A mixed step's decode rows are not checkpointed (process_batch_result).
                checkpoint_kv_cache(req, self.tree_cache)


# What `ScheduleBatch.init_new` reads of a model's config when no model is loaded.
MODEL_CONFIG: Final = SimpleNamespace(vocab_size=32000, is_encoder_decoder=False)


def cpu_memory(
    *, page_size: int, kv_tokens: int, rows: int, context: int, cache: bool, unified: bool = False
) -> tuple[Any, Any, Any]:
    """SGLang's request-to-token pool, KV allocator and radix cache, on CPU.

    `cache`: False disables the radix cache, as `--disable-radix-cache` does.
    `unified`: SGLang's `UnifiedRadixCache` over full attention, what a 0.5.23 server
    builds by default, in place of its `RadixCache`.
    """
    install_stubs()
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    req_to_token_pool = ReqToTokenPool(
        size=rows, max_context_len=context, device="cpu", enable_memory_saver=False
    )
    allocator = kv_allocator(page_size, kv_tokens)
    params = CacheInitParams(
        disable=not cache,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
    )
    if not unified:
        return req_to_token_pool, allocator, RadixCache(params)
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params.tree_components = (ComponentType.FULL,)
    return req_to_token_pool, allocator, UnifiedRadixCache(params)


def new_batch(owner: Any, reqs: list[Any], chunked_req: Any = None) -> Any:
    """`ScheduleBatch.init_new` over `owner`'s pools, cache and model config, no speculation."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return ScheduleBatch.init_new(
        reqs,
        owner.req_to_token_pool,
        owner.allocator,
        owner.tree_cache,
        owner.model_config,
        False,
        SpeculativeAlgorithm.NONE,
        chunked_req=chunked_req,
    )


def kv_allocator(page_size: int, kv_tokens: int) -> Any:
    """SGLang's CPU KV allocator of `kv_tokens`: the token one at page 1, else the paged one."""
    if page_size == 1:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        return TokenToKVPoolAllocator(
            size=kv_tokens, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False
        )
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(
        size=kv_tokens,
        page_size=page_size,
        dtype=torch.float16,
        device="cpu",
        kvcache=None,
        need_sort=False,
    )
