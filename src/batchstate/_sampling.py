"""The standard column set: each request's sampling parameters, carried per row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import attrs
import numpy as np
import torch

from batchstate._columns import Columns, build_columns
from batchstate._mirrored import Mirrored

__all__ = ["GREEDY", "Sampling", "SamplingParams"]


@final
@attrs.frozen
class SamplingParams:
    """One request's sampling parameters, as an engine receives them.

    Args:
        temperature: 0 samples greedily (the most likely token).
        top_p: keep the smallest set of tokens whose probability reaches it.
        top_k: keep the `top_k` most likely tokens; 0 keeps all.
        min_p: drop tokens less likely than `min_p` times the most likely.
        seed: the request's own random stream, so its tokens do not depend
            on what it is batched with.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0


GREEDY = SamplingParams()


@final
@attrs.frozen(eq=False)
class Sampling(Columns):
    """Sampling parameters as per-row columns, mirrored: kernels read the device sides,
    host code (a seeded generator per request) the host sides.

    >>> params = [SamplingParams(0.7, top_k=40, seed=1), GREEDY]
    >>> Sampling.of(params, torch.device("cpu")).top_k.host.tolist()
    [40, 0]
    """

    temperature: Mirrored[np.float32]
    top_p: Mirrored[np.float32]
    top_k: Mirrored[np.int32]
    min_p: Mirrored[np.float32]
    seed: Mirrored[np.int64]

    @staticmethod
    def of(params: Sequence[SamplingParams], device: torch.device) -> Sampling:
        """The columns of new rows, one `SamplingParams` each, in one host-to-device copy."""
        return build_columns(
            Sampling,
            {
                "temperature": [p.temperature for p in params],
                "top_p": [p.top_p for p in params],
                "top_k": [p.top_k for p in params],
                "min_p": [p.min_p for p in params],
                "seed": [p.seed for p in params],
            },
            device,
        )
