"""A column set holding a value of another kind than a field declares is refused, naming both.

Each field (mirrored, device-only, host-only) gets a value of each other
kind, with the right length, dtype and device, so that only the kind is
wrong.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from batchstate import ColumnError, DeviceOnly, HostColumn, Mirrored
from batchstate.base.mirrored import frozen
from batchstate.columns.arguments import check_column_set
from batchstate.columns.columns import Columns

CPU = torch.device("cpu")


@attrs.frozen(eq=False)
class _Kinds(Columns):
    pair: Mirrored[np.int64]
    state: DeviceOnly
    budget: HostColumn[np.int64]


def _values() -> dict[str, Any]:
    return {
        "mirrored": Mirrored.from_ints([1, 2], CPU),
        "device": DeviceOnly(torch.tensor([1, 2])),
        "host": frozen(np.array([1, 2], dtype=np.int64)),
    }


FIELDS = {"pair": "mirrored", "state": "device", "budget": "host"}


def test_the_right_kinds_pass() -> None:
    values = _values()
    check_column_set(_Kinds(values["mirrored"], values["device"], values["host"]), 2, CPU, "Rows")


@pytest.mark.parametrize(
    ("field", "wrong"),
    [
        (field, wrong)
        for field, kind in FIELDS.items()
        for wrong in FIELDS.values()
        if wrong != kind
    ],
)
def test_a_value_of_another_kind_is_refused(field: str, wrong: str) -> None:
    kind = FIELDS[field]
    values = _values()
    columns = {name: values[FIELDS[name]] for name in FIELDS}
    columns[field] = values[wrong]
    got = type(values[wrong]).__name__
    message = f"Rows._Kinds.{field}: expected a {kind} column, got {got}"
    with pytest.raises(ColumnError, match=f"^{re.escape(message)}$"):
        check_column_set(_Kinds(**columns), 2, CPU, "Rows")
