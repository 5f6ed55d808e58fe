"""A driven batch's fields (`batchstate.sglang.driven.batch.RecordFields`) are reads of its
record: the record's own values on every transition, no field to write SGLang's seed bugs
into, and host fields that never read the device (on the meta device).

SGLang's real scheduler loop over driven batches is tests/sglang/test_sglang_driven_loop.py's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from batchstate import (
    Mixed,
    Pools,
    Req,
    decode,
    filter_batch,
    finish_mixed,
    idle,
    make_pools,
    merge,
    mix,
)
from batchstate.sglang.driven.batch import FIELDS, Binding, DrivenFieldError, Record, RecordFields

SYSTEM = tuple(range(100, 140))  # 40 shared tokens: two whole pages and 8


class _Batch(RecordFields):
    """What `Drive` mixes into SGLang's `ScheduleBatch`, bound to one record."""

    def __init__(self, record: Record) -> None:
        self.batchstate_binding = Binding(None, {}, record, "b0", snapshot=record)


def _prefill(device: torch.device) -> tuple[Mixed, Pools]:
    pools = make_pools(8, 256, 1024, device, 16, prefix_cache=True)
    reqs = [Req(n, SYSTEM + tuple(range(1000 * n, 1000 * n + 5 + n))) for n in (1, 2, 3)]
    return mix(idle(device), reqs, 512, pools).unwrap()


def _writes_its_own_kv(batch: _Batch, pools: Pools) -> None:
    # A decode: each row's new token goes to its own table cell at its last position, no
    # two rows write one location, and none of them is free.
    assert batch.out_cache_loc is not None
    locs = batch.out_cache_loc.cpu().numpy()
    slots, lens = batch.req_pool_indices_cpu.numpy(), batch.seq_lens_cpu.numpy()
    assert (pools.table.host[slots, lens - 1] == locs).all()
    assert len(set(locs.tolist())) == len(locs)
    free = {int(p) * pools.page_size + o for p in pools.free_pages for o in range(pools.page_size)}
    assert not set(locs.tolist()) & free


def test_the_fields_are_the_records_on_every_transition() -> None:
    mixed, pools = _prefill(torch.device("cpu"))
    batch = _Batch(mixed)
    assert torch.equal(batch.req_pool_indices_cpu, batch.req_pool_indices.cpu())
    assert torch.equal(batch.seq_lens_cpu, batch.seq_lens.cpu())
    assert batch.seq_lens_sum == int(batch.seq_lens_cpu.sum()) == 3 * 40 + 6 + 7 + 8
    assert batch.prefix_lens is not None and batch.extend_lens is not None
    assert batch.extend_num_tokens == sum(batch.extend_lens) == len(mixed.input_ids.device)
    lens = [p + e for p, e in zip(batch.prefix_lens, batch.extend_lens, strict=True)]
    assert lens == batch.seq_lens_cpu.tolist() == batch.orig_seq_lens.tolist()
    # An extend writes each computed token to a location of its own (whole pages that
    # duplicate a cached prefix are retired after it, so the table may point elsewhere).
    assert batch.out_cache_loc is not None
    locs = batch.out_cache_loc.tolist()
    assert len(set(locs)) == len(locs) == batch.extend_num_tokens
    running, held = finish_mixed(mixed)
    assert held == ()
    between = _Batch(running)  # between forwards: what SGLang's batch holds as None
    assert (between.out_cache_loc, between.extend_lens, between.extend_num_tokens) == (
        None,
        None,
        None,
    )
    decoding, pools = decode(running, pools).unwrap()
    batch = _Batch(decoding)
    assert batch.seq_lens_cpu.tolist() == [47, 48, 49]
    assert batch.orig_seq_lens.dtype == torch.int32
    _writes_its_own_kv(batch, pools)
    kept = filter_batch(decoding, [0, 2])
    both = merge(kept, filter_batch(decoding, [1]))
    assert _Batch(kept).req_pool_indices_cpu.tolist() == (
        batch.req_pool_indices_cpu[[0, 2]].tolist()
    )
    assert _Batch(both).seq_lens_sum == batch.seq_lens_sum


def test_the_host_mirrors_are_copies_a_caller_may_write() -> None:
    # SGLang's result processing may index or write the CPU tensors it reads; the
    # record's host arrays are read-only and stay as they were.
    mixed, pools = _prefill(torch.device("cpu"))
    decoding, _ = decode(finish_mixed(mixed).running, pools).unwrap()
    batch = _Batch(decoding)
    batch.seq_lens_cpu[0] = -1
    assert decoding.rows.seq_lens.host.tolist() == [47, 48, 49]
    assert not decoding.rows.seq_lens.host.flags.writeable


def _patches() -> dict[str, Callable[[_Batch], None]]:
    # The patches that reintroduce the bugs into stock SGLang (tests/sglang/test_sglang_shadow.py).
    return {
        "a builder that forgot req_pool_indices_cpu": lambda b: setattr(
            b, "req_pool_indices_cpu", None
        ),
        "seq_lens_sum recomputed from the device": lambda b: setattr(
            b, "seq_lens_sum", int(b.seq_lens.sum()) - len(b.seq_lens_cpu)
        ),
        "rows left behind by an empty filter": lambda b: setattr(
            b, "req_pool_indices", b.req_pool_indices[:0]
        ),
    }


@pytest.mark.parametrize("bug", list(_patches()))
def test_the_patch_that_writes_a_seed_bug_is_refused(bug: str) -> None:
    mixed, pools = _prefill(torch.device("cpu"))
    decoding, _ = decode(finish_mixed(mixed).running, pools).unwrap()
    batch = _Batch(decoding)
    before = (batch.req_pool_indices_cpu.tolist(), batch.seq_lens_sum)
    with pytest.raises(DrivenFieldError, match="read from the batch's batchstate record"):
        _patches()[bug](batch)
    assert (batch.req_pool_indices_cpu.tolist(), batch.seq_lens_sum) == before


def test_every_field_refuses_assignment() -> None:
    mixed, _ = _prefill(torch.device("cpu"))
    batch = _Batch(mixed)
    assert set(FIELDS) >= {"req_pool_indices_cpu", "seq_lens_cpu", "seq_lens_sum"}
    for name in FIELDS:
        with pytest.raises(DrivenFieldError, match=name):
            setattr(batch, name, None)
        with pytest.raises(AttributeError):  # what SGLang's own code would catch
            setattr(batch, name, None)


def test_an_empty_filter_leaves_no_rows_for_a_merge_to_re_add() -> None:
    mixed, pools = _prefill(torch.device("cpu"))
    decoding, pools = decode(finish_mixed(mixed).running, pools).unwrap()
    emptied = filter_batch(decoding, [])  # every request left
    assert _Batch(emptied).req_pool_indices_cpu.tolist() == []
    assert _Batch(emptied).req_pool_indices.shape == (0,)
    incoming = filter_batch(decoding, [1])
    merged = _Batch(merge(emptied, incoming))
    assert merged.req_pool_indices_cpu.tolist() == _Batch(incoming).req_pool_indices_cpu.tolist()
    assert merged.seq_lens_sum == int(merged.seq_lens_cpu.sum()) == 48


def test_the_host_fields_never_read_the_device() -> None:
    # On the meta device a tensor has no data: any read of one raises. The records'
    # host fields are answered all the same; stock SGLang's recomputation is not.
    meta = torch.device("meta")
    mixed, pools = _prefill(meta)
    prefill = _Batch(mixed)
    assert prefill.prefix_lens == [0, 0, 0] and prefill.extend_num_tokens == 3 * 40 + 6 + 7 + 8
    assert prefill.orig_seq_lens.device == meta
    decoding, _ = decode(finish_mixed(mixed).running, pools).unwrap()
    batch = _Batch(decoding)
    assert batch.seq_lens_sum == 47 + 48 + 49
    assert batch.seq_lens_cpu.tolist() == [47, 48, 49]
    assert np.array_equal(batch.req_pool_indices_cpu.numpy(), decoding.rows.req_pool_indices.host)
    assert batch.seq_lens.device == meta and batch.orig_seq_lens.device == meta
    with pytest.raises(RuntimeError, match="meta"):
        int(batch.seq_lens.sum())  # what a seq_lens_sum recomputed from the device does
