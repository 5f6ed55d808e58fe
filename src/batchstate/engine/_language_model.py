"""What the engine asks of a model: hidden states through a given attention, MLPs, sampling.

The tiny transformer (`engine/_model.py`) and a Hugging Face architecture
(`engine/_hf_model.py`) both satisfy it, so the engine's kernels, its KV
cache, the draft model and data-parallel ranks run either unchanged.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from batchstate import Sampling
from batchstate.engine._model import Attend, FeedForward
from batchstate.engine._model_config import ModelConfig

__all__ = ["LanguageModel"]


class LanguageModel(Protocol):
    """A decoder whose attention is the caller's (see `Attend`) and whose MLPs can be split."""

    @property
    def config(self) -> ModelConfig:
        """Its sizes and architecture."""
        ...

    @property
    def device(self) -> torch.device:
        """Where its weights live."""
        ...

    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        feed_forward: FeedForward | None = None,
    ) -> torch.Tensor:
        """Final hidden states `[num_tokens, d_model]` of a flat run of tokens.

        `attend` stores each layer's K/V and attends; `feed_forward` runs each
        layer's MLP (None: `mlp`, here).
        """
        ...

    def mlp(self, layer: int, x: torch.Tensor, hidden_units: slice = slice(None)) -> torch.Tensor:
        """Layer `layer`'s MLP over normed states, through `hidden_units` of its width only."""
        ...

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy next token of each hidden state (argmax; ties go to the lowest id)."""
        ...

    def sample(
        self, hidden: torch.Tensor, sampling: Sampling | None, positions: npt.NDArray[np.int64]
    ) -> torch.Tensor:
        """Each hidden state's next token under its row's sampling parameters."""
        ...

    def first_layers(self, num_layers: int) -> LanguageModel:
        """The model cut to its first `num_layers` layers (a draft model), sharing weights."""
        ...
