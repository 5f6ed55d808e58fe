"""Checking a column set a record is built with: lengths, dtypes, devices, read-only hosts.

Records run `check_column_set` when they are built, so a set assembled by
hand (not by `build_columns`) is refused with a `ColumnError` naming the
column before any transition reads it. A packed set (`columns.columns`) is
checked pack by pack: a column is a view of its pack's row, so the pack's
shape, dtype, device and ownership are its columns'. A pack that fails is
checked again column by column, for the error to name the column.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate.base.errors import ColumnError
from batchstate.base.mirrored import DeviceOnly, Mirrored, frozen, torch_dtype
from batchstate.columns.columns import (
    C,
    Columns,
    Layout,
    NoColumns,
    Packed,
    _fields,
    layout,
    packed_of,
)

__all__ = ["check_column_set", "owned_host_columns"]


def owned_host_columns(columns: C) -> C:
    """`columns` with each host column that is a read-only view of a writable array copied.

    Its owner could still write the view, and the records would change under
    a passing check: an admission keeps a frozen copy instead. Anything else
    is returned as it is (`check_column_set` judges it).
    """
    given: object = columns  # callers without mypy may pass anything
    if not isinstance(given, Columns) or type(given) is NoColumns or packed_of(given):
        return columns  # a packed set owns its read-only packs
    copies = {
        field.name: frozen(value.copy())
        for field in _fields(type(columns))
        if field.kind == "host"
        and isinstance(value := getattr(columns, field.name), np.ndarray)
        and not value.flags.writeable
        and _writable_base(value)
    }
    return attrs.evolve(columns, **copies) if copies else columns  # type: ignore[misc]


def _writable_base(array: npt.NDArray[np.generic]) -> bool:
    base = array.base
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return True
        base = base.base
    return False


def check_column_set(columns: Columns, length: int, device: torch.device, where: str) -> None:
    """Raise `ColumnError` unless every column has `length` rows of its dtype, on `device`."""
    if type(columns) is NoColumns:
        return
    fields = _fields(type(columns))
    packed = packed_of(columns)
    if packed is not None and _packs_fit(packed, layout(type(columns)), length, device):
        fields = tuple(field for field in fields if field.kind == "device")  # not packed
    for field in fields:
        value = getattr(columns, field.name)
        name = f"{where}.{type(columns).__name__}.{field.name}"
        if field.kind == "mirrored" and isinstance(value, Mirrored):
            _check_host(name + ".host", value.host, field.dtype, length)
            _check_device(name + ".device", value.device, field.dtype, length, device)
        elif field.kind == "device" and isinstance(value, DeviceOnly):
            _check_device(name, value.device, None, length, device)
        elif field.kind == "host" and isinstance(value, np.ndarray):
            _check_host(name, value, field.dtype, length)
        else:
            raise ColumnError(f"{name}: expected a {field.kind} column, got {type(value).__name__}")


def _packs_fit(packed: Packed, known: Layout, length: int, device: torch.device) -> bool:
    if len(packed.hosts) != len(known.groups) or len(packed.devices) != len(known.mirrored):
        return False
    for host, group in zip(packed.hosts, known.groups, strict=True):
        if (
            host.shape != (len(group.names), length)
            or host.dtype != group.dtype
            or host.flags.writeable
            or _writable_base(host)
        ):
            return False
    if packed.devices and packed.start + length > packed.stride:
        return False
    for tensor, group in zip(packed.devices, known.mirrored, strict=True):
        if (
            tensor.shape != (len(group.names) * packed.stride,)
            or tensor.device != device
            or tensor.dtype != torch_dtype(group.dtype)
        ):
            return False
    return True


def _check_host(
    name: str, array: npt.NDArray[np.generic], dtype: np.dtype[np.generic] | None, length: int
) -> None:
    if array.shape != (length,) or array.dtype != dtype or array.flags.writeable:
        raise ColumnError(
            f"{name}: expected a read-only {dtype} array [{length}], got a"
            f" {'writable' if array.flags.writeable else 'read-only'} {array.dtype}"
            f" array {list(array.shape)}"
        )
    if _writable_base(array):
        # Its owner can still write it: the records would change under a passing check.
        # Admissions copy such a column first (`owned_host_columns`); a record built
        # by hand must own its arrays.
        raise ColumnError(
            f"{name}: a read-only view of a writable array; pass a copy"
            f" (`frozen(array.copy())`) or build the set with `build_columns`"
        )


def _check_device(
    name: str,
    tensor: torch.Tensor,
    dtype: np.dtype[np.generic] | None,
    length: int,
    device: torch.device,
) -> None:
    expected = None if dtype is None else torch_dtype(dtype)
    if (
        tensor.shape[:1] != (length,)
        or tensor.device != device
        or (expected is not None and tensor.dtype != expected)
    ):
        raise ColumnError(
            f"{name}: expected {expected or 'a tensor'} [{length}] on {device},"
            f" got {tensor.dtype} {list(tensor.shape)} on {tensor.device}"
        )
