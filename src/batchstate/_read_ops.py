"""Which aten ops make the host wait for device data, and on which arguments.

The audit (`batchstate.audit`) sees every op through a dispatch mode and
asks `classify` whether it reads: each rule here was checked against what
torch's dispatcher passes for the host code that makes the read (see the
table in `batchstate.audit`). Only reads of data on a non-CPU device count.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from typing import Final

import torch

__all__ = ["ReadKind", "classify"]


class ReadKind(enum.Enum):
    """Why an op makes the host wait for the device."""

    SCALAR = "scalar"  # a Python value from device data
    COPY = "copy"  # device data copied into a CPU tensor
    SHAPE = "shape"  # an output shape that depends on device data


def classify(
    func: torch._ops.OpOverload, args: Sequence[object], kwargs: dict[str, object]
) -> tuple[ReadKind, torch.device] | None:
    """The kind of read `func` makes on these arguments, and the device it reads; None if none."""
    name = func.overloadpacket.__name__
    if name == "_to_copy":
        source, target = _tensor_at(args, 0), kwargs.get("device")
        if source is None or not isinstance(target, torch.device):
            return None
        return _read_if(ReadKind.COPY, source.device, target.type == "cpu")
    if name == "copy_":
        target_tensor, source = _tensor_at(args, 0), _tensor_at(args, 1)
        if target_tensor is None or source is None:
            return None
        return _read_if(ReadKind.COPY, source.device, target_tensor.device.type == "cpu")
    kind = _READ_OPS.get(name)
    if kind is None and name in _BOOL_INDEX_OPS:
        kind = ReadKind.SHAPE if _has_bool_index(args) else None
    if kind is None and name == "repeat_interleave":
        kind = ReadKind.SHAPE if kwargs.get("output_size") is None else None
    if kind is None:
        return None
    device = _first_device(args)
    return None if device is None else _read_if(kind, device, True)


def _read_if(
    kind: ReadKind, device: torch.device, condition: bool
) -> tuple[ReadKind, torch.device] | None:
    return (kind, device) if condition and device.type != "cpu" else None


def _tensor_at(args: Sequence[object], position: int) -> torch.Tensor | None:
    item = args[position] if len(args) > position else None
    return item if isinstance(item, torch.Tensor) else None


def _first_device(args: Sequence[object]) -> torch.device | None:
    # The first non-CPU tensor among the arguments (and inside list arguments).
    for item in _flat(args):
        if item.device.type != "cpu":
            return item.device
    return None


def _has_bool_index(args: Sequence[object]) -> bool:
    # `index`/`index_put_` take (self, indices: list[Tensor | None], ...).
    indices = args[1] if len(args) > 1 else None
    return isinstance(indices, list | tuple) and any(
        isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
        for index in indices
    )


def _flat(args: Sequence[object]) -> Iterator[torch.Tensor]:
    for item in args:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, list | tuple):
            yield from (inner for inner in item if isinstance(inner, torch.Tensor))


# Ops whose result depends on device data in a way the host must wait for.
_READ_OPS: Final[dict[str, ReadKind]] = {
    "_local_scalar_dense": ReadKind.SCALAR,
    "equal": ReadKind.SCALAR,
    "allclose": ReadKind.SCALAR,
    "nonzero": ReadKind.SHAPE,
    "nonzero_numpy": ReadKind.SHAPE,
    "_unique": ReadKind.SHAPE,
    "_unique2": ReadKind.SHAPE,
    "unique_dim": ReadKind.SHAPE,
    "unique_consecutive": ReadKind.SHAPE,
    "unique_dim_consecutive": ReadKind.SHAPE,
    "masked_select": ReadKind.SHAPE,
    "bincount": ReadKind.SHAPE,
}
# Indexing ops that turn a bool mask into indices (a `nonzero`) first.
_BOOL_INDEX_OPS: Final = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
