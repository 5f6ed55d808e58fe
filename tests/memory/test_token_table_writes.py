"""TokenTable's row writes refuse mismatched slots and lengths, and its repr reads no device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchstate import Mirrored, TokenTable

CPU = torch.device("cpu")


def test_write_rows_writes_each_row_from_the_next_locations() -> None:
    table = TokenTable.zeros(3, 4, CPU, page_size=1, num_pages=8, first_gen=1)
    locs = Mirrored.from_host(np.array([7, 8, 9], dtype=np.int32), CPU)
    table.write_rows([2, 1], [1, 2], locs)
    expected = [[0, 0, 0, 0], [8, 9, 0, 0], [7, 0, 0, 0], [0, 0, 0, 0]]
    assert table.host.tolist() == expected
    assert table.device.tolist() == expected


def test_write_rows_with_fewer_lengths_than_slots_is_refused_and_writes_nothing() -> None:
    table = TokenTable.zeros(3, 4, CPU, page_size=1, num_pages=8, first_gen=1)
    locs = Mirrored.from_host(np.array([7, 8, 9], dtype=np.int32), CPU)
    with pytest.raises(ValueError, match="zip"):
        table.write_rows([1, 2], [3], locs)
    assert not table.host.any()
    assert not table.device.any()


def test_repr_names_the_table_and_its_device_side() -> None:
    table = TokenTable.zeros(4, 32, CPU, page_size=1, num_pages=8, first_gen=1)
    assert repr(table) == "TokenTable(shape=(5, 32), dtype=torch.int32, device=cpu)"
