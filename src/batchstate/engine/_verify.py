"""Speculative decoding on the tiny model: a smaller draft model proposes, the target verifies.

The draft model is the target's first layers with its embeddings and
unembedding: cheap, and often right. It proposes greedily, each request
alone over its whole history (no cache of its own to roll back). The
target runs one forward over each row's window (its decode token, then
its drafts) over the paged cache, samples the token after every window
position with the row's own parameters (a draw keyed by the request's
seed and the position, as everywhere in the engine), and accepts each
row's longest run of drafts equal to those samples. The accepted drafts
and the sample after them are exactly what the target alone would
produce, so the oracle stays exact, greedy or not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from batchstate import Pools, Sampling, Verifying, forward_inputs, hybrid_inputs
from batchstate.engine._alone import AloneRun
from batchstate.engine._hybrid_attend import keep_accepted, verify_checkpoints
from batchstate.engine._kv_cache import KVCache
from batchstate.engine._language_model import LanguageModel
from batchstate.engine._model import FeedForward
from batchstate.engine._paged import _forward

__all__ = [
    "Acceptance",
    "UnreadAcceptance",
    "draft_model",
    "propose",
    "sample_verify",
    "sample_verify_unread",
]


class Acceptance(NamedTuple):
    """What a verify forward decided: counts for `sync`, and the target's tokens per row."""

    accepted: npt.NDArray[np.int64]  # [num_reqs], on the host: drafts each row accepted
    targets: list[list[int]]  # per row: the target's token after each window position


class UnreadAcceptance(NamedTuple):
    """What a verify forward decided, still on the device (overlap: read next step).

    `read_verified(counts, targets)` brings both back in one read: row i's
    accepted drafts and the target's token after them are `targets[i, : counts[i] + 1]`.
    """

    counts: torch.Tensor  # int64 [num_reqs]: drafts each row accepted
    targets: torch.Tensor  # int64 [num_reqs, max_drafts + 1]: the target's token per position
    proposed: list[list[int]]  # per row, its decode token then its drafts, as the host sent them


def draft_model(target: LanguageModel, num_layers: int = 1) -> LanguageModel:
    """The target's first `num_layers` layers, with its embeddings and unembedding."""
    return target.first_layers(num_layers)


def propose(model: LanguageModel, history: Sequence[int], count: int) -> list[int]:
    """`count` greedy draft tokens after `history`, the request alone over its own cache."""
    if not count:
        return []
    run = AloneRun(model)
    drafts = [run.next_token(history)]
    while len(drafts) < count:
        drafts.append(run.next_token(drafts[-1:]))
    return drafts


def sample_verify(  # noqa: PLR0917  # the window, its forward's inputs, and how rows sample
    model: LanguageModel,
    cache: KVCache,
    window: Verifying[Sampling],
    pools: Pools,
    committed: npt.NDArray[np.int64],
    tokens: Sequence[Sequence[int]],
    sampling: Sampling | None,
    *,
    feed_forward: FeedForward | None = None,
) -> Acceptance:
    """Run the target over each row's window and accept its drafts that match the target.

    Args:
        window: the verify window `verify` opened.
        pools: the pools `verify` returned (their table holds the drafts' cells).
        committed: host int64 `[num_reqs]`, each row's length before its drafts
            (its decode token included), as the decode batch's mirror had it.
        tokens: per row, its decode token then its drafts (`1 + draft_lens[i]`).
        sampling: every window token's parameters (its row's), in window order;
            None samples greedily.

    Returns:
        The accepted counts and the target's tokens, on the host: the tokens
        are read once, as a decode step reads its tokens, and the counts
        follow from them there (a GPU verify kernel would count on the
        device and leave the read to `sync`). Writes the window's K/V at
        `window.out_cache_loc` (mutates `cache`).
    """
    sampled, kept = _sample_window(
        model, cache, window, pools, committed, tokens, sampling, feed_forward
    )
    spans = window.draft_lens + 1
    num_reqs = len(window.reqs)
    targets = sampled.tolist()  # NOTE: the step's read of its tokens, as a decode's
    per_row: list[list[int]] = []
    accepted = np.zeros(num_reqs, dtype=np.int64)
    start = 0
    for row, span in enumerate(spans.tolist()):
        outs = targets[start : start + span]
        proposed = tokens[row][1:]
        while accepted[row] < span - 1 and proposed[accepted[row]] == outs[accepted[row]]:
            accepted[row] += 1
        per_row.append(outs)
        start += span
    kept(accepted)
    return Acceptance(accepted, per_row)


def sample_verify_unread(  # noqa: PLR0917  # as sample_verify
    model: LanguageModel,
    cache: KVCache,
    window: Verifying[Sampling],
    pools: Pools,
    committed: npt.NDArray[np.int64],
    tokens: Sequence[Sequence[int]],
    sampling: Sampling | None,
    *,
    feed_forward: FeedForward | None = None,
) -> UnreadAcceptance:
    """`sample_verify`, with the acceptance decided on the device and nothing read.

    Each row's sampled tokens are gathered into `[num_reqs, max_drafts + 1]`;
    a row accepts the leading drafts equal to them (a cumulative product of
    matches), as a GPU verify kernel counts. Writes the window's K/V.
    """
    sampled, kept = _sample_window(
        model, cache, window, pools, committed, tokens, sampling, feed_forward
    )
    spans = window.draft_lens + 1
    width = int(spans.max()) if spans.shape[0] else 1
    starts = np.cumsum(spans) - spans
    within = np.arange(width)
    index = starts[:, None] + np.minimum(within[None, :], spans[:, None] - 1)
    drafts = np.full((len(tokens), max(width - 1, 0)), -1, dtype=np.int64)  # -1 matches no token
    for row, proposed in enumerate(tokens):
        drafts[row, : len(proposed) - 1] = proposed[1:]
    device = sampled.device
    index_side = torch.from_numpy(index.reshape(-1)).to(device)
    targets = sampled.to(torch.int64).index_select(0, index_side).view(len(tokens), width)
    matches = targets[:, :-1] == torch.from_numpy(drafts).to(device)
    counts = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)
    kept(counts)
    return UnreadAcceptance(counts, targets, [list(row) for row in tokens])


def _sample_window(  # noqa: PLR0917  # as sample_verify
    model: LanguageModel,
    cache: KVCache,
    window: Verifying[Sampling],
    pools: Pools,
    committed: npt.NDArray[np.int64],
    tokens: Sequence[Sequence[int]],
    sampling: Sampling | None,
    feed_forward: FeedForward | None,
) -> tuple[torch.Tensor, Callable[[torch.Tensor | npt.NDArray[np.int64]], None]]:
    # The target over every window token; the token it samples after each, on the device;
    # and what keeps each row's recurrent state at its last accepted token, given the counts.
    spans = window.draft_lens + 1
    num_reqs = len(window.reqs)
    # The kernel's inputs for the window; its lengths are what each slot now owns.
    inputs = forward_inputs(window, pools.table, pools.page_size, slot_tokens=pools.slot_tokens)
    flat = [token for row in tokens for token in row]
    input_ids = torch.tensor(flat, dtype=torch.int64, device=model.device)
    checkpoints = verify_checkpoints(model, inputs)
    hidden = _forward(model, cache, inputs, pools, input_ids, feed_forward, checkpoints)
    # Each window token samples the token at the next position, on the host's own count.
    token_rows = np.repeat(np.arange(num_reqs), spans)
    cols = np.arange(token_rows.shape[0]) - (np.cumsum(spans) - spans)[token_rows]
    positions = committed[token_rows] - 1 + cols
    sampled = model.sample(hidden, sampling, positions + 1)
    if checkpoints is None:
        return sampled, _nothing_to_keep
    hybrid = hybrid_inputs(inputs, pools)
    return sampled, partial(keep_accepted, cache, inputs, hybrid, checkpoints)


def _nothing_to_keep(num_accepted: torch.Tensor | npt.NDArray[np.int64]) -> None:
    """No state layers: the verify forward left nothing to copy."""
