"""Mirror bugs fixed in a mutable `ScheduleBatch`-style engine, pinned as regression tests.

Each is described in the table at the top of docs/design.md: a missing mirror,
stale rows after filtering everything out, a hidden per-step sync, and a
derived value out of step.
"""

from __future__ import annotations

import pytest
import torch

from batchstate import (
    Decoding,
    Extended,
    Filtered,
    admit_prefilled,
    check_batch,
    check_pools,
    decode,
    extend,
    filter_batch,
    idle,
    merge,
    release,
)
from tests.builders import CPU, make_extended, make_reqs, make_test_pools

META = torch.device("meta")


def _assert_empty(batch: Filtered) -> None:
    rows = batch.rows
    for tensor in (
        rows.rids,
        rows.req_pool_indices.host,
        rows.req_pool_indices.device,
        rows.seq_lens.host,
        rows.seq_lens.device,
        rows.orig_seq_lens.device,
    ):
        assert tensor.shape == (0,)
    assert rows.reqs == ()
    assert rows.seq_lens_sum == 0
    assert rows.max_seq_len == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_prebuilt_batch_has_every_mirror(page_size: int) -> None:
    """Seed 000: a hand-built decode batch carries both mirrors, equal to the device tensors."""
    pools = make_test_pools(page_size)
    batch, pools = admit_prefilled(idle(CPU), make_reqs([4, 20, 1]), pools).unwrap()
    assert batch.rows.req_pool_indices.host.tolist() == batch.rows.req_pool_indices.device.tolist()
    assert batch.rows.seq_lens.host.tolist() == batch.rows.seq_lens.device.tolist()
    assert batch.rows.seq_lens.host.tolist() == [4, 20, 1]
    decoded, pools = decode(batch, pools).unwrap()  # the step that crashed every DP rank
    check_batch(decoded, compare_device=True)
    check_pools(pools, [decoded], compare_device=True)


@pytest.mark.parametrize(
    "source",
    [
        "extended",  # filter right after a prefill
        "decoding",  # the reported case: every request finished at the same decode step
    ],
)
def test_filter_everything_out_leaves_no_stale_rows(source: str) -> None:
    """Seed 000: keeping no rows leaves zero rows on both sides; a later merge adds only new."""
    pools = make_test_pools()
    extended, pools = make_extended(pools, [3, 4])
    batch: Extended | Decoding = extended
    if source == "decoding":
        batch, pools = decode(extended, pools).unwrap()
    empty = filter_batch(batch, [])
    _assert_empty(empty)
    pools = release(filter_batch(batch, [0, 1]), empty, pools).unwrap()
    new, pools = make_extended(pools, [5], first_rid=10)
    merged = merge(empty, new)
    assert [req.rid for req in merged.rows.reqs] == [10]
    assert merged.rows.seq_lens.host.tolist() == merged.rows.seq_lens.device.tolist() == [5]
    check_pools(pools, [merged], compare_device=True)


def test_merge_concatenates_slots_on_both_sides() -> None:
    """Seed 001: merging slots [1, 2] with [3] gives [1, 2, 3] on host and device."""
    pools = make_test_pools()
    running, pools = make_extended(pools, [2, 2])
    incoming, pools = make_extended(pools, [2], first_rid=5)
    assert running.rows.req_pool_indices.host.tolist() == [1, 2]
    assert incoming.rows.req_pool_indices.host.tolist() == [3]
    merged = merge(filter_batch(running, [0, 1]), incoming)
    assert merged.rows.req_pool_indices.host.tolist() == [1, 2, 3]
    assert merged.rows.req_pool_indices.device.tolist() == [1, 2, 3]


@pytest.mark.parametrize("page_size", [1, 16])
def test_host_values_come_from_mirrors_on_meta(page_size: int) -> None:
    """Seed 003: host values after filter and merge need no device read (meta raises on one)."""
    pools = make_test_pools(page_size, device=META)
    batch, pools = extend(idle(META), make_reqs([3, 5, 7]), pools).unwrap()
    decoded, pools = decode(batch, pools).unwrap()
    kept = filter_batch(decoded, [0, 2])
    pools = release(filter_batch(decoded, [1]), kept, pools).unwrap()
    new, pools = extend(idle(META), make_reqs([2], first_rid=9), pools).unwrap()
    merged = merge(kept, new)
    assert merged.rows.seq_lens_sum == 4 + 8 + 2
    assert merged.rows.seq_lens.host.tolist() == [4, 8, 2]
    assert merged.rows.seq_lens.device.device == META
    check_pools(pools, [merged])
