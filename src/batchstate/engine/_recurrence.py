"""The recurrent layers' one step: a gated linear recurrence, shared by the engine and the oracle.

A state layer keeps, per request and head, a `[head_dim, head_dim]` state
instead of K/V: each token decays it by a gate drawn from its key, adds
its key-value outer product, and reads it with its query,

    state = sigmoid(mean(k)) * state + k vᵀ        out = (q / sqrt(head_dim)) · state

so a token's output depends on every token before it, through a state of
fixed size. The engine folds a whole batch of rows at once, the oracle
one request alone: both call `recur`, so they differ only in batching.
"""

from __future__ import annotations

import math

import torch

__all__ = ["recur"]


def recur(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token through a state layer: the state after it, and its output.

    Args:
        state: `[..., num_heads, head_dim, head_dim]`, the state before the token.
        q, k, v: `[..., num_heads, head_dim]`, the token's projections.

    Returns:
        The new state (shaped as `state`) and the output `[..., num_heads, head_dim]`.
    """
    gate = torch.sigmoid(k.mean(dim=-1))[..., None, None]
    state = gate * state + k[..., :, None] * v[..., None, :]
    out = torch.einsum("...hd,...hde->...he", q / math.sqrt(q.shape[-1]), state)
    return state, out
