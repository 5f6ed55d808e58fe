"""Mirrored pairs and device-only tensors: built together, never printed with data."""

from __future__ import annotations

import pytest
import torch

from batchstate import DeviceOnly, Mirrored
from batchstate._mirrored import host_int64

META = torch.device("meta")
CPU = torch.device("cpu")


def _assert_pair(pair: Mirrored, expected: list[int]) -> None:
    assert pair.host.tolist() == expected
    assert pair.host.device == CPU
    assert pair.device.tolist() == expected


def test_from_ints_builds_both_sides_with_the_dtype() -> None:
    """One host source gives both sides, in the dtype asked for."""
    pair = Mirrored.from_ints([4, 1, 9], torch.int32, CPU)
    _assert_pair(pair, [4, 1, 9])
    assert pair.dtype == pair.device.dtype == torch.int32


def test_from_host_rejects_a_device_source() -> None:
    """A mirror's source must be host data: a device tensor as source would need a read."""
    with pytest.raises(ValueError, match="CPU tensor"):
        Mirrored.from_host(torch.zeros(2, device=META), CPU)


@pytest.mark.parametrize(
    ("operation", "expected"),
    [
        (lambda pair: pair.take(Mirrored.from_ints([0, 2], torch.int64, CPU)), [5, 7]),
        (lambda pair: pair.cat(Mirrored.from_ints([1], torch.int64, CPU)), [5, 6, 7, 1]),
        (lambda pair: pair.add(2), [7, 8, 9]),
        (lambda pair: pair.take(Mirrored.empty(torch.int64, CPU)), []),  # filter to empty
    ],
    ids=["take", "cat", "add", "take-none"],
)
def test_operations_return_new_pairs(operation: object, expected: list[int]) -> None:
    """take, cat and add act on both sides and leave the original pair as it was."""
    pair = Mirrored.from_ints([5, 6, 7], torch.int64, CPU)
    result = operation(pair)  # type: ignore[operator]  # parametrized callables
    _assert_pair(result, expected)
    _assert_pair(pair, [5, 6, 7])


def test_reprs_show_shape_dtype_device_and_never_data() -> None:
    """Printing a pair on meta works: a repr that read data would raise there."""
    pair = Mirrored.from_ints([1, 2], torch.int64, META)
    only = DeviceOnly.from_host(host_int64([3]), META)
    assert repr(pair) == "Mirrored(shape=(2,), dtype=torch.int64, device=meta)"
    assert repr(only) == "DeviceOnly(shape=(1,), dtype=torch.int64, device=meta)"


def test_empty_pairs_have_zero_rows_on_both_sides() -> None:
    """Empty pairs keep their dtype and device."""
    pair = Mirrored.empty(torch.int64, META)
    assert len(pair) == 0
    assert pair.host.shape == pair.device.shape == (0,)
    assert pair.device.device == META
    assert len(DeviceOnly.empty(torch.int32, META)) == 0


def test_host_int64_matches_torch_tensor() -> None:
    """The fast list conversion gives what torch.tensor gives, including for no values."""
    assert torch.equal(host_int64([3, -1, 2**40]), torch.tensor([3, -1, 2**40]))
    assert host_int64([]).dtype == torch.int64
