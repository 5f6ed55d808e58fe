"""A tiny transformer with seeded random weights, its attention left to the caller.

The model owns everything but attention: embeddings, rotary positions,
projections, MLPs and the unembedding. Attention is a callback, so the
engine's paged-cache path and the oracle's contiguous-cache path share every
other line and can differ only in how they store and gather K/V.
"""

from __future__ import annotations

import math
from typing import Protocol, final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate import Sampling
from batchstate.engine._model_config import ModelConfig
from batchstate.engine._sampler import sample_logits

__all__ = ["Attend", "FeedForward", "ModelConfig", "TinyModel", "make_model"]


class Attend(Protocol):
    """Attention for one layer: store `k`, `v` and attend `q` to everything stored.

    Args:
        layer: the layer index.
        q, k, v: `[num_tokens, num_heads, head_dim]`, rotary positions applied.

    Returns:
        `[num_tokens, num_heads, head_dim]`, each token's attention output.
    """

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class FeedForward(Protocol):
    """The MLP of one layer over normed hidden states: `TinyModel.mlp`, or one shared by ranks.

    Args:
        layer: the layer index.
        x: `[num_tokens, d_model]`, after the layer's MLP norm.

    Returns:
        `[num_tokens, d_model]`, the MLP's output for each token (before the residual add).
    """

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor: ...


@final
@attrs.frozen(eq=False)
class _Layer:
    attn_norm: torch.Tensor  # [d_model]
    wqkv: torch.Tensor  # [d_model, 3 * d_model]
    wo: torch.Tensor  # [d_model, d_model]
    mlp_norm: torch.Tensor  # [d_model]
    w_up: torch.Tensor  # [d_model, d_ff]
    w_down: torch.Tensor  # [d_ff, d_model]


@final
@attrs.frozen(eq=False)
class TinyModel:
    """A pre-norm decoder: RMSNorm, rotary attention, a GELU MLP. Build it with `make_model`."""

    config: ModelConfig
    device: torch.device
    embed: torch.Tensor  # [vocab_size, d_model]
    layers: tuple[_Layer, ...]
    final_norm: torch.Tensor  # [d_model]
    unembed: torch.Tensor  # [d_model, vocab_size]
    inv_freq: torch.Tensor  # [head_dim // 2], rotary frequencies

    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        feed_forward: FeedForward | None = None,
    ) -> torch.Tensor:
        """Final hidden states of a flat run of tokens.

        Args:
            input_ids: device int64 `[num_tokens]`.
            positions: device int64 `[num_tokens]`, each token's position in its request.
            attend: stores K/V and attends; see `Attend`.
            feed_forward: runs each layer's MLP; None runs `mlp` here, on these tokens.

        Returns:
            `[num_tokens, d_model]` in the model's dtype, after the final norm.
        """
        config = self.config
        mlp = self.mlp if feed_forward is None else feed_forward
        x = self.embed[input_ids]
        cos, sin = self._rotary(positions)
        for index, layer in enumerate(self.layers):
            qkv = _rms_norm(x, layer.attn_norm) @ layer.wqkv
            q, k, v = qkv.view(-1, 3, config.num_heads, config.head_dim).unbind(1)
            out = attend(index, _rotate(q, cos, sin), _rotate(k, cos, sin), v)
            x = x + out.reshape(-1, config.d_model) @ layer.wo
            x = x + mlp(index, _rms_norm(x, layer.mlp_norm))
        return _rms_norm(x, self.final_norm)

    def mlp(self, layer: int, x: torch.Tensor, hidden_units: slice = slice(None)) -> torch.Tensor:
        """Layer `layer`'s MLP over normed states `x`, through `hidden_units` of its width only.

        The MLP is a sum over its hidden units, so the outputs of disjoint
        slices that cover the width add up to the whole MLP (up to rounding):
        that is how ranks share it.
        """
        weights = self.layers[layer]
        up = weights.w_up[:, hidden_units]
        return torch.nn.functional.gelu(x @ up) @ weights.w_down[hidden_units]

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy next token of each hidden state: device int64 `[num_rows]`."""
        return (hidden @ self.unembed).argmax(dim=-1)

    def sample(
        self, hidden: torch.Tensor, sampling: Sampling | None, positions: npt.NDArray[np.int64]
    ) -> torch.Tensor:
        """Each hidden state's next token under its row's sampling parameters.

        Args:
            hidden: `[num_rows, d_model]`.
            sampling: the rows' `Sampling` columns; None samples every row greedily.
            positions: host int64 `[num_rows]`, the position of each sampled token,
                which with the row's seed picks its draw (see `engine/_sampler.py`).

        Returns:
            device int64 `[num_rows]`; greedy rows get exactly `greedy`'s token.
        """
        if sampling is None:
            return self.greedy(hidden)
        return sample_logits(hidden @ self.unembed, sampling, positions)

    def first_layers(self, num_layers: int) -> TinyModel:
        """The model cut to its first `num_layers` layers, with its embeddings and unembedding."""
        kinds = self.config.layer_kinds[:num_layers]
        config = attrs.evolve(self.config, num_layers=num_layers, layer_kinds=kinds)
        return attrs.evolve(self, config=config, layers=self.layers[:num_layers])

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(self.config.torch_dtype)[:, None] * self.inv_freq[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]


def make_model(config: ModelConfig, device: torch.device | str = "cpu") -> TinyModel:
    """A model with weights drawn from `config.seed`, the same on every device.

    >>> model = make_model(ModelConfig(vocab_size=16, d_model=8, num_heads=2, d_ff=8))
    >>> model.embed.shape, len(model.layers)
    (torch.Size([16, 8]), 2)
    """
    if config.architecture != "tiny" or config.kv_groups != 1:
        raise ValueError(f"{config} is not the tiny model's (architecture 'tiny', kv_groups 1)")
    if config.d_model % config.num_heads or config.head_dim % 2:
        raise ValueError(f"d_model={config.d_model} must split into heads of even size")
    if config.layer_kinds and len(config.layer_kinds) != config.num_layers:
        raise ValueError(f"{len(config.layer_kinds)} layer kinds for {config.num_layers} layers")
    if config.window < 1:
        raise ValueError(f"a window of {config.window} positions: it must be >= 1")
    generator = torch.Generator().manual_seed(config.seed)
    d, ff = config.d_model, config.d_ff

    def weight(rows: int, cols: int) -> torch.Tensor:
        # Drawn on the CPU so the weights do not depend on the device's RNG.
        scale = 1.0 / math.sqrt(rows)
        drawn = torch.randn(rows, cols, generator=generator, dtype=torch.float64) * scale
        return drawn.to(device=device, dtype=config.torch_dtype)

    def norm() -> torch.Tensor:
        return torch.ones(d, dtype=config.torch_dtype, device=device)

    def qkv() -> torch.Tensor:
        # Sharper queries and keys: attention then depends on positions and content
        # enough that greedy outputs stay varied instead of settling on one token.
        return torch.cat((weight(d, 2 * d) * 3.0, weight(d, d)), dim=1)

    layers = tuple(
        _Layer(norm(), qkv(), weight(d, d), norm(), weight(d, ff), weight(ff, d))
        for _ in range(config.num_layers)
    )
    half = config.head_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    return TinyModel(
        config,
        torch.device(device),
        # Embeddings with unit-scale rows, so each token moves the residual stream.
        weight(config.vocab_size, d) * math.sqrt(config.vocab_size),
        layers,
        norm(),
        weight(d, config.vocab_size) * 4.0,
        inv_freq.to(device=device, dtype=config.torch_dtype),
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotary embedding, rotate-half form: pairs (i, i + half) turn by position * freq.
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
