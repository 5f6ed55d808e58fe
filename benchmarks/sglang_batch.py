"""SGLang 0.5.23's own step, phase by phase, on the plain and the default workloads.

Every timed phase is SGLang's real code: `PrefillAdder` admits against the
cache and the KV budget, `ScheduleBatch.init_new` / `prepare_for_extend` /
`prepare_for_decode` allocate (evicting from the radix cache when short),
`release_kv_cache` / `checkpoint_kv_cache` move KV into the cache,
`filter_batch` / `merge_batch` reshape the running batch, and every batch
carries its `SamplingBatchInfo` (temperature 0.7, top-p 0.9, top-k 40, as
batchstate's `Sampling` columns). The order is the scheduler's
(`get_next_batch_to_run`, `update_running_batch`, `process_batch_result`)
for the default non-overlapped path; `forward` stands for the model (the
sampled tokens, the finish decision) and is not timed. Both sides run the same
requests to the same lengths (`tests/sglang/test_sglang_step.py`); at page sizes over 1,
SGLang's new chunk can end a page short of batchstate's, its budget rounding the
held chunk's last partial page up.

Requires an active `batchstate.sglang.cpu_topology()`.
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

from batchstate.sglang.drive import MODEL_CONFIG, cpu_memory, new_batch
from benchmarks.production_plan import FIRST_CHUNK, ProductionPlan, Turn, generated
from benchmarks.scenario import Join, Plan

__all__ = ["SGLangDefault", "SGLangPlain"]

# max_new_tokens: the plan, not the length, says who finishes; 1 keeps admission's
# reservation (new_token_ratio 0 for running rows) inside the plan's tight KV pool.
_NO_FINISH = 1


class _SGLang:
    """SGLang's pools, cache and running batch; `prefill` admits through `PrefillAdder`."""

    def __init__(
        self, *, page_size: int, kv_tokens: int, rows: int, context: int, cache: bool
    ) -> None:
        self.page_size = page_size
        self.req_to_token_pool, self.allocator, self.tree_cache = cpu_memory(
            page_size=page_size, kv_tokens=kv_tokens, rows=rows, context=context, cache=cache
        )
        self.model_config = MODEL_CONFIG
        self.running: Any = self._batch([])
        self.chunked_req: Any = None

    def _req(self, rid: int, input_ids: tuple[int, ...]) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=_NO_FINISH, temperature=0.7, top_p=0.9, top_k=40)
        params.normalize(None)
        return Req(str(rid), "", array("q", input_ids), params, vocab_size=32000)

    def _batch(self, reqs: list[Any], chunked_req: Any = None) -> Any:
        return new_batch(self, reqs, chunked_req)

    def _prefill(self, waiting: list[Any], chunk: int | None) -> Any:
        """`Scheduler.get_new_batch_prefill`: the held chunk first, then `waiting` in order."""
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        # new_token_ratio 0: the plan, not a reservation, decides who runs.
        adder = PrefillAdder(
            self.page_size, self.tree_cache, self.allocator, self.running, 0.0, 1 << 20, chunk
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in waiting:
            req.init_next_round_input(self.tree_cache)
            result = adder.add_one_req(
                req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None
            )
            if result != AddReqResult.CONTINUE:
                break
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = self._batch(adder.can_run_list, self.chunked_req)
        batch.prepare_for_extend()
        return batch

    def _sample(self, batch: Any) -> None:
        """The fake forward: each sampling row's next token, as `run_batch` leaves it."""
        tokens = []
        for req in batch.reqs:
            if req.inflight_middle_chunks > 0:  # a middle chunk samples nothing
                req.inflight_middle_chunks -= 1
                tokens.append(0)
                continue
            token = generated(int(req.rid), len(req.origin_input_ids) + len(req.output_ids))
            req.output_ids.append(token)
            tokens.append(token)
        batch.input_ids = torch.tensor(tokens, dtype=torch.int64)

    def _finish(self, row: int) -> None:
        """`process_batch_result_decode` for the row the plan finishes: into the cache, slot
        freed."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        req = self.running.reqs[row]
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.tree_cache, checkpoint=True)

    def rows(self) -> list[tuple[int, int]]:
        """(rid, sequence length) of each running row, in order."""
        lens = self.running.seq_lens_cpu.tolist()
        return [(int(req.rid), n) for req, n in zip(self.running.reqs, lens, strict=True)]


class SGLangPlain(_SGLang):
    """The plain step (`benchmarks.scenario`): decode, finish one, admit one, merge; no cache."""

    name = "sglang"

    def __init__(self, plan: Plan) -> None:
        super().__init__(
            page_size=plan.config.page_size,
            kv_tokens=plan.num_kv_tokens,
            rows=plan.config.batch_size + 1,
            context=plan.max_context_len,
            cache=False,
        )
        # As many prefills as admission takes (each reserves pages the next does not see).
        waiting = [self._req(rid, ids) for rid, ids in plan.initial]
        while waiting:
            batch = self._prefill(waiting, None)
            assert batch.reqs, "the starting batch must fit"
            self._sample(batch)
            if self.running.is_empty():
                self.running = batch
            else:
                self.running.merge_batch(batch)
            waiting = waiting[len(batch.reqs) :]
        self._incoming: Any = None

    def decode(self) -> None:
        self.running.prepare_for_decode()

    def forward(self, join: Join) -> None:
        self._sample(self.running)

    def release(self, join: Join) -> None:
        self._finish(join.finished_row)

    def filter(self, join: Join) -> None:
        self.running.filter_batch(keep_indices=join.keep)

    def extend(self, join: Join) -> None:
        self._incoming = self._prefill([self._req(join.rid, join.input_ids)], None)

    def prefill_forward(self) -> None:
        self._sample(self._incoming)

    def merge(self) -> None:
        self._incoming.filter_batch()
        self.running.merge_batch(self._incoming)


class SGLangDefault(_SGLang):
    """The default step (`benchmarks.production_plan`): radix cache, a held 128-token chunk,
    shared system prompts, allocation evicting."""

    name = "sglang"

    def __init__(self, plan: ProductionPlan) -> None:
        super().__init__(
            page_size=plan.page_size,
            kv_tokens=plan.num_kv_tokens,
            rows=plan.max_reqs,
            context=plan.max_context_len,
            cache=True,
        )
        # One request at a time, so that each reads the system prompt the ones before cached.
        for rid, ids in plan.initial:
            batch = self._prefill([self._req(rid, ids)], None)
            self._settle(batch)
            self._join(batch)
        rid, ids = plan.held
        batch = self._prefill([self._req(rid, ids)], FIRST_CHUNK)
        self._settle(batch)
        self._join(batch)
        self._prefilled: Any = None

    def _settle(self, batch: Any) -> None:
        """`process_batch_result_prefill`'s cache work: every unfinished row publishes."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        for req in batch.reqs:
            checkpoint_kv_cache(req, self.tree_cache)

    def _join(self, batch: Any) -> None:
        """`get_next_batch_to_run`: the held chunk stays out; the rest joins the running batch."""
        if self.chunked_req is not None:
            batch.filter_batch(reqs_to_exclude=[self.chunked_req])
        else:
            batch.filter_batch()
        if self.running.is_empty():
            self.running = batch
        elif not batch.is_empty():
            self.running.merge_batch(batch)

    def decode(self) -> None:
        self.running.prepare_for_decode()

    def prefill(self, turn: Turn) -> None:
        # The budget finishes the held chunk and gives the new request its first chunk.
        held = self.chunked_req
        budget = len(held.origin_input_ids) - held.prefix_len + FIRST_CHUNK
        self._prefilled = self._prefill([self._req(turn.rid, turn.input_ids)], budget)

    def forward(self, turn: Turn) -> None:
        self._sample(self.running)
        self._sample(self._prefilled)

    def settle(self) -> None:
        self._settle(self._prefilled)

    def release(self, turn: Turn) -> None:
        self._finish(turn.finished_row)
        self.running.filter_batch(keep_indices=turn.keep)

    def merge(self) -> None:
        self._join(self._prefilled)
