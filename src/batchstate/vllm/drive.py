"""vLLM v1's real scheduler on a CPU, built as vLLM's own tests build it, and a fake runner.

`make_scheduler` makes a `Scheduler` (or, `async_scheduling=True`, the
production default `AsyncScheduler`) from a `VllmConfig` with prefix caching
and chunked prefill on, a `KVCacheConfig` with one full-attention group and a
tiny model config written to disk (no weights: the scheduler reads only its
shape). `fake_output` is the `ModelRunnerOutput` a model runner would return
for a `SchedulerOutput`: one sampled token per request whose prefill is done.
Neither needs a GPU: `DeviceConfig(device="cpu")` tells vLLM where it runs.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}
"""The model config `make_scheduler` writes: a Llama of one layer, never loaded."""


@attrs.frozen
class SchedulerShape:
    """How `make_scheduler` sizes vLLM: blocks of `block_size` tokens (`num_blocks`
    counts vLLM's reserved null block), at most `max_num_seqs` running requests and
    `max_num_batched_tokens` tokens a step."""

    num_blocks: int = 1000
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 2048
    async_scheduling: bool = False


def tiny_model_dir() -> Path:
    """A directory holding `TINY_MODEL` as config.json (made once per process)."""
    global _MODEL_DIR  # noqa: PLW0603  # one directory a process, made on first use
    if _MODEL_DIR is None:
        path = Path(tempfile.mkdtemp(prefix="batchstate-vllm-model-"))
        (path / "config.json").write_text(json.dumps(TINY_MODEL))
        _MODEL_DIR = path
    return _MODEL_DIR


_MODEL_DIR: Path | None = None


def make_scheduler(shape: SchedulerShape = SchedulerShape()) -> Any:  # frozen
    """vLLM's real v1 `Scheduler` (or `AsyncScheduler`), sized by `shape`, on the CPU."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_config = SchedulerConfig(
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        max_model_len=shape.max_model_len,
        enable_chunked_prefill=True,
        async_scheduling=shape.async_scheduling,
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(
        model=str(tiny_model_dir()),
        dtype="float32",
        seed=42,
        skip_tokenizer_init=True,
        max_model_len=shape.max_model_len,
    )
    cache_config = CacheConfig(
        block_size=shape.block_size, enable_prefix_caching=True, cache_dtype="auto"
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=shape.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=shape.block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    cache_config.num_gpu_blocks = shape.num_blocks
    kind = AsyncScheduler if shape.async_scheduling else Scheduler
    return kind(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=shape.block_size,
    )


def make_request(rid: str, prompt: list[int], max_tokens: int, block_size: int = 16) -> Any:
    """A vLLM `Request` for `prompt` that stops after `max_tokens` tokens, its blocks
    hashed as the engine hashes them (sha256 of each block and its parent's hash)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _HASHED  # noqa: PLW0603  # vLLM's seed for the first block's parent, once
    if not _HASHED:
        init_none_hash(sha256)
        _HASHED = True
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


_HASHED = False


def fake_output(scheduler: Any, output: Any, rng: random.Random) -> Any:
    """The `ModelRunnerOutput` a model runner returns for `output`, made right after
    `schedule()`: one sampled token (in [1, 1000)) for each request whose scheduled
    tokens reach its end, none for a prefill chunk that stops short of it."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(output.num_scheduled_tokens)
    sampled = [
        [rng.randrange(1, 1000)]
        if scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_tokens
        else []
        for rid in ids
    ]
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=sampled,
    )


@attrs.frozen
class Driven:
    """What `drive` did: scheduler steps run, requests added, requests aborted, and the
    requests that vLLM preempted (counted each time)."""

    steps: int
    added: int
    aborted: int
    preempted: int


def drive(
    scheduler: Any,
    steps: int,
    seed: int = 0,
    *,
    abort_rate: float = 0.03,
    on_schedule: Callable[[Any], None] | None = None,
    on_output: Callable[[Any], None] | None = None,
) -> Driven:
    """Run `steps` scheduler steps on a random workload, with the fake runner.

    Each step a request arrives with probability 1/2: up to 40 tokens of one of three
    shared prompts (so prefixes hit), then 1 to 60 tokens of its own, asking for 1 to
    40 tokens; with probability `abort_rate` a known request is aborted. The sync
    scheduler gets each step's output before the next step; the async one a step
    later, as vLLM's engine core runs it (two batches in flight). `on_schedule` gets
    each `SchedulerOutput` as the model runner would; `on_output` each fake
    `ModelRunnerOutput` as it is handed back.
    """
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    size = int(scheduler.cache_config.block_size)
    shared = [[rng.randrange(1, 1000) for _ in range(40)] for _ in range(3)]
    in_flight = 2 if scheduler.vllm_config.scheduler_config.async_scheduling else 1
    pending: list[tuple[Any, Any]] = []
    added = aborted = preempted = 0
    for _ in range(steps):
        if rng.random() < 0.5:
            prompt = rng.choice(shared)[: rng.randrange(0, 41)]
            prompt += [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 61))]
            request = make_request(f"r{added}", prompt, rng.randrange(1, 41), size)
            scheduler.add_request(request)
            added += 1
        if scheduler.requests and rng.random() < abort_rate:
            scheduler.finish_requests(
                rng.choice(sorted(scheduler.requests)), RequestStatus.FINISHED_ABORTED
            )
            aborted += 1
        output = scheduler.schedule()
        preempted += len(output.preempted_req_ids or ())
        if on_schedule is not None:
            on_schedule(output)
        pending.append((output, fake_output(scheduler, output, rng)))
        if len(pending) == in_flight:
            _hand_back(scheduler, *pending.pop(0), on_output)
    for done in pending:
        _hand_back(scheduler, *done, on_output)
    return Driven(steps, added, aborted, preempted)


def _hand_back(
    scheduler: Any, output: Any, model_output: Any, on_output: Callable[[Any], None] | None
) -> None:
    if on_output is not None:
        on_output(model_output)
    scheduler.update_from_output(output, model_output)
