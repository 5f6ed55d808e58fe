"""The oracle: each request generated alone, with a plain contiguous KV cache.

No pools, no table, no batch: position `p` of the request is row `p` of its
own cache. A request's tokens depend only on its own tokens and its own
sampling parameters (greedy, or a draw from its seeded stream at each
position), so the engine's tokens for a request must equal these, however
it was batched, paged, retracted and re-prefilled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import final

import attrs
import numpy as np
import torch

from batchstate import GREEDY, Sampling, SamplingParams
from batchstate.engine._model import TinyModel

__all__ = ["OracleResult", "check_oracle", "generate_alone"]


def generate_alone(
    model: TinyModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    end_token: int,
    sampling: SamplingParams = GREEDY,
) -> tuple[int, ...]:
    """The tokens of one request run alone: up to `max_new_tokens`, stopping after `end_token`.

    Each token is sampled with `sampling` (greedy by default) through
    `TinyModel.sample`, a one-row batch drawing from the request's own
    `(seed, position)` stream: the engine's rows sample the same way.

    >>> from batchstate.engine._model import ModelConfig, make_model
    >>> model = make_model(ModelConfig())
    >>> len(generate_alone(model, (5, 6, 7), 4, end_token=-1))
    4
    """
    config = model.config
    keys: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
    scale = 1.0 / math.sqrt(config.head_dim)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys[layer].append(k)
        values[layer].append(v)
        all_k, all_v = torch.cat(keys[layer]), torch.cat(values[layer])  # [seq, heads, dim]
        num_queries, num_keys = q.shape[0], all_k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, all_k) * scale
        # Causal: query i sits at position num_keys - num_queries + i.
        causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(
            num_keys - num_queries
        )
        scores = scores.masked_fill(~causal, -torch.inf)
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), all_v)

    device = model.device
    columns = None if sampling.temperature == 0 else Sampling.of([sampling], device)
    tokens = torch.tensor(prompt, dtype=torch.int64, device=device)
    positions = torch.arange(len(prompt), device=device)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        hidden = model.hidden(tokens, positions, attend)[-1:]
        # The sampled token's position: the sequence's length so far.
        at = np.array([len(prompt) + len(generated)], dtype=np.int64)
        token = int(model.sample(hidden, columns, at)[0])
        generated.append(token)
        if token == end_token:
            break
        tokens = torch.tensor([token], dtype=torch.int64, device=device)
        positions = positions[-1:] + 1
    return tuple(generated)


@final
@attrs.frozen
class OracleResult:
    """How many requests matched the oracle, and the first that did not."""

    num_checked: int
    num_mismatched: int
    first_mismatch: str  # empty when every request matched

    @property
    def passed(self) -> bool:
        return self.num_mismatched == 0

    def __str__(self) -> str:
        if self.passed:
            return f"pass ({self.num_checked}/{self.num_checked} requests match)"
        return (
            f"FAIL ({self.num_mismatched}/{self.num_checked} requests differ;"
            f" first: {self.first_mismatch})"
        )


def check_oracle(
    model: TinyModel,
    requests: Mapping[int, tuple[tuple[int, ...], int]],
    outputs: Mapping[int, Sequence[int]],
    end_token: int,
    on_request: Callable[[int], None] | None = None,
    *,
    sampling: Mapping[int, SamplingParams] | None = None,
) -> OracleResult:
    """Compare each request's engine tokens with `generate_alone`.

    Args:
        requests: rid -> (prompt, max_new_tokens).
        sampling: rid -> the request's sampling parameters; a missing rid
            (or None) samples greedily.
        outputs: rid -> the tokens the engine generated; a missing rid is a mismatch.
        on_request: called with the number of requests checked so far, after each.
    """
    mismatched: list[str] = []
    for checked, (rid, (prompt, max_new_tokens)) in enumerate(requests.items(), 1):
        params = GREEDY if sampling is None else sampling.get(rid, GREEDY)
        expected = generate_alone(model, prompt, max_new_tokens, end_token, params)
        got = tuple(outputs.get(rid, ()))
        if got != expected:
            mismatched.append(f"request {rid}: engine {list(got)} != alone {list(expected)}")
        if on_request is not None:
            on_request(checked)
    return OracleResult(len(requests), len(mismatched), mismatched[0] if mismatched else "")
