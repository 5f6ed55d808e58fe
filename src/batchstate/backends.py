"""Feeding attention backends from `ForwardInputs`: FlashInfer, FA3, and torch's SDPA.

Nothing here imports FlashInfer or FA3: the functions return the arguments
their documented signatures take, with host values where a backend plans
on the host (FlashInfer's `plan()` reads `indptr` and `last_page_len` on
the host: handed host tensors, it makes no device read), and device tensors
where its kernel reads them. `sdpa_attention` runs the same paged layout
through `torch.nn.functional.scaled_dot_product_attention`, on any device.
See docs/backends.md.
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F  # noqa: N812  # torch's own idiom

from batchstate.base.mirrored import upload
from batchstate.columns.columns import C
from batchstate.forward.inputs import ForwardInputs
from batchstate.memory.token_table import TokenTable
from batchstate.speculative.ahead import WindowAhead

__all__ = [
    "FA3Args",
    "FlashInferDecodePlan",
    "FlashInferPrefillPlan",
    "fa3_ahead_args",
    "fa3_args",
    "flashinfer_decode_plan",
    "flashinfer_prefill_plan",
    "sdpa_attention",
]


class FlashInferDecodePlan(TypedDict):
    """`BatchDecodeWithPagedKVCacheWrapper.plan`'s paged-KV arguments."""

    indptr: torch.Tensor  # host int32 [num_rows + 1]
    indices: torch.Tensor  # device int32 [num_pages]
    last_page_len: torch.Tensor  # host int32 [num_rows]
    page_size: int


class FlashInferPrefillPlan(TypedDict):
    """`BatchPrefillWithPagedKVCacheWrapper.plan`'s layout arguments (pass `causal=True`)."""

    qo_indptr: torch.Tensor  # host int32 [num_rows + 1]
    paged_kv_indptr: torch.Tensor  # host int32 [num_rows + 1]
    paged_kv_indices: torch.Tensor  # device int32 [num_pages]
    paged_kv_last_page_len: torch.Tensor  # host int32 [num_rows]
    page_size: int


class FA3Args(TypedDict):
    """`flash_attn_with_kvcache`'s paged, varlen arguments (pass `causal=True`)."""

    cache_seqlens: torch.Tensor  # device int32 [num_rows]
    page_table: torch.Tensor  # device int32 [num_rows, pages]
    cu_seqlens_q: torch.Tensor  # device int32 [num_rows + 1]
    max_seqlen_q: int


def flashinfer_decode_plan(inputs: ForwardInputs) -> FlashInferDecodePlan:
    """FlashInfer's decode `plan()` arguments: host offsets and lengths, device page ids."""
    return {
        "indptr": _host(inputs.kv_indptr.host),
        "indices": inputs.kv_indices.device,
        "last_page_len": _host(inputs.kv_last_page_len.host),
        "page_size": inputs.page_size,
    }


def flashinfer_prefill_plan(inputs: ForwardInputs) -> FlashInferPrefillPlan:
    """FlashInfer's paged prefill `plan()` arguments (extend, mixed and verify forwards)."""
    return {
        "qo_indptr": _host(inputs.qo_indptr.host),
        "paged_kv_indptr": _host(inputs.kv_indptr.host),
        "paged_kv_indices": inputs.kv_indices.device,
        "paged_kv_last_page_len": _host(inputs.kv_last_page_len.host),
        "page_size": inputs.page_size,
    }


def fa3_args(inputs: ForwardInputs) -> FA3Args:
    """FA3's `flash_attn_with_kvcache` arguments: tensors on the device, the bound a host int."""
    return {
        "cache_seqlens": inputs.seq_lens.device,
        "page_table": inputs.page_table.device,
        "cu_seqlens_q": inputs.qo_indptr.device,
        "max_seqlen_q": inputs.max_q_len,
    }


def fa3_ahead_args(ahead: WindowAhead[C], table: TokenTable, page_size: int) -> FA3Args:
    """FA3's arguments for a window opened ahead of its lengths: the bound sizes the page table.

    FA3 reads each row's length on the device (`cache_seqlens`) and only
    that many of its page-table columns, so an upper bound serves: the
    table is gathered as wide as the longest bound, in pages, and the
    exact lengths come from the device. FlashInfer's `plan()` needs exact
    host offsets and has no such function. One upload (the page starts),
    a gather and, with pages of more than one token, a division; no read.

    Raises:
        BatchConflict: `table` lives on another device than `ahead`.
    """
    table.expect_on(ahead.device)
    width = -(-ahead.seq_lens.max_bound // page_size)
    (starts,) = upload((np.arange(width, dtype=np.int64) * page_size,), ahead.device)
    page_table = table.device[ahead.req_pool_indices.device[:, None], starts[None, :]]
    if page_size > 1:
        page_table = torch.div(page_table, page_size, rounding_mode="floor")
    spans = ahead.draft_lens + 1
    return {
        "cache_seqlens": ahead.seq_lens.device.to(torch.int32),
        "page_table": page_table,
        "cu_seqlens_q": ahead.qo_indptr.device,
        "max_seqlen_q": int(spans.max()) if spans.shape[0] else 0,
    }


def sdpa_attention(
    inputs: ForwardInputs, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> torch.Tensor:
    """Paged causal attention through torch's SDPA, one call per row.

    Row bounds come from the host mirrors; keys from each row's pages on the
    device. Query i of a row sees keys `<= seq_len - q_len + i`, the rule
    FlashInfer and FA3 apply. Tokens past the rows (prefill padding) get zeros.

    Args:
        inputs: the forward's inputs.
        q: `[num_tokens, num_heads, head_dim]`.
        k_cache, v_cache: `[kv_locations, num_heads, head_dim]`, location
            `page * page_size + offset`, this forward's K/V already written.

    Returns:
        `[num_tokens, num_heads, head_dim]`.
    """
    out = torch.zeros_like(q)
    page_size = inputs.page_size
    qo, kv, seq = inputs.qo_indptr.host, inputs.kv_indptr.host, inputs.seq_lens.host
    offsets = torch.arange(page_size, device=q.device)
    for row in range(inputs.num_rows):
        start, stop, kv_len = int(qo[row]), int(qo[row + 1]), int(seq[row])
        if stop == start or not kv_len:
            continue
        pages = inputs.kv_indices.device[int(kv[row]) : int(kv[row + 1])].to(torch.int64)
        locs = (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:kv_len]
        keys, values = k_cache[locs].transpose(0, 1), v_cache[locs].transpose(0, 1)
        queries = q[start:stop].transpose(0, 1)
        q_len = stop - start
        query_at = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= query_at
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        out[start:stop] = attended.transpose(0, 1)
    return out


def _host(array: npt.NDArray[np.int32]) -> torch.Tensor:
    # A CPU tensor of a host mirror: a host copy (the mirror is read-only; torch would warn).
    return torch.from_numpy(array.copy())
