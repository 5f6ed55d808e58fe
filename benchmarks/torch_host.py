"""Torch host helpers for the baselines, which keep their mirrors as CPU tensors.

batchstate's own host mirrors are numpy; the baselines stay as engines write
them today, so they carry these two helpers themselves.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

__all__ = ["host_int64", "to_device"]


def host_int64(values: Sequence[int]) -> torch.Tensor:
    """A 1-D CPU int64 tensor from Python ints (via `array`: a sixth of `torch.tensor`'s cost)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a CPU tensor to `device` without waiting (from pinned memory on CUDA)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
