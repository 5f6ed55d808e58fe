"""With captured sizes, the engine's model reads one `GraphBuffers` per bucket, every step."""

from __future__ import annotations

from typing import Any, Final

import pytest
import torch
from benchmarks.counting import count_allocations

import batchstate.engine._paged as paged
from batchstate import Decoding, Extended, ForwardInputs, GraphBuffers, Mixed, Padded, Pools
from batchstate.audit import device_reads
from batchstate.engine import EngineConfig, Feeder, SimulationConfig, WorkloadConfig, simulate
from batchstate.engine._report import summarize

SIZES: Final = (1, 2, 4, 8, 16, 32, 64)
# A few hundred steps: requests keep arriving while others decode.
WORKLOAD: Final = WorkloadConfig(
    num_requests=48, arrival_rate=0.25, prompt_len=(4, 48), output_len=(8, 40)
)
# Each mode pads decode forwards (by rows) and extend or mixed ones (by tokens).
MODES: Final = {
    "whole-prompts": (EngineConfig(max_running=12), 16),
    "mixed-chunks": (EngineConfig(max_running=12, chunk_size=16, mixed=True), 1),
}


def _ptrs(inputs: ForwardInputs, input_ids: torch.Tensor) -> tuple[int, ...]:
    # Every device tensor the paged attention and `unpad` read, then the model's input ids.
    sides = (
        inputs.qo_indptr,
        inputs.kv_indptr,
        inputs.kv_last_page_len,
        inputs.positions,
        inputs.sample_index,
        inputs.kv_indices,
        inputs.out_cache_loc,
    )
    return (*(side.device.data_ptr() for side in sides), input_ids.data_ptr())


def _inside(ptr: int, tensor: torch.Tensor) -> bool:
    start = tensor.data_ptr()
    return start <= ptr < start + tensor.numel() * tensor.element_size()


def _count_buffers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every `GraphBuffers` allocated from now on, as (rows, tokens)."""
    made: list[tuple[int, int]] = []
    real = GraphBuffers.allocate.__func__  # type: ignore[attr-defined]  # the classmethod's

    def counted(cls: type[GraphBuffers], *args: Any, **kwargs: Any) -> GraphBuffers:
        buffers: GraphBuffers = real(cls, *args, **kwargs)
        made.append((buffers.rows, buffers.tokens))
        return buffers

    monkeypatch.setattr(GraphBuffers, "allocate", classmethod(counted))
    return made


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_model_reads_the_same_buffers_every_step(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole CPU run: every padded forward the model runs reads its bucket's buffers and
    input ids, at the same addresses every step; one `GraphBuffers` per bucket used, and
    the oracle exact."""
    reads: list[tuple[int, int, tuple[int, ...]]] = []
    forward = paged._forward

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        inputs = args[2]
        reads.append((inputs.num_rows, inputs.num_tokens, _ptrs(inputs, args[4])))  # the ids
        return forward(*args, **kwargs)

    monkeypatch.setattr(paged, "_forward", recording)
    made = _count_buffers(monkeypatch)
    engine, page_size = MODES[mode]
    config = SimulationConfig(
        workload=WORKLOAD, engine=engine, page_size=page_size, cuda_graph_sizes=SIZES
    )
    run = simulate(config)
    assert run.oracle is not None and run.oracle.passed, run.oracle
    assert len(run.trace) >= 200
    feeder = run.feeder
    assert feeder is not None
    buckets = feeder.buckets.buffers
    # One allocation per bucket, each on the bucket's first forward; never again.
    assert sorted(made) == sorted(buckets)
    assert all(tokens in SIZES for _, tokens in buckets)
    # A forward read its bucket if it wrote KV through the bucket's `out_cache_loc` (eager
    # ones, and the warm-up's before the run, read fresh tensors).
    bucketed = [
        (rows, tokens, ptrs)
        for rows, tokens, ptrs in reads
        if (rows, tokens) in buckets and ptrs[6] == buckets[rows, tokens].out_cache_loc.data_ptr()
    ]
    assert len(bucketed) == feeder.padded_forwards >= 200
    assert {(rows, tokens) for rows, tokens, _ in bucketed} == set(buckets)
    for (rows, tokens), buffers in buckets.items():
        seen = {ptrs for r, t, ptrs in bucketed if (r, t) == (rows, tokens)}
        assert len(seen) == 1, (rows, tokens)  # the same addresses at every step
        (ptrs,) = seen
        assert all(_inside(ptr, buffers.block) for ptr in ptrs[:5])
        assert ptrs[5:] == (
            buffers.kv_indices.data_ptr(),
            buffers.out_cache_loc.data_ptr(),
            feeder.buckets.input_ids[rows, tokens].data_ptr(),
        )
    # The tensors read by every padded forward of the run: eight per bucket.
    assert len({ptr for _, _, ptrs in bucketed for ptr in ptrs}) == 8 * len(buckets)
    assert len(buckets) < feeder.padded_forwards // 10


def test_on_meta_a_bucket_is_filled_with_no_allocation_and_no_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A whole meta run: every forward that lands in an existing bucket allocates no tensor
    (by each aten op's schema) and reads nothing from the device (a forbidding audit)."""
    inputs = Feeder.inputs
    steps: list[tuple[bool, bool, list[str]]] = []  # (padded, new bucket, allocations)

    def audited(
        self: Feeder, batch: Extended[Any] | Decoding[Any] | Mixed[Any], pools: Pools
    ) -> ForwardInputs | Padded:
        before = len(self.buckets.buffers)
        with device_reads(forbid=True), count_allocations() as allocations:
            fed = inputs(self, batch, pools)
        new = len(self.buckets.buffers) > before
        steps.append((isinstance(fed, Padded), new, allocations))
        return fed

    monkeypatch.setattr(Feeder, "inputs", audited)
    made = _count_buffers(monkeypatch)
    config = SimulationConfig(
        workload=WORKLOAD,
        engine=EngineConfig(max_running=12, chunk_size=16, mixed=True, audit_every=1),
        device="meta",
        cuda_graph_sizes=SIZES,
    )
    run = simulate(config)
    assert summarize(run).ok
    feeder = run.feeder
    assert feeder is not None and len(made) == len(feeder.buckets.buffers)
    reused = [allocations for padded, new, allocations in steps if padded and not new]
    assert len(reused) >= 200
    assert all(allocations == [] for allocations in reused)
    assert sum(new for _, new, _ in steps) == len(made)
