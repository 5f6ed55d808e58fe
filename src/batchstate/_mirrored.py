"""A device tensor and its host mirror, as one value; and device tensors with no mirror."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Self, final

import attrs
import torch

__all__ = ["DeviceOnly", "Mirrored", "host_int64", "overlap", "to_device"]


@final
@attrs.frozen(eq=False, init=False, repr=False)
class Mirrored:
    """A device tensor and its CPU mirror, built together and never apart.

    There is no public way to build or replace one side alone: the
    constructors take host data and copy it to the device, and every
    operation returns a new pair computed on both sides from both sides,
    so the host never reads the device.

    >>> seq_lens = Mirrored.from_ints([3, 5], torch.int64, torch.device("cpu"))
    >>> seq_lens
    Mirrored(shape=(2,), dtype=torch.int64, device=cpu)
    >>> seq_lens.add(1).host.tolist()
    [4, 6]
    """

    host: torch.Tensor  # CPU, same shape and dtype as `device`
    device: torch.Tensor  # on the batch's device

    @classmethod
    def from_host(cls, host: torch.Tensor, device: torch.device) -> Self:
        """Mirror a CPU tensor on `device` (pinned, non-blocking where `device` is CUDA)."""
        if not host.is_cpu:
            raise ValueError(f"a mirror's source must be a CPU tensor, got one on {host.device}")
        return cls._pair(host, to_device(host, device))

    @classmethod
    def from_hosts(cls, hosts: Sequence[torch.Tensor], device: torch.device) -> list[Self]:
        """Mirror several 1-D int64 CPU tensors with one host-to-device copy.

        Off the CPU each copy has a fixed cost; packing them pays it once.
        """
        if device.type == "cpu":
            return [cls._pair(host, host) for host in hosts]
        packed = to_device(torch.cat(tuple(hosts)), device)
        sides = torch.split(packed, [host.shape[0] for host in hosts])
        return [cls._pair(host, side) for host, side in zip(hosts, sides, strict=True)]

    @classmethod
    def from_ints(cls, values: Sequence[int], dtype: torch.dtype, device: torch.device) -> Self:
        """Mirror a list of Python ints as a 1-D tensor of `dtype`."""
        host = host_int64(values)
        return cls.from_host(host if dtype == torch.int64 else host.to(dtype), device)

    @classmethod
    def empty(cls, dtype: torch.dtype, device: torch.device) -> Self:
        """A pair with zero rows."""
        return cls._pair(torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype, device=device))

    @classmethod
    def _pair(cls, host: torch.Tensor, device: torch.Tensor) -> Self:
        # NOTE: the only place both sides are set; callers pass values computed
        # from the same source on each side.
        pair = cls.__new__(cls)
        pair.__attrs_init__(host, device)
        return pair

    def __len__(self) -> int:
        return self.host.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.host.dtype

    def unbind(self) -> tuple[Mirrored, ...]:
        """The rows of a 2-D pair as 1-D pairs (views, no copy)."""
        return tuple(
            Mirrored._pair(host, device)
            for host, device in zip(self.host.unbind(), self.device.unbind(), strict=True)
        )

    def take(self, index: Mirrored) -> Mirrored:
        """Rows at `index` (a mirrored int64 index), on both sides."""
        return Mirrored._pair(
            self.host.index_select(0, index.host), self.device.index_select(0, index.device)
        )

    def cat(self, other: Mirrored) -> Mirrored:
        """This pair's rows followed by `other`'s."""
        return Mirrored._pair(
            torch.cat((self.host, other.host)), torch.cat((self.device, other.device))
        )

    def add(self, value: int) -> Mirrored:
        """Add a host scalar to every element, on both sides."""
        return Mirrored._pair(self.host + value, self.device + value)

    def __repr__(self) -> str:
        return _describe("Mirrored", self.device)


@final
@attrs.frozen(eq=False, repr=False)
class DeviceOnly:
    """A device tensor the host never needs (`out_cache_loc`, `orig_seq_lens`).

    A distinct type from `Mirrored`, so that mypy rejects handing one to code
    that needs a host mirror.
    """

    device: torch.Tensor

    def __len__(self) -> int:
        return self.device.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.device.dtype

    @classmethod
    def from_host(cls, host: torch.Tensor, device: torch.device) -> Self:
        """Copy host data to `device` and keep only the device side."""
        return cls(to_device(host, device))

    @classmethod
    def empty(cls, dtype: torch.dtype, device: torch.device) -> Self:
        """Zero rows of `dtype`."""
        return cls(torch.empty(0, dtype=dtype, device=device))

    def take(self, index: Mirrored) -> DeviceOnly:
        """Rows at `index`, on the device."""
        return DeviceOnly(self.device.index_select(0, index.device))

    def cat(self, other: DeviceOnly) -> DeviceOnly:
        """This tensor's rows followed by `other`'s."""
        return DeviceOnly(torch.cat((self.device, other.device)))

    def add(self, value: int) -> DeviceOnly:
        """Add a host scalar to every element."""
        return DeviceOnly(self.device + value)

    def __repr__(self) -> str:
        return _describe("DeviceOnly", self.device)


def host_int64(values: Sequence[int]) -> torch.Tensor:
    """A 1-D CPU int64 tensor from Python ints.

    `torch.tensor(list)` costs ~0.1 µs per element; going through `array`
    costs a sixth of that, which shows at thousands of rows.
    """
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def overlap(values: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
    """The elements of 1-D host tensor `values` that are also in `among`, in order.

    `torch.isin` sorts and costs 35-150 µs on CPU; comparing every pair
    costs ~5 µs while one side is small (one request joining, one leaving).
    """
    if values.shape[0] * among.shape[0] > _MAX_PAIRS:
        return values[torch.isin(values, among)]
    pairs = values.unsqueeze(1) == among
    if not bool(pairs.any()):
        return values[:0]  # the usual answer, in two ops
    return values[pairs.any(1)]


_MAX_PAIRS = 1 << 16


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a CPU tensor to `device` without waiting (from pinned memory on CUDA)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _describe(kind: str, tensor: torch.Tensor) -> str:
    # Shape, dtype and device only: printing must never read the device.
    return f"{kind}(shape={tuple(tensor.shape)}, dtype={tensor.dtype}, device={tensor.device})"
