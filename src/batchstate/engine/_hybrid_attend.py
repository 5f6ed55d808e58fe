"""A hybrid model's window and state layers, reading only the forward's `hybrid_inputs`.

Full-attention layers keep the paged attention of `engine/_paged.py`; the
other layers read what a hybrid kernel takes:

- a window layer writes each new token's K/V at the window inputs'
  `out_cache_loc` and row `i` reads positions `kv_starts[i]` on from the
  window pages `kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`, masked to the
  last `window` positions of each query: a page given back too early is a
  missing key, and the oracle's tokens differ;
- a state layer folds each row's tokens in order (`recur`) from its state
  slot `state_indices[i]`, from the zero state when the row starts at
  position 0, and writes the state back;
- with the prefix cache on, rows that resume from an anchor first copy its
  window tail and state into their own (`hybrid.cached`), and rows that
  publish one fill it: their window tail copied after the new K/V is
  written, their state checkpointed after the anchor's last token; a verify forward instead writes
  the state after each query token into `checkpoints[token]` and leaves
  the slot as it was (`accepted_states` copies the accepted one back).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from batchstate import CachedCopies, ForwardInputs, HybridInputs, accepted_states
from batchstate.engine._language_model import LanguageModel
from batchstate.engine._model import Attend
from batchstate.engine._recurrence import recur
from batchstate.engine._row_grid import RowGrid

if TYPE_CHECKING:
    from batchstate.engine._kv_cache import KVCache

__all__ = ["hybrid_attend", "keep_accepted", "verify_checkpoints"]


def hybrid_attend(  # noqa: PLR0917  # the forward's model, cache, inputs, and its full layers
    model: LanguageModel,
    cache: KVCache,
    inputs: ForwardInputs,
    hybrid: HybridInputs,
    full: Attend,
    checkpoints: torch.Tensor | None,
) -> Attend:
    """Attention for every layer of `model`: `full` for full layers, the window and state paths.

    `checkpoints`: `[state layers, num_tokens + 1, heads, head_dim, head_dim]`
    for a verify forward (the last row is a sink for rows past their tokens),
    None for any other forward.
    """
    config, device = model.config, model.device
    num_rows, max_q = inputs.num_rows, inputs.max_q_len
    row_tokens = int(inputs.qo_indptr.host[-1])  # tokens padded past it belong to no row
    qo = inputs.qo_indptr.device.to(torch.int64)
    q_lens = qo[1:] - qo[:-1]
    token = torch.arange(row_tokens, device=device)
    row = torch.searchsorted(qo[1:], token, right=True)
    col = token - qo[row]
    query_at = torch.zeros(num_rows, max_q, dtype=torch.int64, device=device)
    query_at[row, col] = inputs.positions.device[:row_tokens].to(torch.int64)

    # Tokens [tokens, h, d] <-> rows [rows, max_q, h, d].
    layout = RowGrid(row, col, num_rows, max_q, row_tokens)
    grid, flat = layout.grid, layout.flat

    window_attend = (
        _window(config.window, config.kv_groups, cache, hybrid, query_at, q_lens)
        if hybrid.windows
        else None
    )

    copies = hybrid.cached[0] if hybrid.cached else None
    checkpoint_at = _checkpoint_rows(copies, qo, num_rows) if copies is not None else None

    def state_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        slots = hybrid.states[0].state_indices.device.to(torch.int64)
        if copies is not None:  # resumed rows start from their anchors' states
            sources = copies.state_from.device
            cache.states[layer, copies.state_to.device] = cache.states[layer, sources]
        state = cache.states[layer, slots]
        fresh = (query_at[:, 0] == 0)[:, None, None, None]  # a row from position 0: no state yet
        state = torch.where(fresh, torch.zeros_like(state), state)
        queries, keys, values = grid(q), grid(k), grid(v)
        outs = torch.zeros_like(queries)
        sink = torch.full_like(q_lens, q.shape[0])
        for step in range(max_q):
            active = step < q_lens
            after, outs[:, step] = recur(state, queries[:, step], keys[:, step], values[:, step])
            state = torch.where(active[:, None, None, None], after, state)
            if checkpoint_at is not None:  # an anchor's state, after its last token
                steps, anchor_slots = checkpoint_at
                cache.states[layer, torch.where(steps == step, anchor_slots, 0)] = state
            if checkpoints is not None:
                checkpoints[layer, torch.where(active, qo[:-1] + step, sink)] = state
        if checkpoints is None:
            cache.states[layer, slots] = state
        return flat(outs, q.shape[0])

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kind, ordinal = config.kind(layer), config.ordinal(layer)
        if kind == "full":
            return full(layer, q, k, v)
        if kind == "state":
            return state_attend(ordinal, q, k, v)
        assert window_attend is not None  # the cache was made for this model's kinds
        return flat(window_attend(ordinal, grid(q), k, v), q.shape[0])

    return attend


def _window(  # noqa: PLR0917  # the window, its K/V groups, and the forward's layout
    window: int,
    groups: int,
    cache: KVCache,
    hybrid: HybridInputs,
    query_at: torch.Tensor,
    q_lens: torch.Tensor,
) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    # Where each row's window keys are, and which each query sees: built once per forward.
    inputs = hybrid.windows[0]
    page_size, device = inputs.page_size, query_at.device
    counts_host = inputs.kv_indptr.host[1:] - inputs.kv_indptr.host[:-1]
    max_keys = int(counts_host.max()) * page_size if counts_host.shape[0] else 0
    indptr = inputs.kv_indptr.device.to(torch.int64)
    starts = inputs.kv_starts.device.to(torch.int64)
    key = torch.arange(max_keys, device=device)
    held = (indptr[1:] - indptr[:-1])[:, None] * page_size  # keys each row's pages hold
    num_pages = len(inputs.kv_indices)
    page_at = (indptr[:-1, None] + key[None, :] // page_size).clamp(max=max(num_pages - 1, 0))
    pages = inputs.kv_indices.device.to(torch.int64)
    key_locs = (
        pages[page_at] * page_size + key[None, :] % page_size
        if num_pages
        else page_at.new_zeros(page_at.shape)
    )
    key_at = (starts[:, None] + key[None, :])[:, None, :]  # [rows, 1, keys]: key positions
    query = query_at[:, :, None]
    visible = (key_at <= query) & (key_at > query - window) & (key[None, None, :] < held[:, None])
    visible &= (torch.arange(query_at.shape[1], device=device)[None, :] < q_lens[:, None])[
        :, :, None
    ]
    locs = inputs.out_cache_loc.device
    scale = 1.0 / math.sqrt(cache.window_k.shape[-1])
    copies = hybrid.cached[0] if hybrid.cached else None
    lanes = torch.arange(page_size, device=device)

    def token_locs(pages: torch.Tensor) -> torch.Tensor:  # window pages -> their token slots
        return (pages[:, None] * page_size + lanes).reshape(-1)

    def copy(layer: int, sources: torch.Tensor, targets: torch.Tensor) -> None:
        # Every source read before any target written: a gather, then a scatter.
        for kv in (cache.window_k, cache.window_v):
            kv[layer, token_locs(targets)] = kv[layer, token_locs(sources)]

    def attend(layer: int, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Resumed rows' tails from their anchors, new K/V (a query reads itself), published
        # anchors' tails from their rows, then each row's window keys from its pages.
        if copies is not None:
            copy(layer, copies.window_from.device, copies.window_to.device)
        cache.window_k[layer, locs] = k[: locs.shape[0]]
        cache.window_v[layer, locs] = v[: locs.shape[0]]
        if copies is not None:
            copy(layer, copies.publish_from.device, copies.publish_to.device)
        keys, values = cache.window_k[layer, key_locs], cache.window_v[layer, key_locs]
        if groups > 1:  # grouped-query: K/V head j serves query heads j * groups and on
            keys, values = keys.repeat_interleave(groups, 2), values.repeat_interleave(groups, 2)
        scores = torch.einsum("bqhd,bkhd->bhqk", queries, keys) * scale
        scores = scores.masked_fill(~visible[:, None], -torch.inf)
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), values)

    return attend


def _checkpoint_rows(
    copies: CachedCopies, qo: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    # Per row, the step of its forward after which an anchor takes its state (-1: none),
    # and that anchor's state slot (0, the padding slot, for none).
    tokens = copies.checkpoint_tokens.device
    if not len(copies.checkpoint_tokens):
        return None
    rows = torch.searchsorted(qo[1:], tokens, right=True)
    steps = torch.full((num_rows,), -1, dtype=torch.int64, device=qo.device)
    slots = torch.zeros(num_rows, dtype=torch.int64, device=qo.device)
    steps[rows] = tokens - qo[rows]
    slots[rows] = copies.checkpoint_states.device
    return steps, slots


def verify_checkpoints(model: LanguageModel, inputs: ForwardInputs) -> torch.Tensor | None:
    """A verify forward's checkpoints: a state per query token, and a sink; None: no state layer."""
    config = model.config
    if not config.count("state"):
        return None
    num_tokens = int(inputs.qo_indptr.host[-1])
    shape = (
        config.count("state"),
        num_tokens + 1,
        config.num_heads,
        config.head_dim,
        config.head_dim,
    )
    return torch.zeros(shape, dtype=config.torch_dtype, device=model.device)


def keep_accepted(
    cache: KVCache,
    inputs: ForwardInputs,
    hybrid: HybridInputs,
    checkpoints: torch.Tensor | None,
    num_accepted: torch.Tensor | npt.NDArray[np.int64],
) -> None:
    """Copy each row's state after its last accepted token into its state slot.

    The copies are `accepted_states`' (computed on the device from device counts).
    """
    if checkpoints is None:
        return
    copies = accepted_states(inputs, hybrid, num_accepted)
    cache.states[:, copies.targets.device] = checkpoints[:, copies.sources.device]
