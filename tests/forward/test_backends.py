"""Feeding backends: SDPA against naive attention on the CPU; FlashInfer and FA3 argument forms."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import torch

from batchstate import pad
from batchstate.audit import device_reads
from batchstate.backends import (
    fa3_args,
    flashinfer_decode_plan,
    flashinfer_prefill_plan,
    sdpa_attention,
)
from tests.forward_cases import PHASE_NAMES, build, expected_lens, make_pools_for, make_record

META = torch.device("meta")
HEADS, DIM = 2, 8


def _naive(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    lens: tuple[list[int], list[int], list[int]],
    table: npt.NDArray[np.int32],
) -> torch.Tensor:
    # Per request: keys at its table cells [0, seq), query at position p sees keys <= p.
    (k_cache, v_cache), (slots, prefix, extend_lens) = caches, lens
    out, token = [], 0
    for slot, before, computed in zip(slots, prefix, extend_lens, strict=True):
        locs = torch.from_numpy(table[slot, : before + computed].astype("int64"))
        keys, values = k_cache[locs], v_cache[locs]
        for position in range(before, before + computed):
            scores = torch.einsum("hd,khd->hk", q[token], keys[: position + 1]) / DIM**0.5
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values[: position + 1]))
            token += 1
    return torch.stack(out) if out else q[:0]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("phase", PHASE_NAMES)
def test_sdpa_matches_naive_attention(phase: str, page_size: int) -> None:
    """SDPA fed kv_indptr/kv_indices/qo_indptr equals attention over each request's table row."""
    record, pools = make_record(phase, (1, 3, 17, 40), make_pools_for(page_size))
    inputs = build(record, pools)
    generator = torch.Generator().manual_seed(0)
    shape = (pools.kv_cache_size, HEADS, DIM)
    k_cache = torch.randn(shape, generator=generator, dtype=torch.float64)
    v_cache = torch.randn(shape, generator=generator, dtype=torch.float64)
    q = torch.randn(inputs.num_tokens, HEADS, DIM, generator=generator, dtype=torch.float64)
    got = sdpa_attention(inputs, q, k_cache, v_cache)
    want = _naive(q, (k_cache, v_cache), expected_lens(record, pools), pools.table.host)
    torch.testing.assert_close(got, want)
    # Padded, the real tokens' outputs are the same; padded decode rows read the padding page.
    padded = pad(inputs, [64, 128]).unwrap()
    q_padded = padded.pad_tokens(q)
    again = sdpa_attention(padded.inputs, q_padded, k_cache, v_cache)[: inputs.num_tokens]
    torch.testing.assert_close(again, want)


@pytest.mark.parametrize("phase", PHASE_NAMES)
def test_flashinfer_and_fa3_arguments_have_their_documented_forms(phase: str) -> None:
    """Shapes, int32 dtypes, and placement: host where plan() reads, device where kernels do."""
    record, pools = make_record(phase, (1, 3, 17, 40), make_pools_for(16, META))
    with device_reads(forbid=True) as log:
        inputs = build(record, pools)
        decode, prefill, fa3 = (
            flashinfer_decode_plan(inputs), flashinfer_prefill_plan(inputs), fa3_args(inputs)
        )  # fmt: skip
    assert log.report().count == 0
    n, pages = inputs.num_rows, inputs.num_pages
    forms = {
        "decode.indptr": (decode["indptr"], "cpu", (n + 1,)),
        "decode.indices": (decode["indices"], "meta", (pages,)),
        "decode.last_page_len": (decode["last_page_len"], "cpu", (n,)),
        "prefill.qo_indptr": (prefill["qo_indptr"], "cpu", (n + 1,)),
        "prefill.paged_kv_indptr": (prefill["paged_kv_indptr"], "cpu", (n + 1,)),
        "prefill.paged_kv_indices": (prefill["paged_kv_indices"], "meta", (pages,)),
        "prefill.paged_kv_last_page_len": (prefill["paged_kv_last_page_len"], "cpu", (n,)),
        "fa3.cache_seqlens": (fa3["cache_seqlens"], "meta", (n,)),
        "fa3.cu_seqlens_q": (fa3["cu_seqlens_q"], "meta", (n + 1,)),
    }
    for name, (tensor, device, shape) in forms.items():
        assert (tensor.dtype, tensor.device.type, tuple(tensor.shape)) == (
            torch.int32, device, shape
        ), name  # fmt: skip
    table = fa3["page_table"]
    assert table.dtype == torch.int32 and table.device.type == "meta" and table.dim() == 2
    assert table.shape[0] == n and table.shape[1] * 16 >= inputs.max_kv_len
    assert decode["page_size"] == prefill["page_size"] == 16
    assert fa3["max_seqlen_q"] == inputs.max_q_len
    # The host copies are the mirrors' values, not views a write could reach.
    assert decode["indptr"].tolist() == inputs.kv_indptr.host.tolist()
