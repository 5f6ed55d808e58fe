"""SGLang's own `Scheduler.get_next_batch_to_run`, stepped on CPU with a fake model.

SGLang's `Scheduler.__init__` loads a model, a tokenizer and IPC sockets. Without
them, `SchedulerLoop` makes the object with `object.__new__`, sets the attributes
`__init__` sets from the published server arguments, runs the `init_*` steps that
need no model (running status, schedule policy, deterministic-inference config,
internal state) and puts inert stand-ins where the model side would be (no grammar
backend, no data-parallel attention, no n-gram embedding, no load reporting). Each
`step` is one turn of `Scheduler.event_loop_normal`: SGLang's `get_next_batch_to_run`
(admission through `PrefillAdder`, chunked prefill and its stash, the merge into the
running batch, `update_running_batch` with retraction under memory pressure), then
the fake model's forward with `process_batch_result`'s bookkeeping (the `Driver`'s).
Requires an active `cpu_topology()` (whose arguments set the chunk and the limits).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from batchstate.sglang.drive import Driver


class SchedulerLoop:
    """SGLang's real scheduling decisions over the `Driver`'s pools and radix cache."""

    def __init__(
        self,
        *,
        page_size: int,
        kv_tokens: int,
        rows: int,
        context: int = 1024,
        seed: int = 0,
        overlap: bool = False,
    ) -> None:
        self.driver = Driver(
            page_size=page_size, kv_tokens=kv_tokens, rows=rows, context=context, seed=seed
        )
        self.scheduler: Any = _scheduler(self.driver, page_size)
        self.overlap = overlap  # event_loop_overlap's order: a batch's result one turn later
        if overlap:
            scheduler: Any = self.scheduler
            scheduler.enable_overlap = True
            scheduler.enable_skip_finishing_decode = True

    def submit(self, prompt: list[int], max_new_tokens: int) -> None:
        """Queue one request in SGLang's waiting queue (greedy sampling)."""
        self.driver.submit(prompt, max_new_tokens)
        self.scheduler.waiting_queue.extend(self.driver.waiting)
        self.driver.waiting.clear()

    @property
    def busy(self) -> bool:
        """Whether a request is waiting, held between chunks, running, or in the last
        batch (an extend batch is merged into the running batch only at the next turn)."""
        s = self.scheduler
        return (
            bool(s.waiting_queue)
            or bool(s.result_queue)
            or s.chunked_req is not None
            or not s.running_batch.is_empty()
            or (s.last_batch is not None and not s.last_batch.is_empty())
        )

    def step(self) -> str:
        """One turn of SGLang's event loop (normal, or overlap); 'prefill', 'decode' or
        'idle'."""
        s = self.scheduler
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        s.cur_batch_for_debug = batch
        if not self.overlap:
            if batch:
                self.driver._forward(batch)  # process_batch_result's bookkeeping
        else:  # event_loop_overlap: this batch launches before the last one's result
            serial = s.is_disable_overlap_for_batch(batch, last_batch=s.last_batch)
            if serial:
                self._process_last()
            if batch:
                s.result_queue.append((batch.copy(), None))
            if s.last_batch and not serial:
                self._process_last()
        s.last_batch = batch
        if not batch:
            return "idle"
        return "prefill" if batch.forward_mode.is_extend() else "decode"

    def _process_last(self) -> None:
        queue = self.scheduler.result_queue
        if queue:
            done, _ = queue.popleft()
            self.driver._forward(done)  # process_batch_result's bookkeeping


def _scheduler(driver: Driver, page_size: int) -> object:
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_disagg, get_schedule
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    schedule = get_schedule()
    s: Any = object.__new__(Scheduler)
    fields: dict[str, object] = {
        # What Scheduler.__init__ sets before it loads the model.
        "is_initializing": False,
        "forward_ct": 0,
        "processed_tokens_counter": 0,
        "cur_batch_for_debug": None,
        "schedule_policy": schedule.schedule_policy,
        "enable_priority_scheduling": schedule.enable_priority_scheduling,
        "abort_on_priority_when_disabled": schedule.abort_on_priority_when_disabled,
        "schedule_low_priority_values_first": schedule.schedule_low_priority_values_first,
        "priority_scheduling_preemption_threshold": (
            schedule.priority_scheduling_preemption_threshold
        ),
        "enable_lora": False,
        "enable_lora_overlap_loading": False,
        "enable_overlap": False,
        "spec_algorithm": SpeculativeAlgorithm.NONE,
        "page_size": page_size,
        "enable_hierarchical_cache": False,
        "enable_lmcache": False,
        "enable_session_radix_cache": False,
        "enable_hicache_storage": False,
        "enable_unified_cache_external_linker": False,
        "enable_hisparse": False,
        "attn_dp_enabled": False,
        "disaggregation_mode": DisaggregationMode(get_disagg().disaggregation_mode),
        # The model side: the driver's pools and radix cache, no model worker.
        "model_config": driver.model_config,
        "req_to_token_pool": driver.req_to_token_pool,
        "token_to_kv_pool_allocator": driver.allocator,
        "tree_cache": driver.tree_cache,
        "is_hybrid_swa": False,
        "is_hybrid_ssm": False,
        "device": "cpu",
        "draft_worker": None,
        "tp_worker": SimpleNamespace(
            model_runner=SimpleNamespace(attn_backend=object(), prefill_aware_swa=False)
        ),
        # What the init_* steps that need a model would set: off, or inert.
        "chunked_req": None,
        "chunked_prefill_size": schedule.chunked_prefill_size,
        "max_prefill_tokens": schedule.max_prefill_tokens,
        "max_running_requests": schedule.max_running_requests,
        "is_mixed_chunk": False,
        "enable_priority_preemption": False,
        "dynamic_chunk_sizer": None,
        "min_free_slots_delayer": None,
        "lora_drainer": None,
        "lora_overlap_loader": None,
        "hisparse_coordinator": None,
        "dllm_config": None,
        "dllm_manager": None,
        "require_mlp_sync": False,
        "scheduler_stage_metrics": None,
        "decode_offload_manager": None,
        "max_queued_requests": None,
        "metrics_reporter": SimpleNamespace(num_retracted_reqs=0, enable_metrics=False),
        "_pending_chunked_abort_req": None,
        "_prefill_decode_interval_remaining": 0,
        "prefill_decode_interval": 0,
        "prefill_decode_interval_min_bs": 0,
        "grammar_manager": SimpleNamespace(has_waiting_grammars=lambda: False),
        "beam_coordinator": SimpleNamespace(pending_member_rows=lambda batch: 0),
        "load_inquirer": SimpleNamespace(_get_num_pending_tokens=lambda chunk_deduct=0: 0),
        "dp_attn_adapter": SimpleNamespace(
            maybe_prepare_mlp_sync_batch=lambda batch, need_sync=None: batch,
            maybe_convert_decode_to_extend=lambda batch: batch,
        ),
        "ngram_embedding_manager": SimpleNamespace(
            prepare_for_forward=lambda batch, chunked_req=None: batch
        ),
    }
    for name, value in fields.items():
        setattr(s, name, value)
    s.init_running_status()
    s.init_schedule_policy()
    s.init_deterministic_inference_config()
    s.init_internal_state()
    return s
