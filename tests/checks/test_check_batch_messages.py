"""check_batch and check_pools name what they find broken in records built or changed by hand."""

from __future__ import annotations

import warnings
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    DeviceOnly,
    Filtered,
    Mirrored,
    Req,
    check_batch,
    check_pools,
    decode,
    extend,
    filter_batch,
    idle,
    make_pools,
)
from batchstate.base.mirrored import host_int64
from tests.strategies import raises_exactly

CPU = torch.device("cpu")


def _filtered() -> Filtered:
    reqs = [Req(0, (1, 2, 3)), Req(1, (4,))]
    batch, _ = extend(idle(CPU), reqs, make_pools(4, 32, 64, CPU)).unwrap()
    return filter_batch(batch, [0, 1])


def test_rids_other_than_the_reqs() -> None:
    rows = attrs.evolve(_filtered().rows, rids=host_int64([5, 6]))
    with raises_exactly("rids differ from the reqs' rids"):
        check_batch(Filtered(rows))


def test_a_wrong_longest_row() -> None:
    rows = attrs.evolve(_filtered().rows, max_seq_len=9)
    with raises_exactly("max_seq_len=9 differs from seq_lens"):
        check_batch(Filtered(rows))


def test_a_column_changed_after_construction() -> None:
    batch = _filtered()
    object.__setattr__(batch.rows, "rids", np.array([0, 1]))  # writable, past the checks
    with raises_exactly(
        "Rows.rids: expected a read-only int64 array [2], got a writable int64 array [2]"
    ):
        check_batch(batch)


def test_an_extended_batch_whose_lengths_do_not_add_up() -> None:
    batch, _ = extend(idle(CPU), [Req(0, (1, 2, 3))], make_pools(4, 32, 64, CPU)).unwrap()
    object.__setattr__(batch, "prefix_lens", (1,))  # frozen: past the constructor's checks
    with raises_exactly("seq_lens differ from prefix_lens + extend_lens"):
        check_batch(batch)


def test_a_table_whose_sides_differ() -> None:
    batch, pools = extend(idle(CPU), [Req(0, (1, 2))], make_pools(4, 32, 64, CPU)).unwrap()
    check_pools(pools, [batch], compare_device=True)
    pools.table.device[1, 5] = 7
    with raises_exactly("table: host != device"):
        check_pools(pools, [batch], compare_device=True)


def test_a_row_in_the_top_slot_at_another_length() -> None:
    reqs = [Req(rid, (1, 2, 3)) for rid in range(4)]
    batch, _ = extend(idle(CPU), reqs, make_pools(4, 32, 64, CPU)).unwrap()
    last = filter_batch(batch, [3])  # slot 4, the top one
    with raises_exactly("slot 4: row has 3 tokens, the pools hold 0"):
        check_pools(make_pools(4, 32, 64, CPU), [last])


def _with_device_side(name: str, device: torch.Tensor, host: np.ndarray) -> Filtered:
    changes: dict[str, Any] = {name: Mirrored.trusted(host, device)}
    return Filtered(attrs.evolve(_filtered().rows, **changes))


@pytest.mark.parametrize("name", ["req_pool_indices", "seq_lens"])
def test_a_device_side_with_other_values(name: str) -> None:
    host = getattr(_filtered().rows, name).host
    batch = _with_device_side(name, torch.tensor([9, 9]), host)
    check_batch(batch)  # the host side alone is consistent
    with raises_exactly(f"{name}: host mirror != device"):
        check_batch(batch, compare_device=True)


@pytest.mark.parametrize("name", ["req_pool_indices", "seq_lens"])
def test_a_device_side_sharing_the_host_memory(name: str) -> None:
    """On the CPU a mirror's two sides must be two buffers: a write to one is not the other."""
    cells = getattr(_filtered().rows, name).host.copy()
    device = torch.from_numpy(cells)  # the same memory
    cells.flags.writeable = False
    # Built by hand, the rows take their own copy of the host side: two buffers again.
    batch = _with_device_side(name, device, cells)
    assert not np.shares_memory(getattr(batch.rows, name).host, device.numpy())
    check_batch(batch, compare_device=True)
    # Rows a transition built unchecked, pairing the two itself, are caught.
    shared = getattr(batch.rows, name).host
    with warnings.catch_warnings():  # torch's warning that the array is read-only
        warnings.simplefilter("ignore", UserWarning)
        object.__setattr__(batch.rows, name, Mirrored.trusted(shared, torch.from_numpy(shared)))
    with raises_exactly(f"{name}: the device side shares the host side's memory"):
        check_batch(batch, compare_device=True)


def test_original_lengths_other_than_the_lengths() -> None:
    rows = attrs.evolve(
        _filtered().rows, orig_seq_lens=DeviceOnly(torch.tensor([3, 2], dtype=torch.int32))
    )
    check_batch(Filtered(rows))  # a device column: compared only with compare_device
    with raises_exactly("orig_seq_lens != seq_lens"):
        check_batch(Filtered(rows), compare_device=True)


def test_a_decode_writing_one_location_twice() -> None:
    extended, pools = extend(
        idle(CPU), [Req(0, (1, 2)), Req(1, (3,))], make_pools(4, 32, 64, CPU)
    ).unwrap()
    decoding, _ = decode(extended, pools).unwrap()
    twice = attrs.evolve(decoding, out_cache_loc=DeviceOnly(torch.tensor([5, 5])))
    check_batch(twice)  # a device column: compared only with compare_device
    with raises_exactly("out_cache_loc repeats a location"):
        check_batch(twice, compare_device=True)
