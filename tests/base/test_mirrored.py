"""Mirrored pairs and device-only tensors: built together, read-only, never printed with data."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest
import torch
from benchmarks.counting import count_device_work

from batchstate import DeviceOnly, Mirrored
from batchstate.base.mirrored import host_int64, upload

META = torch.device("meta")
CPU = torch.device("cpu")


def _assert_pair(pair: Mirrored, expected: list[int]) -> None:
    assert pair.host.tolist() == expected
    assert isinstance(pair.host, np.ndarray)
    assert not pair.host.flags.writeable
    assert pair.device.tolist() == expected
    assert not np.shares_memory(pair.host, pair.device.numpy())


def test_from_ints_builds_both_sides() -> None:
    """One host source gives both sides, int64."""
    pair = Mirrored.from_ints([4, 1, 9], CPU)
    _assert_pair(pair, [4, 1, 9])
    assert pair.dtype == pair.device.dtype == torch.int64
    assert pair.host.dtype == np.int64


def test_from_host_copies_and_keeps_the_dtype() -> None:
    """A caller's array is copied: writing it later changes neither side."""
    source = np.array([2.5, 1.0], dtype=np.float32)
    pair = Mirrored.from_host(source, CPU)
    source[0] = 9.0
    assert pair.host.tolist() == pair.device.tolist() == [2.5, 1.0]
    assert pair.device.dtype == torch.float32


@pytest.mark.parametrize(
    "source", [torch.zeros(2, device=META), torch.zeros(2), np.zeros((2, 2)), [1, 2]]
)
def test_from_host_rejects_what_is_not_a_1d_array(source: object) -> None:
    """A mirror's source is a 1-D numpy array: a device tensor as source would need a read."""
    with pytest.raises(ValueError, match="1-D numpy array"):
        Mirrored.from_host(source, CPU)  # type: ignore[arg-type]  # the point of the test


def test_writing_a_host_side_raises() -> None:
    """The host side is read-only, so it cannot drift from the device side."""
    pair = Mirrored.from_ints([1, 2, 3], CPU)
    with pytest.raises(ValueError, match="read-only"):
        pair.host[0] = 5
    assert pair.host.tolist() == pair.device.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    ("operation", "expected"),
    [
        (lambda pair: pair.take(np.array([0, 2])), [5, 7]),
        (lambda pair: pair.cat(Mirrored.from_ints([1], CPU)), [5, 6, 7, 1]),
        (lambda pair: pair.add(2), [7, 8, 9]),
        (lambda pair: pair.take(np.array([], dtype=np.int64)), []),  # filter to empty
    ],
    ids=["take", "cat", "add", "take-none"],
)
def test_operations_return_new_pairs(
    operation: Callable[[Mirrored], Mirrored], expected: list[int]
) -> None:
    """take, cat and add act on both sides and leave the original pair as it was."""
    pair = Mirrored.from_ints([5, 6, 7], CPU)
    result = operation(pair)
    _assert_pair(result, expected)
    _assert_pair(pair, [5, 6, 7])


def test_upload_is_one_copy_with_aligned_views_of_every_dtype() -> None:
    """Off the CPU, mixed dtypes (empty ones too) go up in one copy; no other device work."""
    hosts: list[npt.NDArray[np.generic]] = [
        np.array([1, 2], dtype=np.int32),
        np.array([3, 4, 5], dtype=np.int64),
        np.array([], dtype=np.int64),
        np.array([0.5], dtype=np.float32),
        np.array([True, False, True], dtype=np.bool_),
    ]
    with count_device_work() as work:
        sides = upload(hosts, META)
    assert (work.copies, work.kernels) == (1, 0)
    for host, side in zip(hosts, sides, strict=True):
        assert side.device == META
        assert side.shape == host.shape
        assert side.dtype == torch.from_numpy(host).dtype


def test_reprs_show_shape_dtype_device_and_never_data() -> None:
    """Printing a pair on meta works: a repr that read data would raise there."""
    pair = Mirrored.from_ints([1, 2], META)
    only = DeviceOnly.from_host(host_int64([3]), META)
    assert repr(pair) == "Mirrored(shape=(2,), dtype=torch.int64, device=meta)"
    assert repr(only) == "DeviceOnly(shape=(1,), dtype=torch.int64, device=meta)"


def test_empty_pairs_have_zero_rows_on_both_sides() -> None:
    """Empty pairs keep their dtype and device."""
    pair = Mirrored.empty(np.int64, META)
    assert len(pair) == 0
    assert pair.host.shape == (0,)
    assert pair.device.shape == (0,)
    assert pair.device.device == META
    assert not pair.host.flags.writeable
    assert len(DeviceOnly.empty(torch.int32, META)) == 0


def test_host_int64_is_a_read_only_int64_array() -> None:
    """The list conversion gives int64 values, read-only, including for no values."""
    values = host_int64([3, -1, 2**40])
    assert values.tolist() == [3, -1, 2**40]
    assert values.dtype == host_int64([]).dtype == np.int64
    assert not values.flags.writeable
