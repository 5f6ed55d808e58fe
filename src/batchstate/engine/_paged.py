"""A paged KV cache, and attention that reads it only through the batch's metadata.

Every location the model reads or writes comes from the batch: new K/V go
to `out_cache_loc`, and row `i` reads keys at
`table[req_pool_indices[i], 0:seq_lens[i]]`. Positions (and so rotary
angles and the causal mask) come from the device `seq_lens`. A wrong value
in any of them changes the tokens, which is what the oracle catches.
"""

from __future__ import annotations

import math
from typing import Any, final

import attrs
import numpy as np
import torch

from batchstate import Decoding, Extended, Filtered, Idle, Mixed, Pools, Rows, Sampling
from batchstate.engine._model import FeedForward, TinyModel

__all__ = [
    "KVCache",
    "forward_idle",
    "make_kv_cache",
    "sample_decode",
    "sample_extend",
    "sample_mixed",
    "write_prefilled",
]


@final
@attrs.frozen(eq=False)
class KVCache:
    """K and V for every location the pools hand out.

    NOTE: written in place by every forward, at `out_cache_loc` only;
    location 0 (the padding page) is read for padding keys and masked out.
    """

    k: torch.Tensor  # [num_layers, kv_cache_size, num_heads, head_dim]
    v: torch.Tensor  # the same


def make_kv_cache(model: TinyModel, pools: Pools) -> KVCache:
    """A zeroed cache with `pools.kv_cache_size` rows per layer, on the model's device."""
    config = model.config
    shape = (config.num_layers, pools.kv_cache_size, config.num_heads, config.head_dim)
    return KVCache(
        torch.zeros(shape, dtype=config.dtype, device=model.device),
        torch.zeros(shape, dtype=config.dtype, device=model.device),
    )


def sample_extend(
    model: TinyModel,
    cache: KVCache,
    batch: Extended[Any],
    pools: Pools,
    *,
    feed_forward: FeedForward | None = None,
) -> torch.Tensor:
    """Run an extend forward and return each row's next token.

    Writes K/V of every extend token at `batch.out_cache_loc` (mutates `cache`).
    Rows sample with their `Sampling` columns when the batch carries them,
    greedily otherwise. `feed_forward` runs the MLPs (None: `TinyModel.mlp`).

    Returns:
        device int64 `[num_reqs]`: the token after each row's last input id.
    """
    extend_lens = torch.tensor(batch.extend_lens, dtype=torch.int64)  # host-only field
    num_tokens = batch.extend_num_tokens
    rows_of_tokens = torch.repeat_interleave(torch.arange(len(extend_lens)), extend_lens)
    cols = torch.arange(num_tokens) - (torch.cumsum(extend_lens, 0) - extend_lens)[rows_of_tokens]
    device = model.device
    # Host layout (from host-only extend_lens) copied once; positions come from the device seq_lens.
    layout = torch.stack((rows_of_tokens, cols, extend_lens[rows_of_tokens])).to(device)
    row, col, extend_len = layout.unbind()
    positions = batch.rows.seq_lens.device[row] - extend_len + col
    hidden = _forward(
        model,
        cache,
        pools.table.device,
        batch.rows,
        input_ids=batch.input_ids.device,
        positions=positions,
        out_cache_loc=batch.out_cache_loc.device,
        query_layout=(row, col, max(batch.extend_lens, default=0)),
        feed_forward=feed_forward,
    )
    last = (torch.cumsum(extend_lens, 0) - 1).to(device)
    return model.sample(hidden[last], _sampling(batch.rows), batch.rows.seq_lens.host)


def sample_decode(
    model: TinyModel,
    cache: KVCache,
    batch: Decoding[Any],
    pools: Pools,
    input_ids: torch.Tensor,
    *,
    feed_forward: FeedForward | None = None,
) -> torch.Tensor:
    """Run a decode forward of one token per row and return each row's next token.

    Rows sample with their `Sampling` columns when the batch carries them,
    greedily otherwise.

    Args:
        pools: the pools whose table `batch` was decoded against.
        input_ids: device int64 `[num_reqs]`, each row's last sampled token.
        feed_forward: runs the MLPs (None: `TinyModel.mlp`).

    Returns:
        device int64 `[num_reqs]`. Writes K/V at `batch.out_cache_loc` (mutates `cache`).
    """
    rows = batch.rows
    row = torch.arange(len(rows), device=model.device)
    positions = rows.seq_lens.device - 1
    hidden = _forward(
        model,
        cache,
        pools.table.device,
        rows,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=batch.out_cache_loc.device,
        query_layout=(row, torch.zeros_like(row), 1),
        feed_forward=feed_forward,
    )
    return model.sample(hidden, _sampling(rows), rows.seq_lens.host)


def sample_mixed(
    model: TinyModel,
    cache: KVCache,
    batch: Mixed[Sampling],
    pools: Pools,
    sampling: Sampling | None = None,
    *,
    feed_forward: FeedForward | None = None,
) -> torch.Tensor:
    """Run one forward over a mixed batch (chunks, prompts, decode rows) and sample every row.

    `sampling`: the batch's own `Sampling` columns, or None when every row
    is greedy (the argmax path). `feed_forward` runs the MLPs (None: `TinyModel.mlp`).

    Input ids, positions and KV locations all come from the record, so the
    decode rows' tokens may still be device-only. Writes K/V at
    `batch.out_cache_loc` (mutates `cache`).

    Returns:
        device int64 `[num_reqs]`: each row's token after its last computed
        token (meaningless for `batch.partial` rows).
    """
    extend_lens = batch.extend_lens  # host-only layout: one ragged run per row
    token_rows = np.repeat(np.arange(extend_lens.shape[0]), extend_lens)
    cols = np.arange(batch.num_tokens) - (np.cumsum(extend_lens) - extend_lens)[token_rows]
    # One host-to-device copy: each token's (row, column), then each row's last token.
    packed = np.concatenate((token_rows, cols, batch.sample_index)).astype(np.int64)
    layout = torch.from_numpy(packed).to(model.device)
    num_tokens = batch.num_tokens
    row, col, last = (
        layout[:num_tokens],
        layout[num_tokens : 2 * num_tokens],
        layout[2 * num_tokens :],
    )
    hidden = _forward(
        model,
        cache,
        pools.table.device,
        batch.rows,
        input_ids=batch.input_ids.device,
        positions=batch.positions.device,
        out_cache_loc=batch.out_cache_loc.device,
        query_layout=(row, col, int(extend_lens.max()) if extend_lens.shape[0] else 0),
        feed_forward=feed_forward,
    )
    return model.sample(hidden[last], sampling, batch.rows.seq_lens.host)


def write_prefilled(
    cache: KVCache, batch: Filtered[Any], pools: Pools, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write K/V computed elsewhere at each row's locations, for positions 0 to `seq_lens[i]`.

    Row `i`'s locations are `pools.table.device[req_pool_indices[i], :seq_lens[i]]`,
    gathered on the device: nothing is read back.

    Args:
        batch: a `prebuilt` batch, its KV allocated but not yet written.
        k, v: `[num_layers, seq_lens_sum, num_heads, head_dim]` on the cache's
            device, each row's positions in order, the rows back to back.
    """
    rows = batch.rows
    seq_lens = torch.tensor(rows.seq_lens.host, dtype=torch.int64)  # a host copy
    row_of = torch.repeat_interleave(torch.arange(len(rows)), seq_lens)
    col = torch.arange(row_of.shape[0]) - (torch.cumsum(seq_lens, 0) - seq_lens)[row_of]
    # Host layout (from host seq_lens) copied once; the slots and the table stay on the device.
    row, position = torch.stack((row_of, col)).to(cache.k.device).unbind()
    locs = pools.table.device[rows.req_pool_indices.device[row], position].to(torch.int64)
    cache.k[:, locs] = k
    cache.v[:, locs] = v


def _sampling(rows: Rows[Any]) -> Sampling | None:
    columns = rows.columns
    return columns if isinstance(columns, Sampling) else None


def _forward(
    model: TinyModel,
    cache: KVCache,
    table: torch.Tensor,
    rows: Rows[Any],
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    query_layout: tuple[torch.Tensor, torch.Tensor, int],
    feed_forward: FeedForward | None,
) -> torch.Tensor:
    # Queries are laid out padded, [num_reqs, max_query_len]: token t sits at (row[t], col[t]).
    row, col, max_query_len = query_layout
    num_reqs, max_seq_len = len(rows), rows.max_seq_len
    # The table's columns past a row's length are stale or padding: the mask drops them.
    key_locs = table[rows.req_pool_indices.device, :max_seq_len].to(torch.int64)
    key_positions = torch.arange(max_seq_len, device=model.device)
    query_positions = positions.new_zeros(num_reqs, max_query_len)
    query_positions[row, col] = positions
    visible = key_positions[None, None, :] <= query_positions[:, :, None]
    visible &= key_positions[None, None, :] < rows.seq_lens.device[:, None, None]
    scale = 1.0 / math.sqrt(model.config.head_dim)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache.k[layer, out_cache_loc] = k
        cache.v[layer, out_cache_loc] = v
        keys, values = cache.k[layer, key_locs], cache.v[layer, key_locs]  # [b, keys, h, d]
        queries = q.new_zeros(num_reqs, max_query_len, *q.shape[1:])
        queries[row, col] = q
        scores = torch.einsum("bqhd,bkhd->bhqk", queries, keys) * scale
        scores = scores.masked_fill(~visible[:, None], -torch.inf)
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), values)
        return out[row, col]

    return model.hidden(input_ids, positions, attend, feed_forward)


def forward_idle(
    model: TinyModel, batch: Idle[Any] | Filtered[Any], feed_forward: FeedForward | None = None
) -> None:
    """Run every layer over no tokens, for a step in which `batch` computes nothing.

    That is a batch with no rows, or a prebuilt one (its KV came from a
    prefill server). Nothing is computed or written, but `feed_forward` is
    called once per layer, as in any forward: a data-parallel rank with no
    work joins the collectives of the ranks that have some. The empty input
    comes from the record's own mirrors, as a decode's would.
    """
    positions = batch.rows.seq_lens.device[:0].to(torch.int64)  # no tokens
    model.hidden(torch.zeros_like(positions), positions, _attend_nothing, feed_forward)


def _attend_nothing(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q  # no tokens: nothing to store, nothing to attend to
