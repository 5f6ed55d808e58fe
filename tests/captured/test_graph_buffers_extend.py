"""Extend and mixed buckets: prefills of changing sizes written into one bucket, allocated once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from benchmarks.counting import count_allocations, count_device_work

from batchstate import (
    Extended,
    GraphBuffers,
    Mixed,
    Req,
    extend,
    fill_buffers,
    forward_inputs,
    idle,
    make_pools,
    unpad,
    unpad_tokens,
)
from batchstate.audit import device_reads
from tests.forward_cases import make_pools_for, make_record

CPU = torch.device("cpu")
META = torch.device("meta")
# Per step, the prompts admitted together: 1 to 4 rows, 1 to 60 tokens each.
_STEPS = ((60,), (3, 17, 1), (16, 16, 16, 12), (1,), (40, 9), (33, 5, 15, 2))


def _addresses(buffers: GraphBuffers) -> list[int]:
    tensors = (buffers.block, buffers.kv_indices, buffers.page_table, buffers.out_cache_loc)
    return [tensor.data_ptr() for tensor in tensors]


@pytest.mark.parametrize("device", [CPU, META], ids=["cpu", "meta"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefills_write_the_same_addresses_and_allocate_nothing(
    device: torch.device, page_size: int
) -> None:
    """Six prefills of 1 to 4 rows and 1 to 64 tokens, each filled into one bucket of 4 rows
    and 64 tokens: no allocation, the same addresses, no device read, one upload; the page
    table as wide as the bucket's longest prompt, not the table's 1024 tokens."""
    max_pages = -(-64 // page_size)
    buffers = GraphBuffers.for_extend(device, page_size, rows=4, tokens=64, max_pages=max_pages)
    addresses = _addresses(buffers)
    for prompts in _STEPS:
        pools = make_pools(8, 1024, 4096, device, page_size)
        reqs = [Req(rid, tuple(range(1, 1 + length))) for rid, length in enumerate(prompts)]
        extended, pools = extend(idle(device), reqs, pools).unwrap()
        with device_reads(forbid=True), count_allocations() as made, count_device_work() as work:
            padded = fill_buffers(buffers, extended, pools.table).unwrap()
        assert made == []
        if device == META:
            assert (work.copies, work.kernels <= 6) == (1, True)
        assert _addresses(buffers) == addresses
        out = padded.inputs
        assert (out.num_rows, out.num_tokens) == (4, 64)
        assert (padded.num_real_rows, padded.num_real_tokens) == (len(prompts), sum(prompts))
        assert tuple(out.page_table.device.shape) == (4, max_pages)
        assert out.table_pages == -(-1024 // page_size)


@pytest.mark.parametrize("phase", ["extended", "mixed"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_an_extend_bucket_holds_the_forward_and_unpads_each_rows_last_token(
    phase: str, page_size: int
) -> None:
    """Real rows as `forward_inputs` made them, then padded rows of one query token, then
    tokens in no row; `unpad` takes each real row's last token, `unpad_tokens` the real ones."""
    record, pools = make_record(phase, (1, 3, 17, 40), make_pools_for(page_size))
    assert isinstance(record, Extended | Mixed)
    inputs = forward_inputs(record, pools.table, page_size)
    n, t = inputs.num_rows, inputs.num_tokens
    width = inputs.page_table.device.shape[1]
    buffers = GraphBuffers.for_extend(CPU, page_size, rows=n + 2, tokens=t + 9, max_pages=width)
    padded = fill_buffers(buffers, record, pools.table).unwrap()
    out = padded.inputs
    for name in ("positions", "seq_lens", "prefix_lens", "extend_lens", "cu_seqlens_k"):
        real = getattr(inputs, name).host.tolist()
        assert getattr(out, name).host[: len(real)].tolist() == real, name
        assert getattr(out, name).device.tolist() == getattr(out, name).host.tolist(), name
    assert out.extend_lens.host[n:].tolist() == [1, 1]
    assert int(out.qo_indptr.host[-1]) == t + 2  # the last 7 tokens belong to no row
    assert torch.equal(out.page_table.device[:n, :width], inputs.page_table.device)
    real_pages = inputs.num_pages
    assert out.kv_indices.device[:real_pages].tolist() == inputs.kv_indices.device.tolist()
    assert out.out_cache_loc.device[:t].tolist() == inputs.out_cache_loc.device.tolist()
    logits = padded.wrap(torch.arange(float(t + 9))[:, None])
    lasts = np.cumsum(inputs.extend_lens.host) - 1
    assert unpad(logits)[:, 0].tolist() == lasts.astype(float).tolist()
    assert unpad_tokens(logits)[:, 0].tolist() == [float(token) for token in range(t)]
