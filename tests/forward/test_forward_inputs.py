"""forward_inputs against a naive per-request reference, for every forward phase and page size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchstate import (
    BatchConflict,
    Decoding,
    Filtered,
    ForwardInputsError,
    PhaseError,
    Verifying,
    forward_inputs,
    make_pools,
)
from tests.forward_cases import (
    LENGTHS,
    PAGE_SIZES,
    PHASE_NAMES,
    build,
    expected_lens,
    make_pools_for,
    make_record,
    naive,
)


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("phase", PHASE_NAMES)
def test_matches_the_naive_reference(phase: str, page_size: int, lengths: tuple[int, ...]) -> None:
    """Every field, host and device side, equals the one built request by request."""
    record, pools = make_record(phase, lengths, make_pools_for(page_size))
    inputs = build(record, pools)
    slots, prefix, extend_lens = expected_lens(record, pools)
    want = naive(slots, prefix, extend_lens, pools.table.host, page_size)
    for name in ("positions", "qo_indptr", "cu_seqlens_k", "kv_indptr", "kv_last_page_len"):
        pair = getattr(inputs, name)
        assert pair.host.tolist() == want[name], name
        assert pair.device.tolist() == want[name], name
    assert inputs.seq_lens.host.tolist() == want["seq_lens"]
    assert inputs.seq_lens.device.dtype == torch.int32
    assert inputs.prefix_lens.host.tolist() == prefix
    assert inputs.extend_lens.host.tolist() == extend_lens
    assert inputs.req_pool_indices.host.tolist() == slots
    assert inputs.sample_index.host.tolist() == want["sample_index"]
    assert inputs.kv_indices.device.tolist() == want["kv_indices"]
    assert inputs.kv_indices.dtype == torch.int32
    # Host integers, for launch bounds and plans.
    assert inputs.num_rows == len(slots)
    assert inputs.num_tokens == sum(extend_lens)
    assert inputs.seq_lens_sum == sum(want["seq_lens"])
    assert inputs.max_q_len == max(extend_lens, default=0)
    assert inputs.max_kv_len == max(want["seq_lens"], default=0)
    assert inputs.num_pages == len(want["kv_indices"])
    # FA3's page table: row i's first pages are its pages, in order.
    table = inputs.page_table.device.tolist()
    indptr = want["kv_indptr"]
    for row in range(len(slots)):
        pages = want["kv_indices"][indptr[row] : indptr[row + 1]]
        assert table[row][: len(pages)] == pages


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("phase", PHASE_NAMES[1:])
def test_each_token_writes_where_its_row_will_read_it(phase: str, page_size: int) -> None:
    """A token's KV location is the cell of its position in its row's pages."""
    record, pools = make_record(phase, LENGTHS[-1], make_pools_for(page_size))
    inputs = build(record, pools)
    locs = inputs.out_cache_loc.device.tolist()
    pages = inputs.kv_indices.device.tolist()
    qo, kv = inputs.qo_indptr.host, inputs.kv_indptr.host
    for row in range(inputs.num_rows):
        for token in range(int(qo[row]), int(qo[row + 1])):
            position = int(inputs.positions.host[token])
            page = pages[int(kv[row]) + position // page_size]
            assert locs[token] == page * page_size + position % page_size


def test_empty_batch_is_well_formed() -> None:
    """Idle: zero rows and tokens on every field, offsets [0]."""
    record, pools = make_record("idle", (), make_pools_for(16))
    inputs = build(record, pools)
    assert (inputs.num_rows, inputs.num_tokens, inputs.num_pages, inputs.seq_lens_sum) == (
        0,
        0,
        0,
        0,
    )
    assert inputs.qo_indptr.host.tolist() == inputs.kv_indptr.host.tolist() == [0]
    assert tuple(inputs.page_table.device.shape) == (0, 0)
    assert len(inputs.out_cache_loc) == 0


def test_host_sides_are_read_only() -> None:
    """Host mirrors refuse writes, as every Mirrored does."""
    record, pools = make_record("decoding", (3, 4), make_pools_for(1))
    inputs = build(record, pools)
    with pytest.raises(ValueError, match="read-only"):
        inputs.kv_indptr.host[0] = 1


def test_refusals() -> None:
    """A phase with no forward, a window without its lengths, a bad page size, another device."""
    record, pools = make_record("decoding", (3, 4), make_pools_for(16))
    assert isinstance(record, Decoding)
    with pytest.raises(PhaseError, match="Filtered"):
        forward_inputs(Filtered(record.rows), pools.table, 16)  # type: ignore[call-overload]
    with pytest.raises(ForwardInputsError, match="page_size"):
        forward_inputs(record, pools.table, 0)
    other = make_pools(4, 8, 16, torch.device("meta"))
    with pytest.raises(BatchConflict):
        forward_inputs(record, other.table, 16)
    window, pools = make_record("verifying", (3, 4), make_pools_for(16))
    assert isinstance(window, Verifying)
    with pytest.raises(PhaseError, match="slot_tokens"):
        forward_inputs(window, pools.table, 16)  # type: ignore[call-overload]
    with pytest.raises(ForwardInputsError, match="slot_tokens"):
        forward_inputs(window, pools.table, 16, slot_tokens=np.zeros(2, dtype=np.int64))
