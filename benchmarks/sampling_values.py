"""The sampling parameters of a benchmark with columns: the same values on every side.

Every request joins with `request_sampling(rid)`: batchstate's side builds its
`Sampling` columns from it, the mutable baselines their `SamplingBatchInfo`,
the floor its packed rows. `SamplingRow` is what the smoke tests compare: each
row's five values as the device holds them.
"""

from __future__ import annotations

from batchstate import Columns, Sampling, SamplingParams

__all__ = ["SamplingRow", "request_sampling", "sampling_rows"]

# One row's (temperature, top-p, top-k, min-p, seed).
SamplingRow = tuple[float, float, int, float, int]


def request_sampling(rid: int) -> SamplingParams:
    """The parameters request `rid` joins with (its seed: its id)."""
    return SamplingParams(0.7, top_p=0.9, top_k=40, seed=rid)


def sampling_rows(columns: Columns) -> list[SamplingRow]:
    """Each row's values, read from the device sides of batchstate's `Sampling` columns;
    none for another column set."""
    if not isinstance(columns, Sampling):
        return []
    return list(
        zip(
            columns.temperature.device.tolist(),
            columns.top_p.device.tolist(),
            columns.top_k.device.tolist(),
            columns.min_p.device.tolist(),
            columns.seed.device.tolist(),
            strict=True,
        )
    )
