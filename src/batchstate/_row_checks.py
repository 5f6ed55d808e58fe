"""Shape checks of a `Rows` and of the host arrays and device tensors records carry.

Each raises `RecordShapeError` naming the field that does not fit: the
wrong length, dtype or device, or a host array that is writable (it could
change without its device side).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from batchstate._column_checks import check_column_set
from batchstate._columns import C
from batchstate._errors import ColumnError, RecordShapeError

if TYPE_CHECKING:
    from batchstate._rows import Rows

__all__ = ["check_columns", "check_device", "check_host"]


def check_columns(rows: Rows[C]) -> None:
    """Raise `RecordShapeError` unless every column has `len(reqs)` rows, its dtype and device.

    Host sides must also be read-only numpy arrays: a writable one could be
    changed without its device side.
    """
    num_reqs = len(rows.reqs)
    hosts = (
        ("rids", rows.rids),
        ("gens", rows.gens),
        ("req_pool_indices.host", rows.req_pool_indices.host),
        ("seq_lens.host", rows.seq_lens.host),
    )
    for name, array in hosts:
        check_host(f"Rows.{name}", array, np.int64, num_reqs)
    devices = (
        ("req_pool_indices.device", rows.req_pool_indices.device, torch.int64),
        ("seq_lens.device", rows.seq_lens.device, torch.int64),
        ("orig_seq_lens", rows.orig_seq_lens.device, torch.int32),
    )
    for name, tensor, dtype in devices:
        check_device(f"Rows.{name}", tensor, dtype, num_reqs, rows.device)
    try:
        check_column_set(rows.columns, num_reqs, rows.device, "Rows")
    except ColumnError as error:
        raise RecordShapeError(str(error)) from error
    slots = rows.req_pool_indices.host
    if num_reqs and slots.min() < 1:
        raise RecordShapeError(
            f"Rows.req_pool_indices: slot {int(slots.min())} is padding (0) or negative"
        )


def check_host(name: str, array: object, dtype: type[np.generic], length: int) -> None:
    """Raise `RecordShapeError` unless `array` is a read-only numpy `dtype` array `[length]`."""
    if (
        not isinstance(array, np.ndarray)
        or array.shape != (length,)
        or array.dtype != dtype
        or array.flags.writeable
    ):
        got = (
            f"a {'writable' if array.flags.writeable else 'read-only'} {array.dtype}"
            f" array {list(array.shape)}"
            if isinstance(array, np.ndarray)
            else type(array).__name__
        )
        raise RecordShapeError(
            f"{name}: expected a read-only {np.dtype(dtype)} array [{length}], got {got}"
        )


def check_device(
    name: str, tensor: torch.Tensor, dtype: torch.dtype, length: int, device: torch.device
) -> None:
    """Raise `RecordShapeError` unless `tensor` is `dtype [length]` on `device`."""
    if tensor.shape != (length,) or tensor.dtype != dtype or tensor.device != device:
        raise RecordShapeError(
            f"{name}: expected {dtype} [{length}] on {device},"
            f" got {tensor.dtype} {list(tensor.shape)} on {tensor.device}"
        )
