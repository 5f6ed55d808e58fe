"""mix names whose columns do not fit: the new requests' set, or a held chunk's own row."""

from __future__ import annotations

import re
from typing import Any

import pytest

from batchstate import (
    Chunked,
    ColumnError,
    Filtered,
    Pools,
    extend,
    finish_mixed,
    idle,
    make_pools,
    merge,
    mix,
)
from tests.builders import CPU, Probe, make_probe, make_reqs
from tests.strategies import assert_unchanged, snapshot


def _probe_batch_and_chunk() -> tuple[Filtered[Probe], Chunked[Probe], Pools]:
    """A running Probe batch of one row (rid 0) and a held Probe chunk (rid 20)."""
    pools = make_pools(8, 64, 256, CPU)
    first, pools = extend(idle(CPU, Probe), make_reqs([1]), pools, make_probe([0])).unwrap()
    mixed, pools = mix(
        idle(CPU, Probe), make_reqs([40], 20), 8, pools, (), make_probe([20])
    ).unwrap()
    _, (chunk,) = finish_mixed(mixed)
    return merge(idle(CPU, Probe), first), chunk, pools


def _refused(message: str) -> pytest.RaisesExc[ColumnError]:
    return pytest.raises(ColumnError, match=f"^{re.escape(message)}$")


def test_columns_for_fewer_new_requests_name_the_argument() -> None:
    running, _, pools = _probe_batch_and_chunk()
    before = snapshot(pools)
    with _refused(
        "columns.Probe.weight.host: expected a read-only float32 array [2],"
        " got a read-only float32 array [1]"
    ):
        mix(running, make_reqs([4, 5], 10), 8, pools, [7], make_probe([10]))
    assert_unchanged(before, pools, "pools")


def test_a_chunk_with_more_than_its_own_row_is_named() -> None:
    running, chunk, pools = _probe_batch_and_chunk()
    two_rows = Chunked(chunk.req, chunk.slot, chunk.cached, make_probe([1, 2]), gen=chunk.gen)
    with _refused(
        "request 20's chunk.Probe.weight.host: expected a read-only float32 array [1],"
        " got a read-only float32 array [2]"
    ):
        mix(running, [two_rows], 8, pools, [7], make_probe([]))


def test_a_chunk_of_another_column_set_is_named() -> None:
    running, chunk, pools = _probe_batch_and_chunk()
    bare: Chunked[Any] = Chunked(chunk.req, chunk.slot, chunk.cached, gen=chunk.gen)
    with _refused("request 20's chunk carries NoColumns columns, the batch Probe"):
        mix(running, [bare], 8, pools, [7], make_probe([]))
