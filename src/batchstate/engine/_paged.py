"""A paged KV cache, and attention that reads it only through the forward's inputs.

Every location the model reads or writes comes from the batch's
`ForwardInputs`, as a paged attention kernel takes them: new K/V go to
`out_cache_loc`, row `i` reads its keys from the pages
`kv_indices[kv_indptr[i]:kv_indptr[i + 1]]` (the last holding
`kv_last_page_len[i]` tokens), queries are laid out by `qo_indptr`, and
rotary angles come from `positions`. A wrong value in any of them changes
the tokens, which is what the oracle catches; padded to a captured size,
the padded rows' outputs are dropped by `unpad` before sampling. A hybrid
model's window and state layers read theirs through `hybrid_inputs` (see
`engine/_hybrid_attend.py`).

Two kernels, as `ModelConfig.attention` picks: `paged` writes each
layer's K/V at `out_cache_loc` and then reads every key through the pages;
`ragged` attends over the step's own K/V and over the prefix read through
the pages, merges the two, and writes last, as SGLang's FlashInfer ragged
path and FlashAttention's varlen path do. The ragged one is exact only if
no cell a row reads as its prefix is one the forward writes: the forward's
contract (docs/design.md), which `check_forward` checks.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from batchstate import (
    Decoding,
    Extended,
    Filtered,
    ForwardInputs,
    HybridInputs,
    Idle,
    Mixed,
    Padded,
    Pools,
    Rows,
    Sampling,
    forward_inputs,
    hybrid_inputs,
    unpad,
)
from batchstate.engine._feeder import Feeder
from batchstate.engine._hybrid_attend import hybrid_attend
from batchstate.engine._kv_cache import KVCache
from batchstate.engine._language_model import LanguageModel
from batchstate.engine._model import Attend, FeedForward
from batchstate.engine._row_grid import RowGrid

__all__ = [
    "forward_idle",
    "sample_decode",
    "sample_extend",
    "sample_mixed",
]


def sample_extend(
    model: LanguageModel,
    cache: KVCache,
    batch: Extended[Any],
    pools: Pools,
    *,
    feed_forward: FeedForward | None = None,
    feeder: Feeder | None = None,
) -> torch.Tensor:
    """Run an extend forward and return each row's next token.

    Writes K/V of every extend token at `batch.out_cache_loc` (mutates `cache`).
    Rows sample with their `Sampling` columns when the batch carries them,
    greedily otherwise. `feed_forward` runs the MLPs (None: the model's `mlp`);
    `feeder` builds the forward's inputs (and pads them; None: unpadded).

    Returns:
        device int64 `[num_reqs]`: the token after each row's last input id.
    """
    inputs = _inputs(feeder, batch, pools)
    hidden = _run(model, cache, inputs, pools, batch.input_ids.device, feed_forward, feeder)
    return model.sample(hidden, _sampling(batch.rows), batch.rows.seq_lens.host)


def sample_decode(  # the forward's own inputs, then the model's
    model: LanguageModel,
    cache: KVCache,
    batch: Decoding[Any],
    pools: Pools,
    input_ids: torch.Tensor,
    *,
    feed_forward: FeedForward | None = None,
    feeder: Feeder | None = None,
) -> torch.Tensor:
    """Run a decode forward of one token per row and return each row's next token.

    Rows sample with their `Sampling` columns when the batch carries them,
    greedily otherwise.

    Args:
        pools: the pools whose table `batch` was decoded against.
        input_ids: device int64 `[num_reqs]`, each row's last sampled token.
        feed_forward: runs the MLPs (None: the model's `mlp`).
        feeder: builds the forward's inputs, and pads them (None: unpadded).

    Returns:
        device int64 `[num_reqs]`. Writes K/V at `batch.out_cache_loc` (mutates `cache`).
    """
    inputs = _inputs(feeder, batch, pools)
    hidden = _run(model, cache, inputs, pools, input_ids, feed_forward, feeder)
    return model.sample(hidden, _sampling(batch.rows), batch.rows.seq_lens.host)


def sample_mixed(  # as above
    model: LanguageModel,
    cache: KVCache,
    batch: Mixed[Sampling],
    pools: Pools,
    sampling: Sampling | None = None,
    *,
    feed_forward: FeedForward | None = None,
    feeder: Feeder | None = None,
) -> torch.Tensor:
    """Run one forward over a mixed batch (chunks, prompts, decode rows) and sample every row.

    `sampling`: the batch's own `Sampling` columns, or None when every row
    is greedy (the argmax path). `feed_forward` runs the MLPs (None:
    the model's `mlp`); `feeder` builds the inputs and pads them (None: unpadded).

    Input ids and KV locations come from the record, so the decode rows'
    tokens may still be device-only. Writes K/V at `batch.out_cache_loc`
    (mutates `cache`).

    Returns:
        device int64 `[num_reqs]`: each row's token after its last computed
        token (meaningless for `batch.partial` rows).
    """
    inputs = _inputs(feeder, batch, pools)
    hidden = _run(model, cache, inputs, pools, batch.input_ids.device, feed_forward, feeder)
    return model.sample(hidden, sampling, batch.rows.seq_lens.host)


def _sampling(rows: Rows[Any]) -> Sampling | None:
    columns = rows.columns
    return columns if isinstance(columns, Sampling) else None


def _inputs(
    feeder: Feeder | None,
    batch: Extended[Any] | Decoding[Any] | Mixed[Any],
    pools: Pools,
) -> ForwardInputs | Padded:
    if feeder is None:
        return forward_inputs(batch, pools.table, pools.page_size)
    return feeder.inputs(batch, pools)


def _run(  # noqa: PLR0917  # the forward, then who feeds it
    model: LanguageModel,
    cache: KVCache,
    inputs: ForwardInputs | Padded,
    pools: Pools,
    input_ids: torch.Tensor,
    feed_forward: FeedForward | None,
    feeder: Feeder | None,
) -> torch.Tensor:
    # The hidden state at each real row's last token: what sampling takes.
    if isinstance(inputs, Padded):  # the feeder's: its ids go to the bucket's buffer too
        ids = inputs.pad_tokens(input_ids) if feeder is None else feeder.pad_ids(inputs, input_ids)
        # A hybrid model's window and state inputs go to the bucket's buffers as well.
        hybrid = (
            feeder.hybrid_inputs(inputs, pools)
            if feeder is not None and model.config.is_hybrid
            else None
        )
        return unpad(
            inputs.run(
                lambda padded: _forward(
                    model, cache, padded, pools, ids, feed_forward, hybrid=hybrid
                )
            )
        )
    hidden = _forward(model, cache, inputs, pools, input_ids, feed_forward)
    return hidden.index_select(0, inputs.sample_index.device)


def _forward(  # noqa: PLR0917  # the forward's model, cache, inputs, pools and tokens
    model: LanguageModel,
    cache: KVCache,
    inputs: ForwardInputs,
    pools: Pools,
    input_ids: torch.Tensor,
    feed_forward: FeedForward | None,
    checkpoints: torch.Tensor | None = None,
    *,
    hybrid: HybridInputs | None = None,  # a hybrid model's, filled into a bucket; None: built
) -> torch.Tensor:
    # Paged attention as a kernel consumes it: queries by `qo_indptr`, keys from the pages
    # `kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`, the last holding `kv_last_page_len[b]`
    # tokens, and FlashInfer's causal rule (query i of a row sees keys <= kv - qo + i).
    # Positions feed the rotary angles. Nothing else of the batch is read.
    device, page_size = model.device, inputs.page_size
    num_rows, max_q, max_kv = inputs.num_rows, inputs.max_q_len, inputs.max_kv_len
    row_tokens = int(inputs.qo_indptr.host[-1])  # tokens padded past it belong to no row
    qo = inputs.qo_indptr.device.to(torch.int64)
    kv_indptr = inputs.kv_indptr.device.to(torch.int64)
    q_lens = qo[1:] - qo[:-1]
    kv_lens = ((kv_indptr[1:] - kv_indptr[:-1] - 1) * page_size).clamp(min=0)
    kv_lens = kv_lens + inputs.kv_last_page_len.device.to(torch.int64)
    token = torch.arange(row_tokens, device=device)
    row = torch.searchsorted(qo[1:], token, right=True)
    col = token - qo[row]
    key = torch.arange(max_kv, device=device)
    # Each key's page, clamped for rows shorter than the longest (the mask drops those keys).
    page_at = (kv_indptr[:-1, None] + key[None, :] // page_size).clamp(
        max=max(inputs.num_pages - 1, 0)
    )
    pages = inputs.kv_indices.device.to(torch.int64)
    key_locs = (
        pages[page_at] * page_size + key[None, :] % page_size
        if inputs.num_pages
        else page_at.new_zeros(num_rows, max_kv)
    )
    query = torch.arange(max_q, device=device)
    limit = (kv_lens - q_lens)[:, None] + query[None, :]  # [rows, max_q]: last key each sees
    visible = key[None, None, :] <= limit[:, :, None]
    visible &= key[None, None, :] < kv_lens[:, None, None]
    locs = inputs.out_cache_loc.device
    scale = 1.0 / math.sqrt(model.config.head_dim)
    groups = model.config.kv_groups

    # Tokens [tokens, h, d] <-> rows [rows, max_q, h, d].
    layout = RowGrid(row, col, num_rows, max_q, row_tokens)
    grid, flat = layout.grid, layout.flat

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer = model.config.ordinal(layer)  # its row among the full-attention layers
        cache.k[layer, locs] = k
        cache.v[layer, locs] = v
        keys, values = cache.k[layer, key_locs], cache.v[layer, key_locs]  # [b, keys, kv h, d]
        keys, values = _query_heads(keys, groups), _query_heads(values, groups)
        scores = torch.einsum("bqhd,bkhd->bhqk", grid(q), keys) * scale
        scores = scores.masked_fill(~visible[:, None], -torch.inf)
        return flat(torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), values), q.shape[0])

    if model.config.attention == "ragged":
        attend = _ragged(model, cache, inputs, key_locs, q_lens, kv_lens, layout)
    if model.config.is_hybrid:
        hybrid = hybrid_inputs(inputs, pools) if hybrid is None else hybrid
        attend = hybrid_attend(model, cache, inputs, hybrid, attend, checkpoints)
    return model.hidden(input_ids, inputs.positions.device, attend, feed_forward)


def _ragged(  # noqa: PLR0917  # the forward's layout, as `_forward` computed it
    model: LanguageModel,
    cache: KVCache,
    inputs: ForwardInputs,
    key_locs: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    layout: RowGrid,
) -> Attend:
    # Ragged attention, as SGLang's FlashInfer path and FlashAttention's varlen path run an
    # extend: over the step's own keys and values (causal among a row's new tokens), and
    # over the row's prefix read through its pages, the two merged by their log-sum-exps;
    # only then is the step's K/V written at `out_cache_loc`. The prefix is read before
    # the write: a prefix cell the forward also wrote would be read stale (docs/design.md).
    device = key_locs.device
    prefix = kv_lens - q_lens  # [rows]: keys before the row's first query
    host_prefix = inputs.prefix_lens.host
    max_prefix = int(host_prefix.max()) if host_prefix.shape[0] else 0
    prefix_locs = key_locs[:, :max_prefix]
    seen = torch.arange(max_prefix, device=device)[None, :] < prefix[:, None]  # [rows, keys]
    query = torch.arange(inputs.max_q_len, device=device)
    causal = query[None, :] <= query[:, None]  # [q, new key]: a new token sees those up to it
    own = causal[None] & (query[None, None, :] < q_lens[:, None, None])  # [rows, q, new key]
    locs = inputs.out_cache_loc.device
    scale = 1.0 / math.sqrt(model.config.head_dim)
    groups = model.config.kv_groups
    grid = layout.grid

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer = model.config.ordinal(layer)  # its row among the full-attention layers
        queries = grid(q)
        old_k, old_v = cache.k[layer, prefix_locs], cache.v[layer, prefix_locs]  # before the write
        old_k, old_v = _query_heads(old_k, groups), _query_heads(old_v, groups)
        paged = torch.einsum("bqhd,bkhd->bhqk", queries, old_k) * scale
        paged = paged.masked_fill(~seen[:, None, None, :], -torch.inf)
        new_k, new_v = _query_heads(grid(k), groups), _query_heads(grid(v), groups)
        step = torch.einsum("bqhd,bkhd->bhqk", queries, new_k) * scale
        step = step.masked_fill(~own[:, None], -torch.inf)
        out_paged, lse_paged = _partial(paged, old_v)
        out_step, lse_step = _partial(step, new_v)
        out = _merge(out_paged, lse_paged, out_step, lse_step)
        cache.k[layer, locs] = k  # the write, last
        cache.v[layer, locs] = v
        return layout.flat(out, q.shape[0])

    return attend


def _query_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    # Grouped-query attention: K/V head j serves query heads j * groups to (j + 1) * groups - 1,
    # so each is repeated in place along the head axis (dim 2 of `[rows, keys, heads, d]`).
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _partial(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Softmax attention over one part of the keys, and its log-sum-exp (-inf: no key seen).
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [b, h, q, 1]
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0))
    return torch.einsum("bhqk,bkhd->bqhd", weights, values), lse.permute(0, 2, 1, 3)


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    # Two parts' attention as one softmax over both (FlashInfer's `merge_state`).
    lse = torch.logaddexp(lse_a, lse_b)
    lse = torch.where(torch.isfinite(lse), lse, 0.0)  # a padded query sees neither part
    return out_a * torch.exp(lse_a - lse) + out_b * torch.exp(lse_b - lse)


def forward_idle(
    model: LanguageModel,
    batch: Idle[Any] | Filtered[Any],
    feed_forward: FeedForward | None = None,
    padding: int = 0,
) -> None:
    """Run every layer over no tokens, for a step in which `batch` computes nothing.

    That is a batch with no rows, or a prebuilt one (its KV came from a
    prefill server). Nothing is computed or written, but `feed_forward` is
    called once per layer, as in any forward: a data-parallel rank with no
    work joins the collectives of the ranks that have some. The empty input
    comes from the record's own mirrors, as a decode's would; with `padding`,
    it is that many padding tokens, as a rank replaying a captured graph
    brings.
    """
    positions = batch.rows.seq_lens.device[:0].to(torch.int64)  # no tokens
    if padding:  # a captured size of padding tokens, at position 0 (SGLang's fill)
        positions = positions.new_zeros(padding)
    model.hidden(torch.zeros_like(positions), positions, _attend_nothing, feed_forward)


def _attend_nothing(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q  # no tokens: nothing to store, nothing to attend to
