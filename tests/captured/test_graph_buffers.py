"""fill: a step's forward written into one bucket's buffers, allocated once, read nowhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from benchmarks.counting import count_allocations, count_device_work
from returns.result import Failure

from batchstate import (
    SGLANG_PAD_VALUES,
    VLLM_PAD_VALUES,
    DoesNotFit,
    Extended,
    Filtered,
    ForwardInputs,
    GraphBuffers,
    GraphBuffersError,
    NoColumns,
    PaddingError,
    Req,
    decode,
    extend,
    fill_buffers,
    forward_inputs,
    idle,
    make_pools,
    pad,
    split,
    unpad,
    unpad_tokens,
    verify,
)
from batchstate.audit import device_reads
from batchstate.backends import sdpa_attention
from batchstate.captured.padding import PADDED_FIELDS
from tests.forward_cases import PHASE_NAMES, build, fill_record, make_pools_for, make_record

CPU = torch.device("cpu")
META = torch.device("meta")
_LENGTHS = (1, 3, 17, 40)


def _bucket_for(inputs: ForwardInputs, fills: dict[str, int] | None = None) -> GraphBuffers:
    # Two rows and a few tokens more than the forward: room for padded rows of either fill.
    return GraphBuffers.allocate(
        inputs.device,
        inputs.page_size,
        rows=inputs.num_rows + 2,
        tokens=inputs.num_tokens + 5,
        max_pages=max(inputs.page_table.device.shape[1], 1) + 1,
        fills=fills,
    )


def _buffer_ptrs(buffers: GraphBuffers) -> list[int]:
    tensors = (buffers.block, buffers.kv_indices, buffers.page_table, buffers.out_cache_loc)
    return [tensor.data_ptr() for tensor in tensors]


@pytest.mark.parametrize("fills", [SGLANG_PAD_VALUES, VLLM_PAD_VALUES], ids=["sglang", "vllm"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("phase", PHASE_NAMES)
def test_filled_buffers_hold_the_padded_forward(
    phase: str, page_size: int, fills: dict[str, int]
) -> None:
    """Real rows and tokens as `forward_inputs` made them, padded rows by the fills, each
    mirrored field's device side (a view of the block) equal to its host side."""
    record, pools = make_record(phase, _LENGTHS, make_pools_for(page_size))
    inputs = build(record, pools)
    buffers = _bucket_for(inputs, fills)
    padded = fill_record(buffers, record, pools).unwrap()
    out = padded.inputs
    n, t = inputs.num_rows, inputs.num_tokens
    assert (out.num_rows, out.num_tokens) == (buffers.rows, buffers.tokens)
    assert (padded.num_real_rows, padded.num_real_tokens) == (n, t)
    for name, view in zip(PADDED_FIELDS, buffers.fields, strict=True):
        pair = getattr(out, name)
        assert pair.device.data_ptr() == view.data_ptr(), name
        assert pair.device.tolist() == pair.host.tolist(), name
        before = getattr(inputs, name).host.tolist()
        assert pair.host[: len(before)].tolist() == before, name
    for name in ("req_pool_indices", "seq_lens", "extend_lens"):
        assert getattr(out, name).host[n:].tolist() == [fills[name]] * (buffers.rows - n)
    assert out.seq_lens_sum == int(out.seq_lens.host.sum())
    assert int(out.qo_indptr.host[-1]) <= buffers.tokens
    # The device fields: the batch's pages at the left of each real row, padded cells filled.
    width = inputs.page_table.device.shape[1]
    assert torch.equal(out.page_table.device[:n, :width], inputs.page_table.device)
    assert out.kv_indices.device[: inputs.num_pages].tolist() == inputs.kv_indices.device.tolist()
    assert out.kv_indices.device[inputs.num_pages :].tolist() == [fills["kv_indices"]] * (
        out.num_pages - inputs.num_pages
    )
    assert out.out_cache_loc.device[:t].tolist() == inputs.out_cache_loc.device.tolist()
    assert out.out_cache_loc.device[t:].tolist() == [fills["out_cache_loc"]] * (buffers.tokens - t)
    assert tuple(out.page_table.device.shape) == (buffers.rows, buffers.max_pages)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_decode_bucket_equals_pad_at_that_size(page_size: int) -> None:
    """A decode bucket of 8 rows holds what `pad(inputs, [8])` makes, field for field."""
    record, pools = make_record("decoding", _LENGTHS, make_pools_for(page_size))
    inputs = build(record, pools)
    width = inputs.page_table.device.shape[1]
    buffers = GraphBuffers.for_decode(CPU, page_size, 8, width)
    filled = fill_record(buffers, record, pools).unwrap().inputs
    padded = pad(inputs, [8]).unwrap().inputs
    for name in PADDED_FIELDS:
        assert getattr(filled, name).host.tolist() == getattr(padded, name).host.tolist(), name
    for name in ("num_rows", "num_tokens", "seq_lens_sum", "max_q_len", "num_pages"):
        assert getattr(filled, name) == getattr(padded, name), name
    assert filled.kv_indices.device.tolist() == padded.kv_indices.device.tolist()
    assert torch.equal(filled.page_table.device[:, :width], padded.page_table.device[:, :width])


@pytest.mark.parametrize("device", [CPU, META], ids=["cpu", "meta"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_steps_write_the_same_addresses_and_allocate_nothing(
    device: torch.device, page_size: int
) -> None:
    """Twenty decode steps of 5 to 1 rows, each filled into the one bucket: no allocation (by
    each op's schema), the same addresses, no device read; on meta, one host-to-device copy."""
    pools = make_pools(8, 256, 4096, device, page_size)
    reqs = [Req(rid, tuple(range(1, 20 + 9 * rid))) for rid in range(5)]
    extended, pools = extend(idle(device), reqs, pools).unwrap()
    batch: Extended[NoColumns] | Filtered[NoColumns] = extended
    buffers = GraphBuffers.for_decode(device, page_size, 8, -(-256 // page_size))
    ptrs = _buffer_ptrs(buffers)
    for step in range(20):
        decoding, pools = decode(batch, pools).unwrap()
        with device_reads(forbid=True), count_allocations() as made, count_device_work() as work:
            padded = fill_buffers(buffers, decoding, pools.table).unwrap()
        assert made == []
        if device == META:  # on the CPU every op is host work: meta tells copies from kernels
            assert work.copies == 1
            assert work.kernels <= 6  # three device copies, three fills of padded cells
        assert _buffer_ptrs(buffers) == ptrs
        assert padded.inputs.page_table.device.data_ptr() == ptrs[2]
        rows = len(decoding.rows)
        keep = list(range(rows - 1)) if step % 4 == 3 and rows > 1 else list(range(rows))
        batch, _ = split(decoding, keep)
    assert len(batch.rows) < 5


def test_verify_windows_pad_per_batch_size() -> None:
    """A verify bucket of 4 rows and 3 drafts a row holds windows of 1 to 4 rows with ragged
    drafts: real tokens first, one token per padded row, the rest in no row."""
    buffers = GraphBuffers.for_verify(CPU, 16, 4, 3, 8)
    assert buffers.tokens == 16
    for rows in (1, 2, 4):
        pools = make_pools(8, 128, 2048, CPU, 16)
        reqs = [Req(rid, tuple(range(1, 10 + 5 * rid))) for rid in range(rows)]
        batch, pools = extend(idle(CPU), reqs, pools).unwrap()
        one, pools = decode(batch, pools).unwrap()
        drafts = [(row * 2) % 4 for row in range(rows)]
        window, held = verify(one, drafts, pools).unwrap()
        inputs = forward_inputs(window, held.table, 16, slot_tokens=held.slot_tokens)
        padded = fill_buffers(buffers, window, held.table, slot_tokens=held.slot_tokens).unwrap()
        assert padded.inputs.cu_seqlens_k.host.tolist() == [
            *inputs.cu_seqlens_k.host.tolist(),
            *(int(inputs.cu_seqlens_k.host[-1]) + step for step in range(1, 5 - rows)),
        ]
        out = padded.inputs
        real = rows + sum(drafts)
        assert (out.num_rows, out.num_tokens, padded.num_real_tokens) == (4, 16, real)
        assert out.extend_lens.host.tolist() == [d + 1 for d in drafts] + [1] * (4 - rows)
        assert int(out.qo_indptr.host[-1]) == real + 4 - rows
        logits = padded.wrap(torch.arange(16.0)[:, None])
        assert unpad_tokens(logits)[:, 0].tolist() == list(range(real))
        assert unpad(logits)[:, 0].tolist() == [
            float(stop - 1) for stop in np.cumsum([d + 1 for d in drafts])
        ]


def test_attention_over_the_buffers_equals_the_unpadded_forward() -> None:
    """SDPA fed the filled buffers gives each real token the output it gets unpadded."""
    record, pools = make_record("mixed", _LENGTHS, make_pools_for(16))
    inputs = build(record, pools)
    padded = fill_record(_bucket_for(inputs), record, pools).unwrap()
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(pools.kv_cache_size, 2, 8, generator=generator)
    v = torch.randn(pools.kv_cache_size, 2, 8, generator=generator)
    q = torch.randn(inputs.num_tokens, 2, 8, generator=generator)
    eager = sdpa_attention(inputs, q, k, v)
    q_padded = padded.pad_tokens(q)
    replayed = unpad_tokens(padded.run(lambda fi: sdpa_attention(fi, q_padded, k, v)))
    assert torch.allclose(replayed, eager)


def test_a_forward_the_bucket_cannot_hold_is_a_failure_and_writes_nothing() -> None:
    """Each size the bucket fixes, exceeded alone: `DoesNotFit` naming it, the buffers as
    they were."""
    record, pools = make_record("extended", _LENGTHS, make_pools_for(1))
    inputs = build(record, pools)
    n, t, width = inputs.num_rows, inputs.num_tokens, inputs.page_table.device.shape[1]
    fits: dict[str, Any] = {"rows": n, "tokens": t, "max_pages": width}
    fits["kv_capacity"] = inputs.num_pages
    cases = {
        "rows": (dict(fits, rows=n - 1), n),
        "tokens": (dict(fits, tokens=t - 1), t),
        "pages per row": (dict(fits, max_pages=width - 1), width),
        "kv pages": (dict(fits, kv_capacity=inputs.num_pages - 1), inputs.num_pages),
    }
    for what, (sizes, needed) in cases.items():
        buffers = GraphBuffers.allocate(CPU, 1, **sizes)
        before = [tensor.clone() for tensor in (buffers.block, buffers.page_table)]
        assert fill_record(buffers, record, pools) == Failure(DoesNotFit(what, needed, needed - 1))
        assert all(
            torch.equal(a, b)
            for a, b in zip(before, (buffers.block, buffers.page_table), strict=True)
        )
    # Padded rows need their tokens too: 4 rows of one token into 4 tokens with one real row
    # of 3 tokens needs 6.
    small = GraphBuffers.allocate(CPU, 1, rows=n + 2, tokens=t, max_pages=width)
    assert fill_record(small, record, pools) == (Failure(DoesNotFit("tokens", t + 2, t)))
    fitted = fill_record(GraphBuffers.allocate(CPU, 1, **fits), record, pools).unwrap()
    assert fitted.padded_rows == 0


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ({"rows": 0, "tokens": 4, "max_pages": 4}, "rows must be an int >= 1"),
        ({"rows": 4, "tokens": 3, "max_pages": 4}, "3 tokens cannot hold 4 padded rows"),
        ({"rows": 4, "tokens": 4, "max_pages": 0}, "max_pages must be an int >= 1"),
        ({"rows": 4, "tokens": 4, "max_pages": 4, "kv_capacity": -1}, "kv_capacity"),
        ({"rows": True, "tokens": 4, "max_pages": 4}, "rows must be an int"),
    ],
)
def test_bad_buckets_are_refused(sizes: dict[str, Any], match: str) -> None:
    """Sizes below their minimum or of the wrong type: `GraphBuffersError`."""
    with pytest.raises(GraphBuffersError, match=match):
        GraphBuffers.allocate(CPU, 1, **sizes)
    with pytest.raises(PaddingError):
        GraphBuffers.allocate(CPU, 1, rows=1, tokens=1, max_pages=1, fills={"seq_lens": 1})
    with pytest.raises(GraphBuffersError, match="max_drafts"):
        GraphBuffers.for_verify(CPU, 1, 4, -1, 4)


def test_inputs_of_another_page_size_or_device_are_refused() -> None:
    """The buffers' page size and device are the graph's: other inputs raise, nothing written."""
    record, pools = make_record("decoding", _LENGTHS, make_pools_for(16))
    with pytest.raises(GraphBuffersError, match="pages of 16"):
        fill_record(GraphBuffers.for_decode(CPU, 1, 8, 400), record, pools)
    with pytest.raises(GraphBuffersError, match="meta"):
        fill_record(GraphBuffers.for_decode(META, 16, 8, 25), record, pools)


def test_fills_outside_the_table_or_the_cache_are_refused() -> None:
    """A bucket whose fills name a slot or a page the record's pools do not have: the fill
    raises `PaddingError`, as `pad` does, and the buffers stay as they were."""
    record, pools = make_record("decoding", _LENGTHS, make_pools_for(16))
    for name, value in (("req_pool_indices", 17), ("kv_indices", 64 * 96 // 16 + 1)):
        fills = dict(SGLANG_PAD_VALUES, **{name: value})
        buffers = GraphBuffers.for_decode(CPU, 16, 8, 25, fills=fills)
        before = buffers.block.clone()
        with pytest.raises(PaddingError, match=name):
            fill_record(buffers, record, pools)
        assert torch.equal(buffers.block, before)
