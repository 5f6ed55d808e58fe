"""vLLM's real `InputBatch`, kept as a GPU model runner keeps it, on a CPU.

`Worker` owns one vLLM `InputBatch` (pinned memory off, device `cpu`) and applies
each `SchedulerOutput` to it in the order `GPUModelRunner._update_states` does, for
a text-only model without speculative decoding or pipeline parallelism: finished
requests removed, unscheduled ones (preempted, or running but not scheduled) taken
out of the persistent batch, new and resumed requests added, the running ones'
computed tokens and new blocks written into their rows, then `condense()`, the
decode-first reordering (`reorder_batch_to_split_decodes_and_prefills`, which the
FlashInfer and MLA backends apply) and `commit_block_table`, which copies the block
table's CPU tensor to its device copy. Every call on the batch is vLLM's own; the
sequence is batchstate's rendition of the runner's, which needs a GPU to be built.
"""

from __future__ import annotations

from typing import Any


class Worker:
    """A model runner's persistent batch for `scheduler`'s outputs (vLLM's `InputBatch`)."""

    def __init__(self, scheduler: Any, *, reorder: bool = True) -> None:
        import torch
        from vllm.v1 import utils as v1_utils
        from vllm.v1.attention.backends import utils as backend_utils
        from vllm.v1.worker import gpu_input_batch

        config = scheduler.vllm_config
        size = int(scheduler.cache_config.block_size)
        context = int(config.model_config.max_model_len)
        self.reorder = reorder
        # vLLM reads whether to pin from a constant each module imported, true where the
        # platform is unknown (this CPU); there is no pinned allocator here, so it is off
        # in the modules the batch's building and copies read it from, for the process.
        for module in (gpu_input_batch, v1_utils, backend_utils):
            module.PIN_MEMORY = False
        self.batch: Any = gpu_input_batch.InputBatch(
            max_num_reqs=int(config.scheduler_config.max_num_seqs),
            max_model_len=context,
            max_num_batched_tokens=int(config.scheduler_config.max_num_batched_tokens),
            device=torch.device("cpu"),
            vocab_size=int(config.model_config.get_vocab_size()),
            block_sizes=[size],
            max_num_blocks_per_req=[-(-context // size)],
        )
        self.requests: dict[str, Any] = {}

    def update(self, output: Any) -> None:
        """Apply one `SchedulerOutput`, as the runner does before its forward."""
        from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        batch = self.batch
        for rid in output.finished_req_ids:
            self.requests.pop(rid, None)
            batch.remove_request(rid)
        cached = output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for rid in set(batch.req_id_to_index) - (set(output.num_scheduled_tokens) - resumed):
            batch.remove_request(rid)
        adding: list[Any] = []
        for new in output.scheduled_new_reqs:
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                mm_features=[],
                sampling_params=new.sampling_params,
                generator=None,
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
            )
            self.requests[new.req_id] = state
            adding.append(state)
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            computed = cached.num_computed_tokens[i]
            blocks = cached.new_block_ids[i]
            index = batch.req_id_to_index.get(rid)
            state.num_computed_tokens = computed
            if rid in resumed:
                state.block_ids = tuple(list(ids) for ids in blocks)
            elif blocks is not None:
                for held, more in zip(state.block_ids, blocks, strict=True):
                    held.extend(more)
            if index is None:
                outputs = cached.num_output_tokens[i]
                if outputs and rid in cached.all_token_ids:
                    state.output_token_ids = list(cached.all_token_ids[rid][-outputs:])
                adding.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = computed
            if blocks is not None:
                batch.block_table.append_row(blocks, index)
        for state in adding:
            batch.add_request(state)
        batch.condense()
        if self.reorder:
            reorder_batch_to_split_decodes_and_prefills(batch, output, decode_threshold=1)
        batch.refresh_metadata()
        batch.block_table.commit_block_table(batch.num_reqs)

    def sampled(self, model_output: Any) -> None:
        """Append each request's sampled tokens, as the runner's bookkeeping does."""
        batch = self.batch
        for rid, tokens in zip(model_output.req_ids, model_output.sampled_token_ids, strict=True):
            index = batch.req_id_to_index.get(rid)
            state = self.requests.get(rid)
            if not tokens or index is None or state is None:
                continue
            end = int(batch.num_tokens_no_spec[index])
            batch.token_ids_cpu[index, end : end + len(tokens)] = tokens
            batch.num_tokens_no_spec[index] = end + len(tokens)
            state.output_token_ids.extend(tokens)
