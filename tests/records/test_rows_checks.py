"""Rows built by hand with one broken column are refused, and the error names that column."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from batchstate import DeviceOnly, Mirrored, RecordShapeError, Req, Rows
from batchstate.base.mirrored import frozen
from batchstate.columns.columns import NO_COLUMNS

CPU = torch.device("cpu")


def _rows() -> Rows:
    return Rows.from_host(CPU, [Req(0, (1,)), Req(1, (2,))], [1, 2], [3, 4], NO_COLUMNS)


def _with(rows: Rows, **changes: object) -> Rows:
    fields = {
        "device": rows.device,
        "reqs": rows.reqs,
        "rids": rows.rids,
        "gens": rows.gens,
        "req_pool_indices": rows.req_pool_indices,
        "seq_lens": rows.seq_lens,
        "orig_seq_lens": rows.orig_seq_lens,
        "seq_lens_sum": rows.seq_lens_sum,
        "max_seq_len": rows.max_seq_len,
    }
    fields.update(changes)
    return Rows(**fields)  # type: ignore[arg-type]  # a broken column, on purpose


def _pair(host: np.ndarray, device: torch.Tensor) -> Mirrored:
    return Mirrored.trusted(host, device)


def _int32(array: np.ndarray) -> np.ndarray:
    return frozen(array.astype(np.int32))


@pytest.mark.parametrize(
    ("column", "broken"),
    [
        ("rids", lambda rows: {"rids": _int32(rows.rids)}),
        (
            "req_pool_indices.host",
            lambda rows: {
                "req_pool_indices": _pair(
                    _int32(rows.req_pool_indices.host), rows.req_pool_indices.device
                )
            },
        ),
        (
            "req_pool_indices.device",
            lambda rows: {
                "req_pool_indices": _pair(
                    rows.req_pool_indices.host, rows.req_pool_indices.device.int()
                )
            },
        ),
        (
            "seq_lens.host",
            lambda rows: {"seq_lens": _pair(_int32(rows.seq_lens.host), rows.seq_lens.device)},
        ),
        (
            "seq_lens.device",
            lambda rows: {"seq_lens": _pair(rows.seq_lens.host, rows.seq_lens.device.int())},
        ),
        (
            "orig_seq_lens",
            lambda rows: {"orig_seq_lens": DeviceOnly(rows.orig_seq_lens.device.long())},
        ),
    ],
)
def test_a_broken_column_is_named(column: str, broken: Callable[[Rows], dict[str, object]]) -> None:
    rows = _rows()
    changes = broken(rows)
    with pytest.raises(RecordShapeError, match=f"^{re.escape(f'Rows.{column}:')}"):
        _with(rows, **changes)
