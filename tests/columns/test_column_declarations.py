"""How a column set's declaration is read, and how its values are built and checked.

Each test declares its column set inside the test: a class is read once and
its fields cached, so a fresh class is what makes the declaration be read
again here.
"""

from __future__ import annotations

import re
from typing import Final, TypeAlias

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    ColumnError,
    Columns,
    DeviceOnly,
    HostColumn,
    Mirrored,
    Req,
    Rows,
    build_columns,
)
from batchstate.columns.arguments import check_column_set

CPU: Final = torch.device("cpu")
# Names that only this module knows: a declaration written with them resolves
# through the module the class is defined in.
Budget: TypeAlias = HostColumn[np.int32]
Weight: TypeAlias = Mirrored[np.float32]


def test_a_declaration_resolves_names_from_its_own_module() -> None:
    @attrs.frozen(eq=False)
    class Aliased(Columns):
        budget: Budget
        weight: Weight

    columns = build_columns(Aliased, {"budget": [7, 8], "weight": [0.5, 1.5]}, CPU)
    assert columns.budget.dtype == np.int32
    assert columns.budget.tolist() == [7, 8]
    assert columns.weight.device.dtype == torch.float32
    assert columns.weight.device.tolist() == [0.5, 1.5]


def test_every_kind_of_column_is_built_with_its_declared_dtype() -> None:
    """Host-only first: the device copies go to the mirrored and device-only columns."""

    @attrs.frozen(eq=False)
    class Mixed(Columns):
        budget: HostColumn[np.int32]
        ids: Mirrored  # no dtype: int64
        lora: DeviceOnly
        scale: Mirrored[np.float32]

    columns = build_columns(
        Mixed,
        {"budget": [1, 2], "ids": [30, 40], "lora": [5, 6], "scale": [0.25, 0.75]},
        CPU,
    )
    assert columns.budget.dtype == np.int32
    assert columns.budget.tolist() == [1, 2]
    assert not columns.budget.flags.writeable
    assert columns.ids.host.dtype == np.int64
    assert (columns.ids.device.dtype, columns.ids.device.tolist()) == (torch.int64, [30, 40])
    assert columns.lora.device.tolist() == [5, 6]
    assert (columns.scale.device.dtype, columns.scale.device.tolist()) == (
        torch.float32,
        [0.25, 0.75],
    )
    check_column_set(columns, 2, CPU, "Rows")


def test_a_class_that_is_not_attrs_is_refused_by_name() -> None:
    class Plain(Columns):  # type: ignore[column-set]  # the run-time refusal
        pass

    with pytest.raises(ColumnError, match=r"^Plain: a column set must be an attrs class$"):
        build_columns(Plain, {}, CPU)


def test_columns_of_different_lengths_are_refused() -> None:
    @attrs.frozen(eq=False)
    class Pair(Columns):
        left: Mirrored[np.int64]
        right: Mirrored[np.int64]

    message = re.escape("Pair: columns of different lengths [2, 3]")
    with pytest.raises(ColumnError, match=message):
        build_columns(Pair, {"left": [1, 2], "right": [1, 2, 3]}, CPU)


def test_a_device_only_column_may_have_more_than_one_dimension() -> None:
    @attrs.frozen(eq=False)
    class Wide(Columns):
        bias: DeviceOnly

    columns = Wide(DeviceOnly(torch.zeros(3, 4)))
    check_column_set(columns, 3, CPU, "Rows")
    with pytest.raises(ColumnError, match=re.escape("Rows.Wide.bias: expected a tensor [2] on")):
        check_column_set(columns, 2, CPU, "Rows")


def test_a_bad_host_column_is_described_as_it_is() -> None:
    @attrs.frozen(eq=False)
    class Budgets(Columns):
        budget: HostColumn[np.int64]

    read_only = np.zeros(2, dtype=np.int32)
    read_only.flags.writeable = False
    expected = "expected a read-only int64 array [2], got a read-only int32 array [2]"
    with pytest.raises(ColumnError, match=re.escape(expected)):
        check_column_set(Budgets(read_only), 2, CPU, "Rows")  # type: ignore[arg-type]  # the point
    with pytest.raises(ColumnError, match=re.escape("got a writable int64 array [2]")):
        check_column_set(Budgets(np.zeros(2, dtype=np.int64)), 2, CPU, "Rows")


def test_rows_with_different_column_sets_are_not_joined() -> None:
    @attrs.frozen(eq=False)
    class Left(Columns):
        a: Mirrored[np.int64]

    @attrs.frozen(eq=False)
    class Right(Columns):
        a: Mirrored[np.int64]

    left = Rows.from_host(CPU, [Req(1, (5,))], [1], [1], build_columns(Left, {"a": [1]}, CPU))
    right = Rows.from_host(CPU, [Req(2, (6,))], [2], [1], build_columns(Right, {"a": [2]}, CPU))
    with pytest.raises(ColumnError, match=r"^cannot join Right columns to Left ones$"):
        left.cat(right)  # type: ignore[arg-type]  # mypy refuses it too


def test_a_field_of_another_generic_type_is_refused() -> None:
    @attrs.frozen(eq=False)
    class Odd(Columns):
        table: dict[str, int]  # type: ignore[column-set]  # the run-time refusal

    with pytest.raises(ColumnError, match=r"Odd\.table: a column is Mirrored"):
        build_columns(Odd, {"table": [{}]}, CPU)
