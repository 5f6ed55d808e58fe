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

from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from batchstate.sglang.drive import Driver
from batchstate.sglang.fake_worker import FakeWorker


class Outputs:
    """Stands in for SGLang's output streamer (which sends to the detokenizer): keeps
    each request's output ids as SGLang's result processing streamed them."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.aborted: list[str] = []  # rids the scheduler reported aborted outside the stream

    def stream_output(self, reqs: list[Any], return_logprob: bool, *args: object) -> None:
        """What SGLang streams after each batch's results: every request's outputs so far."""
        for req in reqs:
            self.tokens[req.rid] = list(req.output_ids)
            if req.finished():
                self.finished[req.rid] = type(req.finished_reason).__name__

    def send_output(self, output: Any, req: Any = None) -> None:
        """What the scheduler sends the tokenizer outside the stream: an abort's reply."""
        rid = getattr(output, "rid", None)
        if isinstance(rid, str):
            self.aborted.append(rid)

    def _stream_output_generation(self, reqs: list[Any], *args: object, **kw: object) -> None:
        self.stream_output(reqs, False)


class SchedulerLoop:
    """SGLang's real scheduling decisions over the `Driver`'s pools and radix cache.

    `unified_cache`: the radix cache is SGLang's `UnifiedRadixCache` over full attention
    (what a 0.5.23 server builds by default) in place of its `RadixCache`.
    """

    def __init__(
        self,
        *,
        page_size: int,
        kv_tokens: int,
        rows: int,
        context: int = 1024,
        seed: int = 0,
        overlap: bool = False,
        unified_cache: bool = False,
    ) -> None:
        self.driver = Driver(
            page_size=page_size,
            kv_tokens=kv_tokens,
            rows=rows,
            context=context,
            seed=seed,
            unified_cache=unified_cache,
        )
        self.worker = FakeWorker()
        self.outputs = Outputs()
        self.overlap = overlap  # event_loop_overlap's order: a batch's result one turn later
        self.scheduler: Any = _scheduler(self.driver, page_size, self.worker, overlap, self.outputs)

    def submit(self, prompt: list[int], max_new_tokens: int) -> None:
        """Queue one request in SGLang's waiting queue (greedy sampling), checked as
        `Scheduler.handle_generate_request` checks it: `max_new_tokens` clipped to the
        context and the KV budget, a prompt over `max_req_input_len` set to finish with
        an abort (it runs one cheap prefill, then leaves)."""
        from sglang.srt.managers.utils import validate_input_length

        self.driver.submit(prompt, max_new_tokens)
        for req in self.driver.waiting:
            self.scheduler.init_req_max_new_tokens(req)
            error = validate_input_length(req, self.scheduler.max_req_input_len, False)
            if error:
                req.set_finish_with_abort(error)
        self.scheduler.waiting_queue.extend(self.driver.waiting)
        self.driver.waiting.clear()

    def abort(self, rid: str) -> None:
        """A client abort: SGLang's `Scheduler.abort_request` (which matches every rid
        that starts with `rid`): a waiting request leaves the queue, a running one
        finishes at its next result, a request between chunks at the next turn."""
        from sglang.srt.managers.io_struct import AbortReq

        self.scheduler.abort_request(AbortReq(rid=rid))

    @property
    def busy(self) -> bool:
        """Whether a request is waiting, held between chunks, running, or in the last
        batch (an extend batch is merged into the running batch only at the next turn;
        a mixed step leaves the running batch empty)."""
        s = self.scheduler
        last = s.last_batch
        return (
            bool(s.waiting_queue)
            or bool(s.result_queue)
            or s.chunked_req is not None
            or not s.running_batch.is_empty()
            or (last is not None and not last.is_empty())
        )

    def step(self) -> str:
        """One turn of SGLang's event loop (`event_loop_normal`, or under overlap
        `event_loop_overlap`): 'prefill', 'decode' or 'idle'."""
        s = self.scheduler
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        s.cur_batch_for_debug = batch
        if not self.overlap:
            if batch:
                s.process_batch_result(batch, s.run_batch(batch))
            else:
                s._sched_idled = True
        else:  # this batch launches before the last one's result is processed
            serial = s.is_disable_overlap_for_batch(batch, last_batch=s.last_batch)
            if serial:
                self._process_last()
            result = None
            if batch:
                result = s.run_batch(batch)
                s._apply_war_barrier()
                s.result_queue.append((batch.copy(), result))
            else:
                s._sched_idled = True
            if s.last_batch and not serial:
                self._process_last()
            s.launch_batch_sample_if_needed(result, batch)
        s.last_batch = batch
        if not batch:
            return "idle"
        return "prefill" if batch.forward_mode.is_extend() else "decode"

    def _process_last(self) -> None:
        done, result = self.scheduler.result_queue.popleft()
        self.scheduler.process_batch_result(done, result)


class _Inert:
    """Stands in for a collaborator whose every call the CPU loop does without (metrics,
    profiling, load reports): each method accepts anything and returns None."""

    def __init__(self, **values: object) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("__"):
            raise AttributeError(name)
        return _nothing


def _nothing(*args: object, **kwargs: object) -> None:
    return None


def _scheduler(
    driver: Driver, page_size: int, worker: FakeWorker, overlap: bool, outputs: object
) -> object:
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
        "enable_overlap": overlap,
        "enable_overlap_mlx": False,
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
        "model_config": SimpleNamespace(
            **vars(driver.model_config),
            # What result processing reads of a model config: no reasoning markers.
            self_opened_think_start_ids=None,
            think_end_ids=None,
        ),
        "req_to_token_pool": driver.req_to_token_pool,
        "token_to_kv_pool_allocator": driver.allocator,
        "tree_cache": driver.tree_cache,
        "is_hybrid_swa": False,
        "is_hybrid_ssm": False,
        "device": "cpu",
        "draft_worker": None,
        "tp_worker": worker,
        "model_worker": worker,
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
        "metrics_reporter": _Inert(
            num_retracted_reqs=0, enable_metrics=False, num_generated_tokens=0, forward_ct_decode=0
        ),
        # What run_batch and process_batch_result call besides the model: CPU streams,
        # and no metrics, profiler, load reports or IPC.
        "is_generation": True,
        # TpModelWorker's: the context or the KV pool, whichever is shorter, less one.
        "max_req_len": min(
            int(driver.req_to_token_pool.req_to_token.shape[1]), int(driver.allocator.size)
        )
        - 1,
        "max_req_input_len": min(
            int(driver.req_to_token_pool.req_to_token.shape[1]), int(driver.allocator.size)
        )
        - 6,
        "max_total_num_tokens": int(driver.allocator.size),
        "kv_shard_widening": 1,
        "sliding_window_size": None,
        "max_new_tokens_limit": None,
        "enable_pdmux": False,
        "enable_unified_memory": False,
        "enable_fpm": False,
        "_war_barrier_enabled": False,
        "forward_stream": torch.cpu.Stream(),
        "schedule_stream": torch.cpu.Stream(),
        "forward_sleep_time": None,
        "scripted_scheduler_hook": None,
        "profiler_manager": _Inert(),
        "load_snapshot_writer": None,
        "load_publisher": _Inert(),
        "metrics_collector": _Inert(),
        "return_health_check_ipcs": None,
        "mm_receiver": None,
        # init_load_inquirer's step counters, without its load inquirer.
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moment_totals": [0.0] * 6,
        "_prev_step": None,
        "_prev_prefill_end_ts": None,
        "_sched_idled": False,
        "_pause_intervals": deque(),
        "_pause_started_at": None,
        "output_streamer": outputs,
        "_pending_chunked_abort_req": None,
        "_prefill_decode_interval_remaining": 0,
        "prefill_decode_interval": 0,
        "prefill_decode_interval_min_bs": 0,
        "grammar_manager": SimpleNamespace(
            has_waiting_grammars=lambda: False, abort_requests=lambda recv_req: None
        ),
        # abort_request's reply to the tokenizer, kept by `outputs`.
        "rust_server": None,
        "ipc_channels": SimpleNamespace(send_to_tokenizer=outputs),
        "enable_continuous_input_polling": False,
        "beam_coordinator": SimpleNamespace(pending_member_rows=lambda batch: 0),
        "load_inquirer": _Inert(_get_num_pending_tokens=lambda chunk_deduct=0: 0),
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
    s.init_overlap()  # the future map: next-token relay between forwards
    s.init_batch_result_processor()  # SGLang's own output processing
    # event_loop_overlap sets it as it starts: a request that finishes at this decode
    # leaves the batch before its result is processed.
    s.enable_skip_finishing_decode = overlap
    return s
