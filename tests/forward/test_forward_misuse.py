"""`forward_inputs` and `pad` check what they are handed against the record and the pools.

Each call below once built a forward's inputs with no error: positions
three tokens behind, another page size's page ids, another pools' table,
padded rows reading a slot or page no pools hand out.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pytest
import torch

from batchstate import (
    SGLANG_PAD_VALUES,
    Decoding,
    ForwardInputsError,
    PaddingError,
    Pools,
    Req,
    decode,
    extend,
    forward_inputs,
    idle,
    make_pools,
    pad,
    verify,
)
from tests.strategies import assert_unchanged, snapshot

CPU: Final = torch.device("cpu")


def _decoding(page_size: int = 16) -> tuple[Decoding, Pools]:
    pools = make_pools(4, 64, 128, CPU, page_size)
    batch, pools = extend(idle(CPU), [Req(0, tuple(range(1, 17)))], pools).unwrap()
    return decode(batch, pools).unwrap()


def test_slot_tokens_read_before_verify_are_refused() -> None:
    """Lengths from before `verify` are each row's committed length: the window's query
    positions would start a row's drafts too early."""
    batch, pools = _decoding()
    stale = pools.slot_tokens
    window, pools = verify(batch, [3], pools).unwrap()
    with pytest.raises(ForwardInputsError, match="do not hold this window's drafts"):
        forward_inputs(window, pools.table, pools.page_size, slot_tokens=stale)
    inputs = forward_inputs(window, pools.table, pools.page_size, slot_tokens=pools.slot_tokens)
    assert inputs.positions.host.tolist() == [16, 17, 18, 19]


def test_slot_tokens_of_other_pools_are_refused() -> None:
    batch, pools = _decoding()
    window, pools = verify(batch, [3], pools).unwrap()
    other = make_pools(4, 64, 128, CPU, 16)
    with pytest.raises(ForwardInputsError, match="do not hold this window's drafts"):
        forward_inputs(window, pools.table, pools.page_size, slot_tokens=other.slot_tokens)


def test_a_page_size_other_than_the_pools_is_refused() -> None:
    """Before: page 4's ids on page-16 pools, with no error."""
    batch, pools = _decoding(page_size=16)
    with pytest.raises(ForwardInputsError, match=r"page_size=4, but .* pages of 16"):
        forward_inputs(batch, pools.table, 4)


def test_another_pools_table_is_refused() -> None:
    batch, pools = _decoding()
    _, other = _decoding()  # the same history: the same slots and lengths
    before = snapshot((batch, other))
    with pytest.raises(ForwardInputsError, match="the table is another pools'"):
        forward_inputs(batch, other.table, other.page_size)
    assert_unchanged(before, (batch, other))
    forward_inputs(batch, pools.table, pools.page_size)  # its own pools' table still works


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("req_pool_indices", 5),  # one past the table's last slot
        ("req_pool_indices", -1),
        ("seq_lens", 65),  # longer than the table
        ("positions", 64),
        ("out_cache_loc", 9 * 16),  # past the KV cache (8 pages and the padding one)
        ("out_cache_loc", -2),
        ("kv_indices", 9),  # past the last page
        ("kv_indices", -1),
    ],
)
def test_a_fill_outside_the_table_or_the_kv_cache_is_refused(field: str, value: int) -> None:
    batch, pools = _decoding()
    inputs = forward_inputs(batch, pools.table, pools.page_size)
    fills = {**SGLANG_PAD_VALUES, field: value}
    before = snapshot(inputs)
    with pytest.raises(PaddingError, match=f"{field}={value} points outside"):
        pad(inputs, [4], fills)
    assert_unchanged(before, inputs)


def test_fills_at_the_edges_of_the_table_and_the_kv_cache_pad() -> None:
    batch, pools = _decoding()
    inputs = forward_inputs(batch, pools.table, pools.page_size)
    edges = {
        "req_pool_indices": 4,
        "seq_lens": 64,
        "extend_lens": 1,
        "positions": 63,
        "out_cache_loc": 9 * 16 - 1,
        "kv_indices": 8,
    }
    padded = pad(inputs, [4], edges).unwrap()
    assert padded.inputs.num_rows == 4
    assert np.array_equal(padded.inputs.seq_lens.host[1:], [64, 64, 64])
