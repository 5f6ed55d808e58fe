"""What a mirror may be built from, and device-only columns taken and joined on the device."""

from __future__ import annotations

import re
from typing import Final

import numpy as np
import pytest
import torch

from batchstate import DeviceOnly, Mirrored
from batchstate.base.mirrored import torch_dtype

CPU: Final = torch.device("cpu")


@pytest.mark.parametrize(
    ("source", "described"),
    [
        (np.zeros((2, 2), dtype=np.int64), "ndarray of shape (2, 2)"),
        ([1, 2], "list"),
        (torch.zeros(2, dtype=torch.int64), "Tensor"),
    ],
)
def test_a_bad_source_is_named_in_the_error(source: object, described: str) -> None:
    message = f"a mirror's source must be a 1-D numpy array, got {described}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Mirrored.from_host(source, CPU)  # type: ignore[arg-type]  # what mypy would refuse


def test_device_only_take_gathers_rows_on_the_device() -> None:
    column = DeviceOnly(torch.tensor([10, 11, 12, 13]))
    index = Mirrored.from_ints([3, 0, 2], CPU)
    taken = column.take(index)
    assert taken.device.tolist() == [13, 10, 12]
    assert column.device.tolist() == [10, 11, 12, 13]


def test_device_only_cat_joins_rows_in_order() -> None:
    first = DeviceOnly(torch.tensor([1, 2], dtype=torch.int32))
    joined = first.cat(DeviceOnly(torch.tensor([3], dtype=torch.int32)))
    assert joined.device.tolist() == [1, 2, 3]
    assert joined.dtype == torch.int32
    assert len(joined) == 3


@pytest.mark.parametrize(
    ("numpy_dtype", "expected"),
    [(np.int16, torch.int16), (np.float16, torch.float16), (np.uint8, torch.uint8)],
)
def test_torch_dtype_names_numpy_dtypes_in_torch_terms(
    numpy_dtype: type[np.generic], expected: torch.dtype
) -> None:
    # The function behind the cache: cached answers would hide what it computes.
    assert torch_dtype.__wrapped__(np.dtype(numpy_dtype)) == expected
