"""SGLang's EAGLE bookkeeping (spec v2) driven on CPU with a fake draft worker.

The scheduler side is SGLang's: batches are made with `SpeculativeAlgorithm.EAGLE`,
each carries an `EagleDraftInput` that `filter_batch` / `merge_batch` reshape,
`prepare_for_decode` runs `eagle_prepare_for_decode` (which reserves KV for the next
verify window, `get_alloc_reserve_per_decode` tokens past the committed length) and
`release_kv_cache` frees the reserve past what the request committed. The model side
is fake: a draft proposes `speculative_num_draft_tokens` tokens per row, a seeded
number of them is accepted (plus the target's bonus token), and the verify commits
them as SGLang's v2 worker and result processing do (`seq_lens += accept_lens`,
`kv_committed_len += accepted`, the tokens appended to `output_ids`).

Not run: the draft and target forwards and what they need (`ForwardBatch.init_new`
with a model runner, the tree-mask and verify kernels, `eagle_prepare_for_verify`).
`eagle_prepare_for_decode` writes the reserved slots into `req_to_token` with
`assign_req_to_token_pool_func`, a Triton kernel on GPU and an `sgl_kernel` C++ op on
CPU builds, neither of which is installed here: `SpecDriver` puts in its place the
same row write done with torch indexing (`write_reserved_rows`, inside `cpu_kernels()`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from batchstate.sglang.drive import Driver


def write_reserved_rows(  # noqa: PLR0917  # assign_req_to_token_pool_func's signature
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """`assign_req_to_token_pool_func`'s contract in torch: row `i` of `req_to_token`
    gets, at `[start_offset[i], end_offset[i])`, the next slots of `out_cache_loc`."""
    taken = 0
    for i in range(batch_size):
        start, end = int(start_offset[i]), int(end_offset[i])
        row = int(req_pool_indices[i])
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start].to(
            req_to_token.dtype
        )
        taken += end - start


@contextlib.contextmanager
def cpu_kernels() -> Iterator[None]:
    """SGLang's `assign_req_to_token_pool_func` replaced by `write_reserved_rows` inside
    the block (restored on exit): the one kernel the spec bookkeeping launches."""
    from sglang.srt.mem_cache import allocation

    original = allocation.assign_req_to_token_pool_func
    allocation.assign_req_to_token_pool_func = write_reserved_rows
    try:
        yield
    finally:
        allocation.assign_req_to_token_pool_func = original


class SpecDriver(Driver):
    """The `Driver`'s pools, cache and admission, with EAGLE batches and a fake draft.

    Requires an active `cpu_topology(speculative_algorithm="EAGLE", ...)` and, while it
    steps, `cpu_kernels()`.
    `accept`: the highest number of draft tokens a verify accepts (seeded, 0 to it).
    """

    def __init__(self, *, accept: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        self.draft_tokens = int(spec.speculative_num_draft_tokens)
        self.topk = int(spec.speculative_eagle_topk or 1)
        self.accept = min(accept, self.draft_tokens - 1)
        self.verifies = 0
        self.accepted = 0  # draft tokens accepted over all verifies

    def _batch(self, reqs: list[Any], chunked_req: Any = None) -> Any:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return ScheduleBatch.init_new(
            reqs,
            self.req_to_token_pool,
            self.allocator,
            self.tree_cache,
            self.model_config,
            False,
            SpeculativeAlgorithm.EAGLE,
            chunked_req=chunked_req,
        )

    def _forward(self, batch: Any) -> None:
        if batch.forward_mode.is_extend():
            self._draft_extend(batch)
            super()._forward(batch)
            return
        self._verify(batch)

    def _draft_extend(self, batch: Any) -> None:
        """What the draft's extend leaves on the batch: one draft input row per request."""
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        rows = len(batch.reqs)
        batch.spec_info = EagleDraftInput(
            topk_p=torch.full((rows, self.topk), 1.0 / self.topk),
            topk_index=torch.randint(100, 32000, (rows, self.topk)),
            hidden_states=torch.zeros((rows, 8)),
            bonus_tokens=torch.randint(100, 32000, (rows,), dtype=torch.int32),
        )

    def _verify(self, batch: Any) -> None:
        """A verify of `draft_tokens` per row: a seeded count accepted, plus the bonus."""
        from sglang.srt.mem_cache.common import release_kv_cache

        accept_lens = [self.rng.randint(0, self.accept) + 1 for _ in batch.reqs]
        self.verifies += 1
        lens = torch.tensor(accept_lens, dtype=batch.seq_lens.dtype)
        # The v2 worker: the rows' lengths after this verify (seq_lens + accept_lens).
        batch.seq_lens = batch.seq_lens + lens.to(batch.seq_lens.device)
        batch.seq_lens_cpu = batch.seq_lens_cpu + lens
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        for req, accepted in zip(batch.reqs, accept_lens, strict=True):
            if req.finished() or req.kv.req_pool_idx is None:
                continue
            # Result processing: commit the accepted run, append until the request ends.
            req.kv.kv_committed_len += accepted
            self.accepted += accepted - 1
            for _ in range(accepted):
                req.output_ids.append(self.rng.randrange(100, 32000))
                req.update_finish_state()
                if req.finished():
                    break
            if req.finished():
                release_kv_cache(req, self.tree_cache, checkpoint=True)
                self.finished += 1
