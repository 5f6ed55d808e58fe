"""The standard column set: each request's sampling parameters, carried per row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import attrs
import numpy as np
import torch

from batchstate.base.mirrored import Mirrored
from batchstate.columns.building import build_columns
from batchstate.columns.columns import Columns
from batchstate.columns.sampling_params import GREEDY, SamplingParams

__all__ = ["GREEDY", "Sampling", "SamplingParams"]  # the parameters, with the set that carries them


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
