"""Copies and pickles of column sets: read-only, and re-packed like a set built by hand.

A set the library builds keeps its values in packs beside its fields; a
copy carries the fields alone (frozen), so a set declared with
`slots=False`, whose packs sit in the instance `__dict__`, cannot hand a
copy writable packs.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    ColumnError,
    Columns,
    Filtered,
    HostColumn,
    Mirrored,
    Req,
    Rows,
    Sampling,
    SamplingParams,
    build_columns,
    check_batch,
)
from batchstate.columns.arguments import check_column_set
from batchstate.columns.columns import packed_of
from batchstate.columns.rows import slice_columns

CPU: Final = torch.device("cpu")


@attrs.frozen(eq=False, slots=False)
class Loose(Columns):
    """Two packed columns, declared without slots: packs live in `__dict__`."""

    budget: HostColumn[np.int64]
    scale: Mirrored[np.float32]


def _deepcopy(value: object) -> object:
    return copy.deepcopy(value)


def _pickled(value: object) -> object:
    return pickle.loads(pickle.dumps(value))  # our own bytes


COPIES: Final[dict[str, Callable[[object], object]]] = {"deepcopy": _deepcopy, "pickle": _pickled}


def _loose() -> Loose:
    return build_columns(Loose, {"budget": [3, 4, 5], "scale": [0.5, 1.0, 2.0]}, CPU)


def _sampling() -> Sampling:
    params = [SamplingParams(0.5, seed=1), SamplingParams(0.7, seed=2), SamplingParams(0.9)]
    return Sampling.of(params, CPU)


def _hosts(columns: Columns) -> list[np.ndarray]:
    hosts = []
    for name in attrs.fields_dict(type(columns)):  # type: ignore[arg-type]  # an attrs class
        value = getattr(columns, name)
        hosts.append(value if isinstance(value, np.ndarray) else value.host)
    return hosts


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("make", [_loose, _sampling])
def test_a_copied_set_is_read_only_and_its_slices_too(
    how: str, make: Callable[[], Columns]
) -> None:
    columns = make()
    copied = COPIES[how](columns)
    assert isinstance(copied, type(columns))
    packed = packed_of(copied)
    assert packed is None or not any(host.flags.writeable for host in packed.hosts)
    for old, new in zip(_hosts(columns), _hosts(copied), strict=True):
        assert new.tolist() == old.tolist()
        assert not new.flags.writeable
    check_column_set(copied, 3, CPU, "copy")
    for host in _hosts(slice_columns(copied, 1, 3)):
        assert not host.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            host[0] = 0


@pytest.mark.parametrize("how", COPIES)
def test_a_copied_rows_on_a_set_without_slots_passes_its_checks(how: str) -> None:
    rows = Rows.from_host(CPU, [Req(row, (1,)) for row in range(3)], [1, 2, 3], [1] * 3, _loose())
    copied = COPIES[how](rows)
    assert isinstance(copied, Rows)
    check_batch(Filtered(copied), compare_device=True)
    assert copied.columns.budget.tolist() == [3, 4, 5]


def _plus_one(value: HostColumn[np.int64]) -> HostColumn[np.int64]:
    shifted = value + 1
    shifted.setflags(write=False)
    return shifted


def test_a_column_with_a_converter_is_refused_before_any_value_is_built() -> None:
    # A transition rebuilds a set from its columns' rows: a converter would convert them
    # again at every step, or the packs keep what it did not convert.
    @attrs.frozen(eq=False)
    class Shifted(Columns):
        budget: HostColumn[np.int64] = attrs.field(converter=_plus_one)

    with pytest.raises(ColumnError, match=r"Shifted\.budget: a column takes no converter"):
        build_columns(Shifted, {"budget": [3, 4]}, CPU)
