"""A device tensor and its host mirror, as one value; and device tensors with no mirror.

Host mirrors are read-only numpy arrays: on arrays of 8-256 elements a numpy
op costs 0.2-0.6 µs where the same op on a CPU torch tensor costs 1.1-1.9 µs
of dispatcher overhead (measured with `timeit` on the benchmark machine), and
a read-only array makes `pair.host[0] = 5` raise instead of desynchronising
the two sides. Device sides are torch tensors, built from host values by
`upload`: one host-to-device copy for every column a transition builds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Final, Generic, Self, final

import attrs
import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import TypeVar

from batchstate.base.read_only import read_only_copies
from batchstate.base.setters import new_record, slot_setters

__all__ = [
    "NO_INTS",
    "DeviceOnly",
    "HostArray",
    "Mirrored",
    "frozen",
    "gather_rows",
    "host_int64",
    "same",
    "upload",
    "writing",
]

Scalar = TypeVar("Scalar", bound=np.generic, default=np.int64)
HostArray = npt.NDArray[np.int64]  # a 1-D int64 host array: slots, lengths, ids


@read_only_copies
@final
@attrs.frozen(eq=False, init=False, repr=False)
class Mirrored(Generic[Scalar]):
    """A device tensor and its read-only numpy mirror, built together and never apart.

    There is no public way to build or replace one side alone: the
    constructors take host data and copy it to the device, and every
    operation computes the new host side, then uploads it, so the host never
    reads the device. The host side cannot be written (`writeable` is off).
    On a CPU device the two sides never share memory, so a device side that
    a transition forgot to build cannot pass for the host side.

    >>> seq_lens = Mirrored.from_ints([3, 5], torch.device("cpu"))
    >>> seq_lens
    Mirrored(shape=(2,), dtype=torch.int64, device=cpu)
    >>> seq_lens.add(1).host.tolist()
    [4, 6]
    >>> seq_lens.host[0] = 7
    Traceback (most recent call last):
    ...
    ValueError: assignment destination is read-only
    """

    host: npt.NDArray[Scalar]  # read-only, same shape and dtype as `device`
    device: torch.Tensor  # on the batch's device

    @classmethod
    def from_host(cls, host: npt.NDArray[Scalar], device: torch.device) -> Mirrored[Scalar]:
        """Mirror a copy of a 1-D numpy array on `device`."""
        return cls.from_hosts((host,), device)[0]

    @classmethod
    def from_hosts(
        cls, hosts: Sequence[npt.NDArray[Scalar]], device: torch.device
    ) -> list[Mirrored[Scalar]]:
        """Mirror copies of several 1-D numpy arrays with one host-to-device copy.

        Raises:
            ValueError: a source is not a 1-D numpy array (a torch tensor, say:
                one on a device would have to be read to be mirrored).
        """
        for source in hosts:
            _expect_vector(source)
        copies = [frozen(np.array(host, copy=True)) for host in hosts]
        return [
            cls.trusted(host, side)
            for host, side in zip(copies, upload(copies, device), strict=True)
        ]

    @classmethod
    def from_ints(cls, values: Sequence[int], device: torch.device) -> Mirrored[np.int64]:
        """Mirror a list of Python ints as a 1-D int64 pair."""
        host = host_int64(values)
        return Mirrored.trusted(host, upload((host,), device)[0])

    @classmethod
    def empty(cls, dtype: type[Scalar], device: torch.device) -> Mirrored[Scalar]:
        """A pair with zero rows."""
        host: npt.NDArray[Scalar] = frozen(np.empty(0, dtype=dtype))
        return cls.trusted(host, torch.empty(0, dtype=torch_dtype(host.dtype), device=device))

    @classmethod
    def trusted(cls, host: npt.NDArray[Scalar], device: torch.Tensor) -> Mirrored[Scalar]:
        # NOTE: the only place both sides are set; callers pass a frozen host
        # array and the device tensor uploaded from it. Unrolled attrs init,
        # through the slots' own setters: a quarter cheaper than
        # `object.__setattr__`, which looks each slot up by name first.
        pair = new_record(Mirrored)
        _set_host(pair, host)
        _set_device(pair, device)
        return pair

    def __len__(self) -> int:
        return int(self.host.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """The device side's dtype (the host side's, in torch's terms)."""
        return self.device.dtype

    def take(self, index: npt.NDArray[np.int64]) -> Mirrored[Scalar]:
        """Rows at host positions `index`, computed on the host, then uploaded."""
        return self._from_new_host(self.host.take(index))

    def cat(self, other: Mirrored[Scalar]) -> Mirrored[Scalar]:
        """This pair's rows followed by `other`'s."""
        return self._from_new_host(np.concatenate((self.host, other.host)))

    def add(self, value: int) -> Mirrored[Scalar]:
        """Add a host scalar to every element."""
        return self._from_new_host(self.host + value)

    def _from_new_host(self, host: npt.NDArray[Scalar]) -> Mirrored[Scalar]:
        # `host` is a fresh array no one else holds: freeze it instead of copying.
        return Mirrored.trusted(frozen(host), upload((host,), self.device.device)[0])

    def __repr__(self) -> str:
        return describe("Mirrored", self.device)


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
    def from_host(cls, host: npt.NDArray[np.generic], device: torch.device) -> Self:
        """Copy a numpy array to `device` and keep only the device side."""
        return cls(upload((host,), device)[0])

    @classmethod
    def empty(cls, dtype: torch.dtype, device: torch.device) -> Self:
        """Zero rows of `dtype`."""
        return cls(torch.empty(0, dtype=dtype, device=device))

    def take(self, index: Mirrored) -> DeviceOnly:
        """Rows at `index`, gathered on the device (the host does not know them)."""
        return DeviceOnly(gather_rows(self.device, index.device))

    def cat(self, other: DeviceOnly) -> DeviceOnly:
        """This tensor's rows followed by `other`'s."""
        return DeviceOnly(torch.cat((self.device, other.device)))

    def __repr__(self) -> str:
        return describe("DeviceOnly", self.device)


def upload(hosts: Sequence[npt.NDArray[np.generic]], device: torch.device) -> list[torch.Tensor]:
    """Device copies of 1-D host arrays, in one host-to-device copy.

    Off the CPU the arrays are packed into one byte buffer (pinned on CUDA),
    copied without waiting, and each device tensor is a view of its bytes,
    widest dtype first so that every view is aligned. On the CPU each array
    is copied on its own, which costs less than packing and slicing there;
    either way the device side never shares memory with the host side.
    """
    if device.type == "cpu":
        return [_from_numpy(host.copy()) for host in hosts]
    if not hosts:
        return []
    order = sorted(range(len(hosts)), key=lambda index: -hosts[index].dtype.itemsize)
    packed = np.concatenate([np.ascontiguousarray(hosts[index]).view(np.uint8) for index in order])
    staged = torch.from_numpy(packed)
    if device.type == "cuda":
        staged = staged.pin_memory()
    flat = staged.to(device, non_blocking=True)
    sides: list[torch.Tensor] = [flat] * len(hosts)
    start = 0
    for index in order:
        host = hosts[index]
        stop = start + host.nbytes
        dtype = torch_dtype(host.dtype)
        # An empty byte slice has no stride to reinterpret: build the empty column.
        sides[index] = (
            flat[start:stop].view(dtype) if stop > start else flat.new_empty(0, dtype=dtype)
        )
        start = stop
    return sides


def gather_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`tensor.index_select(0, index)` for every dtype a column may hold.

    torch (2.13) has no `index_select` for uint16, uint32 and uint64: those
    are gathered as the signed type of their width, through views (no copy,
    no extra kernel).
    """
    signed = _SIGNED.get(tensor.dtype)
    if signed is None:
        return tensor.index_select(0, index)
    return tensor.view(signed).index_select(0, index).view(tensor.dtype)


def frozen(array: npt.NDArray[Scalar]) -> npt.NDArray[Scalar]:
    """`array`, made read-only in place and returned: for arrays no one else writes.

    Like an attrs frozen instance, which `object.__setattr__` still gets
    past, a deliberate `array.flags.writeable = True` gets past this: what
    it stops is a write by mistake, `pair.host[0] = 5`.
    """
    array.setflags(write=False)  # a third cheaper than `flags.writeable = False`
    return array


class writing:  # noqa: N801  # a context manager, named for the `with` line it makes
    """`with writing(owner):` lets the block write `owner`, read-only otherwise.

    `owner` must own its memory. A class, not a generator: it costs a third.
    """

    __slots__ = ("owner",)

    def __init__(self, owner: npt.NDArray[np.generic]) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        self.owner.setflags(write=True)

    def __exit__(self, *_: object) -> None:
        self.owner.setflags(write=False)


def host_int64(values: Sequence[int]) -> HostArray:
    """A read-only 1-D int64 array from Python ints."""
    array = np.array(values, dtype=np.int64) if values else np.empty(0, dtype=np.int64)
    array.setflags(write=False)
    return array


NO_INTS: Final = host_int64([])  # read-only int64 [0], shared: nobody's slots, no pages


@functools.cache
def torch_dtype(dtype: np.dtype[np.generic]) -> torch.dtype:
    """The torch dtype of a numpy dtype."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def same(left: npt.NDArray[np.generic], right: npt.NDArray[np.generic]) -> bool:
    """Whether two host arrays hold the same values (shape and dtype included).

    A byte compare: a tenth of `(left == right).all()` at a batch's sizes,
    and exact for integers, which is what the transitions compare.
    """
    if left.dtype != right.dtype or left.shape != right.shape:
        return bool(np.array_equal(left, right))
    return left.tobytes() == right.tobytes()


_SIGNED: Final = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
_from_numpy = torch.from_numpy
_set_host, _set_device = slot_setters(Mirrored, "host", "device")  # past the frozen check


def _expect_vector(source: object) -> None:
    # Callers without mypy may hand a tensor or a list: say what a source must be.
    if not isinstance(source, np.ndarray) or source.ndim != 1:
        shape = f" of shape {source.shape}" if isinstance(source, np.ndarray) else ""
        raise ValueError(
            f"a mirror's source must be a 1-D numpy array, got {type(source).__name__}{shape}"
        )


def describe(kind: str, tensor: torch.Tensor) -> str:
    """Shape, dtype and device only: printing must never read the device."""
    return f"{kind}(shape={tuple(tensor.shape)}, dtype={tensor.dtype}, device={tensor.device})"
