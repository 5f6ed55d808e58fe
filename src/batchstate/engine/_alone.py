"""One request run alone: the model over a contiguous K/V cache of its own.

The oracle generates with it; the prefill server of a disaggregated run
(`ModelTokens.transfer`) prefills with it. Position `p` of the request is
row `p` of each layer's cache: no pools, no table, no batch. A hybrid
model's window layers mask each query to its last `window` positions, and
its state layers fold the request's tokens one by one (`recur`) into a
state of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, final

import numpy as np
import torch

from batchstate import GREEDY, Sampling, SamplingParams
from batchstate.engine._language_model import LanguageModel
from batchstate.engine._recurrence import recur

__all__ = ["AloneRun", "Prefilled", "prefill_alone"]


@final
class AloneRun:
    """A request's forwards, one after another, over its own contiguous cache.

    NOTE: mutable; it keeps every layer's K/V of the tokens computed so far.
    """

    def __init__(self, model: LanguageModel, sampling: SamplingParams = GREEDY) -> None:
        config = model.config
        self.model = model
        self.length = 0  # tokens computed so far: the next token's position
        self._keys: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
        self._values: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
        self._scale = 1.0 / math.sqrt(config.head_dim)
        heads = (config.num_heads, config.head_dim, config.head_dim)
        zeros = torch.zeros(heads, dtype=config.torch_dtype, device=model.device)
        self._states = [zeros] * config.num_layers  # read by the state layers only
        # Greedy requests take the argmax path, as a batch of greedy rows does.
        self._columns = None if sampling.temperature == 0 else Sampling.of([sampling], model.device)

    def next_token(self, tokens: Sequence[int]) -> int:
        """Compute `tokens` after those before them; sample the token that follows.

        The sampled token's position (which picks its draw) is the length so far.
        """
        device = self.model.device
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        positions = torch.arange(self.length, self.length + len(tokens), device=device)
        hidden = self.model.hidden(input_ids, positions, self._attend)[-1:]
        self.length += len(tokens)
        at = np.array([self.length], dtype=np.int64)
        return int(self.model.sample(hidden, self._columns, at)[0])

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every computed position, of each layer that keeps K/V (full and window
        layers, in layer order): `[kv layers, length, num_heads, head_dim]` each."""
        kinds = [self.model.config.kind(layer) for layer in range(self.model.config.num_layers)]
        kept = [layer for layer, kind in enumerate(kinds) if kind != "state"]
        return (
            torch.stack([torch.cat(self._keys[layer]) for layer in kept]),
            torch.stack([torch.cat(self._values[layer]) for layer in kept]),
        )

    def states(self) -> torch.Tensor:
        """Each state layer's state after the tokens computed so far.

        `[state layers, num_heads, head_dim, head_dim]`; no rows for a model without any.
        """
        config = self.model.config
        layers = [layer for layer in range(config.num_layers) if config.kind(layer) == "state"]
        if not layers:
            heads = (config.num_heads, config.head_dim, config.head_dim)
            return torch.zeros((0, *heads), dtype=config.torch_dtype, device=self.model.device)
        return torch.stack([self._states[layer] for layer in layers])

    def _attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        config = self.model.config
        if config.kind(layer) == "state":
            outs = []
            for token in range(q.shape[0]):
                self._states[layer], out = recur(self._states[layer], q[token], k[token], v[token])
                outs.append(out)
            return torch.stack(outs)
        self._keys[layer].append(k)
        self._values[layer].append(v)
        all_k, all_v = torch.cat(self._keys[layer]), torch.cat(self._values[layer])
        if config.kv_groups > 1:  # grouped-query: each K/V head serves `kv_groups` query heads
            all_k = all_k.repeat_interleave(config.kv_groups, dim=1)
            all_v = all_v.repeat_interleave(config.kv_groups, dim=1)
        num_queries, num_keys = q.shape[0], all_k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, all_k) * self._scale
        # Causal: query i sits at position num_keys - num_queries + i.
        causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(
            num_keys - num_queries
        )
        if config.kind(layer) == "window":  # and no further back than the window
            causal &= ~causal.tril(num_keys - num_queries - config.window)
        scores = scores.masked_fill(~causal, -torch.inf)
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), all_v)


class Prefilled(NamedTuple):
    """What a prefill server hands over for one prompt (see `prefill_alone`)."""

    token: int  # the token after the prompt
    k: torch.Tensor  # [kv layers (full and window, in layer order), len(prompt), heads, head_dim]
    v: torch.Tensor  # the same
    states: torch.Tensor  # [state layers, heads, head_dim, head_dim]: after the last token


def prefill_alone(
    model: LanguageModel, prompt: Sequence[int], sampling: SamplingParams = GREEDY
) -> Prefilled:
    """What a prefill server hands over: the token after `prompt`, its K and V, and its states.

    The token is sampled as the oracle samples its first (at position
    `len(prompt)`, with `sampling`); K and V are those of every prompt
    position, for each layer that keeps K/V. Which of them a decode server
    keeps (a window layer's tail only) is its own business (`transfer_targets`).

    >>> from batchstate.engine._model import ModelConfig, make_model
    >>> token, k, v, states = prefill_alone(make_model(ModelConfig()), (5, 6, 7))
    >>> tuple(k.shape) == tuple(v.shape) == (2, 3, 4, 8), tuple(states.shape)
    (True, (0, 4, 8, 8))
    """
    run = AloneRun(model, sampling)
    token = run.next_token(prompt)
    return Prefilled(token, *run.kv(), run.states())
