"""The mutable baselines' sampling parameters, kept as SGLang's `SamplingBatchInfo` keeps them.

Modelled on SGLang 0.5.23's `SamplingBatchInfo` (`sglang/srt/sampling/
sampling_batch_info.py`): per-row device tensors with no host mirror
(`temperatures` as an (n, 1) float32 column, `top_ps`, `top_ks` int32,
`min_ps`, and `sampling_seed` int64, which SGLang carries under deterministic
inference), each uploaded from a Python list when a batch is extended
(`from_schedule_batch`), indexed on the device by `filter_batch` and
concatenated by `merge_batch`; and host flags (`is_all_greedy`,
`need_top_p_sampling`, ..., `max_top_k`) computed from the requests at extend,
combined on merge and left as they are on filter. These are the five values
batchstate's `Sampling` columns carry. What SGLang's class also maintains for
features `Sampling` does not have (penalizers, logit bias, grammars, custom
logit processors, returned sampling masks, watermarks) is left out, so the
baseline does less host work than SGLang's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

import torch

from batchstate import SamplingParams
from benchmarks.sampling_values import SamplingRow
from benchmarks.torch_host import to_device

__all__ = [
    "NO_SAMPLING_INFO",
    "NoSamplingInfo",
    "SampledReq",
    "SamplingBatchInfo",
    "SamplingInfo",
]


class SampledReq(Protocol):
    """A baseline's request object: it carries its parameters, as SGLang's `Req` does."""

    @property
    def sampling_params(self) -> SamplingParams:
        """Its parameters (a shared value, never read, in a benchmark without columns)."""


class SamplingBatchInfo:
    """One batch's sampling parameters, updated in place by `filter_batch` and `merge_batch`."""

    __slots__ = (
        "is_all_greedy",
        "is_any_greedy",
        "max_top_k",
        "min_ps",
        "need_min_p_sampling",
        "need_top_k_sampling",
        "need_top_p_sampling",
        "sampling_seed",
        "temperatures",
        "top_ks",
        "top_ps",
    )

    def __init__(self, params: Sequence[SamplingParams], device: torch.device) -> None:
        """`from_schedule_batch`: one upload per tensor from the requests' values."""
        self.temperatures = _upload([p.temperature for p in params], torch.float32, device).view(
            -1, 1
        )
        self.top_ps = _upload([p.top_p for p in params], torch.float32, device)
        self.top_ks = _upload([p.top_k for p in params], torch.int32, device)
        self.min_ps = _upload([p.min_p for p in params], torch.float32, device)
        self.sampling_seed = _upload([p.seed for p in params], torch.int64, device)
        # batchstate's conventions: temperature 0 samples greedily, top-k 0 keeps every token.
        self.is_all_greedy = all(p.temperature == 0.0 for p in params)
        self.is_any_greedy = any(p.temperature == 0.0 for p in params)
        self.need_top_p_sampling = any(p.top_p != 1.0 for p in params)
        self.need_top_k_sampling = any(p.top_k != 0 for p in params)
        self.need_min_p_sampling = any(p.min_p > 0 for p in params)
        bounded = bool(params) and all(p.top_k > 0 for p in params)
        self.max_top_k: int | None = max(p.top_k for p in params) if bounded else None

    def filter_batch(self, keep_indices: list[int], keep_indices_device: torch.Tensor) -> None:
        """Keep the rows at `keep_indices`: one device gather per tensor; the flags stay
        (each is a bound that still holds for the rows kept, as in SGLang)."""
        self.temperatures = self.temperatures[keep_indices_device]
        self.top_ps = self.top_ps[keep_indices_device]
        self.top_ks = self.top_ks[keep_indices_device]
        self.min_ps = self.min_ps[keep_indices_device]
        self.sampling_seed = self.sampling_seed[keep_indices_device]

    def merge_batch(self, other: SamplingInfo) -> None:
        """Append `other`'s rows: one device concatenation per tensor, the flags combined."""
        assert isinstance(other, SamplingBatchInfo)
        self.temperatures = torch.cat((self.temperatures, other.temperatures))
        self.top_ps = torch.cat((self.top_ps, other.top_ps))
        self.top_ks = torch.cat((self.top_ks, other.top_ks))
        self.min_ps = torch.cat((self.min_ps, other.min_ps))
        self.sampling_seed = torch.cat((self.sampling_seed, other.sampling_seed))
        self.is_all_greedy &= other.is_all_greedy
        self.is_any_greedy |= other.is_any_greedy
        self.need_top_p_sampling |= other.need_top_p_sampling
        self.need_top_k_sampling |= other.need_top_k_sampling
        self.need_min_p_sampling |= other.need_min_p_sampling
        mine, theirs = self.max_top_k, other.max_top_k
        self.max_top_k = None if mine is None or theirs is None else max(mine, theirs)

    def row_tensors(self) -> list[torch.Tensor]:
        """The per-row device tensors (for the bytes-per-request figure)."""
        return [self.temperatures, self.top_ps, self.top_ks, self.min_ps, self.sampling_seed]

    def values(self) -> list[SamplingRow]:
        """Each row's (temperature, top-p, top-k, min-p, seed), read back (tests only)."""
        return list(
            zip(
                self.temperatures.view(-1).tolist(),
                self.top_ps.tolist(),
                self.top_ks.tolist(),
                self.min_ps.tolist(),
                self.sampling_seed.tolist(),
                strict=True,
            )
        )


class NoSamplingInfo:
    """A batch without sampling parameters: filtering and merging have nothing to move."""

    __slots__ = ()

    def filter_batch(self, keep_indices: list[int], keep_indices_device: torch.Tensor) -> None:
        """Nothing to keep."""

    def merge_batch(self, other: SamplingInfo) -> None:
        """Nothing to append."""

    def row_tensors(self) -> list[torch.Tensor]:
        """No per-row tensors."""
        return []

    def values(self) -> list[SamplingRow]:
        """No rows of values."""
        return []


SamplingInfo = SamplingBatchInfo | NoSamplingInfo
NO_SAMPLING_INFO: Final = NoSamplingInfo()


def _upload(
    values: list[float] | list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    # As SGLang: `torch.tensor` of the Python list, then a copy that does not wait.
    return to_device(torch.tensor(values, dtype=dtype), device)
