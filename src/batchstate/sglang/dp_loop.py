"""SGLang's data-parallel attention: one `SchedulerLoop` per rank, synced as SGLang syncs.

Each rank is its own SGLang scheduler with its own pools and radix cache. With
attention data parallelism on, SGLang's `get_next_batch_to_run` ends with
`SchedulerDPAttnAdapter.prepare_mlp_sync_batch`: every rank gathers every rank's
token count and forward mode, and a rank with nothing to run builds an idle batch
(`get_idle_batch`, `ScheduleBatch.prepare_for_idle`) whenever another rank runs one.
`DataParallelLoop` runs that, SGLang's adapter included, with each rank's turn in a
thread of its own: the gather meets in the rank threads, as it meets across
processes in SGLang.

The gather itself is a collective (`exchange_sync_rows` over a torch process group,
one process per rank); in one process it is replaced, inside `DataParallelLoop.step`,
by the same exchange of rows between the rank threads. The cuda-graph votes are off
(no graphs on CPU), so the decode-to-extend conversion a peer's prefill can trigger
(`maybe_convert_decode_to_extend`) does not run.
Requires an active `cpu_topology(enable_dp_attention=True, dp_size=..., tp_size=...)`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from batchstate.sglang.scheduler_loop import SchedulerLoop


class DataParallelLoop:
    """`ranks` SGLang schedulers, each over its own pools, stepped together."""

    def __init__(
        self, *, ranks: int, page_size: int, kv_tokens: int, rows: int, seed: int = 0
    ) -> None:
        from sglang.srt.managers.scheduler_components.dp_attn import SchedulerDPAttnAdapter
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.loops = [
            SchedulerLoop(page_size=page_size, kv_tokens=kv_tokens, rows=rows, seed=seed + r)
            for r in range(ranks)
        ]
        for loop in self.loops:
            s: Any = loop.scheduler
            s.attn_dp_enabled = True
            s.require_mlp_sync = True
            s.dp_attn_adapter = SchedulerDPAttnAdapter(
                # What the sync reads of the model runner: no graphs, no encoder window.
                model_runner=SimpleNamespace(
                    attn_backend=SimpleNamespace(folds_encoder_swa_replay=False),
                    prefill_cuda_graph_runner=None,
                    spec_algorithm=SpeculativeAlgorithm.NONE,
                    model_config=s.model_config,
                ),
                req_to_token_pool=s.req_to_token_pool,
                token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
                tree_cache=s.tree_cache,
                offload_tags=set(),
                model_config=s.model_config,
                enable_overlap=False,
                spec_algorithm=SpeculativeAlgorithm.NONE,
                get_require_mlp_sync=lambda: True,
            )
        self._rows: list[torch.Tensor] = [torch.empty(0)] * ranks
        self._barrier = threading.Barrier(ranks)
        self._rank = threading.local()
        self.idle = [0] * ranks  # idle batches each rank ran while another had work
        self.submitted: list[list[Any]] = [[] for _ in range(ranks)]  # each rank's requests

    def submit(self, rank: int, prompt: list[int], max_new_tokens: int) -> None:
        """Queue one request on `rank` (SGLang's DP controller picks the rank)."""
        loop = self.loops[rank]
        loop.submit(prompt, max_new_tokens)
        # Scheduler.handle_generate_request's value for a request without logprobs; the
        # sync's token count for the logprob pass relies on it.
        req = loop.scheduler.waiting_queue[-1]
        req.logprob_start_len = -1
        req.rid = f"dp{rank}-{req.rid}"  # SGLang's rids are unique across ranks
        self.submitted[rank].append(req)

    @property
    def busy(self) -> bool:
        """Whether any rank has a request waiting, held or running."""
        return any(loop.busy for loop in self.loops)

    def step(self) -> list[str]:
        """One turn of every rank's event loop, synced; each rank's 'prefill', 'decode',
        'idle' (an idle batch run for the sync) or 'none' (no rank had work)."""
        kinds = [""] * len(self.loops)
        errors: list[BaseException] = []

        def turn(rank: int) -> None:
            self._rank.value = rank
            try:
                kinds[rank] = self.loops[rank].step()
                batch = self.loops[rank].scheduler.last_batch
                if batch is not None and batch.forward_mode.is_idle():
                    kinds[rank] = "idle-batch"
                    self.idle[rank] += 1
            except BaseException as error:  # handed to the caller's thread below
                errors.append(error)
                self._barrier.abort()

        with self._exchange():
            threads = [threading.Thread(target=turn, args=(r,)) for r in range(len(self.loops))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        self._barrier.reset()
        if errors:
            raise errors[0]
        return kinds

    @contextlib.contextmanager
    def _exchange(self) -> Iterator[None]:
        from sglang.srt.managers.scheduler_components import dp_attn
        from sglang.srt.runtime_context import get_parallel

        ranks = len(self.loops)
        group = SimpleNamespace(
            device_group=None,
            cpu_group=None,
            device="cpu",
            active_ranks=torch.ones(ranks, dtype=torch.int32),
            active_ranks_cpu=torch.ones(ranks, dtype=torch.int32),
        )

        def exchange(global_flat: torch.Tensor, local_row: torch.Tensor, group: Any) -> None:
            # exchange_sync_rows' contract: every rank's row, in rank order.
            self._rows[self._rank.value] = local_row.clone()
            self._barrier.wait()
            global_flat.copy_(torch.cat(self._rows).to(global_flat.dtype))
            self._barrier.wait()  # no rank writes its next row before all have read

        original = dp_attn.exchange_sync_rows
        dp_attn.exchange_sync_rows = exchange
        parallel = get_parallel()
        try:
            with parallel.override(tp_group=group):
                yield
        finally:
            dp_attn.exchange_sync_rows = original
