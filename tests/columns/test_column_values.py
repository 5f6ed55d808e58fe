"""Columns keep their values exactly: a value that does not fit its column's dtype is refused.

`np.asarray(..., dtype=...)` used to wrap `2**40 + 3` into int32 as 3 and
truncate `top_k=40.9` to 40, and out-of-range Python ints raised a bare
`OverflowError`. Each is now a `ColumnError` naming the column.
"""

from __future__ import annotations

from typing import Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import ColumnError, Columns, Mirrored, Sampling, SamplingParams, build_columns

CPU: Final = torch.device("cpu")


@attrs.frozen(eq=False)
class _Narrow(Columns):
    adapter: Mirrored[np.int32]
    flag: Mirrored[np.bool_]
    scale: Mirrored[np.float32]
    tokens: Mirrored[np.uint16]


def _values(**changes: object) -> dict[str, object]:
    values: dict[str, object] = {"adapter": [1], "flag": [True], "scale": [0.5], "tokens": [7]}
    values.update(changes)
    return values


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"adapter": np.array([2**40 + 3])}, r"_Narrow.adapter: 1099511627779 does not fit int32"),
        ({"adapter": [2**40 + 3]}, r"_Narrow.adapter: 1099511627779 does not fit int32"),
        ({"adapter": [2**70]}, r"_Narrow.adapter: 1180591620717411303424 does not fit int32"),
        ({"adapter": [40.9]}, r"_Narrow.adapter: int32 column, got floats \[40.9\]"),
        ({"adapter": np.array([1.0])}, r"_Narrow.adapter: int32 column, got floats"),
        ({"tokens": [-1]}, r"_Narrow.tokens: -1 does not fit uint16"),
        ({"tokens": [70000]}, r"_Narrow.tokens: 70000 does not fit uint16"),
        ({"flag": [2]}, r"_Narrow.flag: 2 does not fit bool \(0..1\)"),
        ({"scale": [1e300]}, r"_Narrow.scale: 1e\+300 does not fit float32"),
        ({"scale": ["0.5"]}, r"_Narrow.scale: expected float32 values, got <U3"),
        ({"adapter": [[1]]}, r"_Narrow.adapter: expected one value per row, got shape \[1, 1\]"),
    ],
)
def test_a_value_that_does_not_fit_its_column_is_refused(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ColumnError, match=message):
        build_columns(_Narrow, _values(**changes), CPU)  # type: ignore[arg-type]  # on purpose


def test_values_that_fit_are_kept_exactly() -> None:
    columns = build_columns(
        _Narrow,
        {
            "adapter": np.array([2**31 - 1, -(2**31)]),
            "flag": [0, 1],
            "scale": [0.25, float("inf")],
            "tokens": np.array([0, 65535], dtype=np.int64),
        },
        CPU,
    )
    assert columns.adapter.host.tolist() == [2**31 - 1, -(2**31)]
    assert columns.adapter.device.tolist() == [2**31 - 1, -(2**31)]
    assert columns.flag.host.tolist() == [False, True]
    assert columns.scale.host.tolist() == [0.25, float("inf")]
    assert columns.tokens.device.tolist() == [0, 65535]


def test_sampling_refuses_a_fractional_top_k() -> None:
    with pytest.raises(ColumnError, match=r"Sampling.top_k: int32 column, got floats \[40.9\]"):
        Sampling.of([SamplingParams(0.7, top_k=40.9)], CPU)  # type: ignore[arg-type]
    with pytest.raises(
        ColumnError, match=r"Sampling.seed: 18446744073709551616 does not fit int64"
    ):
        Sampling.of([SamplingParams(0.7, seed=2**64)], CPU)
    assert Sampling.of([SamplingParams(0.7, top_k=40)], CPU).top_k.host.tolist() == [40]
