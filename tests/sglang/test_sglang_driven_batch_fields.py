"""SGLang's batch fields read from one batchstate record (`batchstate.sglang.driven.batch_fields`):
the record's own values on every transition, three bugs of SGLang's mutable batch with no
field to write them into, and the same fields as stock SGLang's at every decode of SGLang's
real scheduler loop (that part skipped when SGLang is not installed)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    Decoding,
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
from batchstate.errors import PhaseError
from batchstate.sglang.driven.batch_fields import BatchFields
from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_PRESENT

pytestmark = SGLANG_MARKS

SYSTEM = tuple(range(100, 140))  # 40 shared tokens: two whole pages and 8


def _prefill(device: torch.device) -> tuple[Mixed, Pools]:
    pools = make_pools(8, 256, 1024, device, 16, prefix_cache=True)
    reqs = [Req(n, SYSTEM + tuple(range(1000 * n, 1000 * n + 5 + n))) for n in (1, 2, 3)]
    return mix(idle(device), reqs, 512, pools).unwrap()


def _writes_its_own_kv(fields: BatchFields, pools: Pools) -> None:
    # A decode: each row's new token goes to its own table cell at its last position, no
    # two rows write one location, and none of them is free.
    locs = fields.out_cache_loc.cpu().numpy()
    slots, lens = fields.req_pool_indices_cpu.numpy(), fields.seq_lens_cpu.numpy()
    assert (pools.table.host[slots, lens - 1] == locs).all()
    assert len(set(locs.tolist())) == len(locs)
    free = {int(p) * pools.page_size + o for p in pools.free_pages for o in range(pools.page_size)}
    assert not set(locs.tolist()) & free


def test_the_fields_are_the_records_on_every_transition() -> None:
    device = torch.device("cpu")
    mixed, pools = _prefill(device)
    fields = BatchFields(mixed)
    assert torch.equal(fields.req_pool_indices_cpu, fields.req_pool_indices.cpu())
    assert torch.equal(fields.seq_lens_cpu, fields.seq_lens.cpu())
    assert fields.seq_lens_sum == int(fields.seq_lens_cpu.sum()) == 3 * 40 + 6 + 7 + 8
    assert fields.extend_num_tokens == sum(fields.extend_lens) == len(fields.input_ids)
    assert [p + e for p, e in zip(fields.prefix_lens, fields.extend_lens, strict=True)] == (
        fields.seq_lens_cpu.tolist()
    )
    # An extend writes each computed token to a location of its own (whole pages that
    # duplicate a cached prefix are retired after it, so the table may point elsewhere).
    locs = fields.out_cache_loc.tolist()
    assert len(set(locs)) == len(locs) == fields.extend_num_tokens
    rows = np.repeat(np.arange(fields.batch_size), fields.extend_lens)
    starts = np.repeat(fields.prefix_lens, fields.extend_lens)
    assert (fields.positions.numpy() >= starts).all() and len(rows) == len(locs)
    running, held = finish_mixed(mixed)
    assert held == ()
    for name in ("out_cache_loc", "input_ids", "positions", "extend_lens"):
        with pytest.raises(PhaseError, match=name):
            getattr(BatchFields(running), name)
    decoding, pools = decode(running, pools).unwrap()
    fields = BatchFields(decoding)
    assert fields.seq_lens_cpu.tolist() == [47, 48, 49]
    _writes_its_own_kv(fields, pools)
    kept = filter_batch(decoding, [0, 2])
    both = merge(kept, filter_batch(decoding, [1]))
    assert BatchFields(kept).req_pool_indices_cpu.tolist() == (
        fields.req_pool_indices_cpu[[0, 2]].tolist()
    )
    assert BatchFields(both).seq_lens_sum == fields.seq_lens_sum


def test_anything_but_a_record_is_refused_by_name() -> None:
    mixed, _ = _prefill(torch.device("cpu"))
    for wrong in (None, mixed.rows, "b0"):
        with pytest.raises(PhaseError, match="BatchFields: record must be"):
            BatchFields(wrong)  # type: ignore[arg-type]


def _patches() -> dict[str, Callable[[BatchFields], None]]:
    # The patches that reintroduce the bugs into stock SGLang (tests/sglang/test_sglang_shadow.py).
    return {
        "a builder that forgot req_pool_indices_cpu": lambda b: setattr(
            b, "req_pool_indices_cpu", None
        ),
        "seq_lens_sum recomputed from the device": lambda b: setattr(
            b, "seq_lens_sum", int(b.seq_lens.sum()) - b.batch_size
        ),
        "rows left behind by an empty filter": lambda b: setattr(
            b, "req_pool_indices", b.req_pool_indices[:0]
        ),
    }


@pytest.mark.parametrize("bug", list(_patches()))
def test_the_patch_that_writes_a_seed_bug_is_refused(bug: str) -> None:
    mixed, pools = _prefill(torch.device("cpu"))
    decoding, _ = decode(finish_mixed(mixed).running, pools).unwrap()
    fields = BatchFields(decoding)
    before = (fields.req_pool_indices_cpu.tolist(), fields.seq_lens_sum)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        _patches()[bug](fields)
    assert (fields.req_pool_indices_cpu.tolist(), fields.seq_lens_sum) == before


def test_an_empty_filter_leaves_no_rows_for_a_merge_to_re_add() -> None:
    mixed, pools = _prefill(torch.device("cpu"))
    decoding, pools = decode(finish_mixed(mixed).running, pools).unwrap()
    emptied = filter_batch(decoding, [])  # every request left
    assert BatchFields(emptied).req_pool_indices_cpu.tolist() == []
    assert BatchFields(emptied).req_pool_indices.shape == (0,)
    incoming = filter_batch(decoding, [1])
    merged = BatchFields(merge(emptied, incoming))
    assert (
        merged.req_pool_indices_cpu.tolist() == BatchFields(incoming).req_pool_indices_cpu.tolist()
    )
    assert merged.batch_size == 1 and merged.seq_lens_sum == int(merged.seq_lens_cpu.sum())


def test_the_host_fields_never_read_the_device() -> None:
    # On the meta device a tensor has no data: any read of one raises. The records'
    # host fields are answered all the same; stock SGLang's recomputation is not.
    meta = torch.device("meta")
    mixed, pools = _prefill(meta)
    decoding, _ = decode(finish_mixed(mixed).running, pools).unwrap()
    fields = BatchFields(decoding)
    assert fields.seq_lens_sum == 47 + 48 + 49
    assert fields.seq_lens_cpu.tolist() == [47, 48, 49]
    assert len(fields.req_pool_indices_cpu) == 3
    assert fields.seq_lens.device == meta
    with pytest.raises(RuntimeError, match="meta"):
        int(fields.seq_lens.sum())  # what a seq_lens_sum recomputed from the device does


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def page_size(request: pytest.FixtureRequest) -> Iterator[int]:
    if not SGLANG_PRESENT:
        pytest.skip("SGLang 0.5.23 is not installed: docs/sglang.md#install gives the commands")
    from batchstate.sglang import cpu_topology

    with cpu_topology(
        chunked_prefill_size=128,
        page_size=request.param,
        max_running_requests=16,
        pp_max_micro_batch_size=16,
    ):
        yield request.param


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_every_decode_of_the_real_scheduler_carries_the_fields_stock_sglang_does(
    page_size: int, overlap: bool
) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from batchstate.sglang import Shadow
    from batchstate.sglang.scheduler_loop import SchedulerLoop

    kv_tokens = 800 if page_size == 1 else 1024
    loop = SchedulerLoop(page_size=page_size, kv_tokens=kv_tokens, rows=16, overlap=overlap)
    rng = random.Random(4)
    shared = [rng.randrange(100, 30000) for _ in range(48)]
    for _ in range(40):
        tail = [rng.randrange(100, 30000) for _ in range(rng.randrange(4, 300))]
        loop.submit(shared[: rng.randrange(0, 48)] + tail, rng.randrange(30, 100))
    compared: list[int] = []
    with Shadow() as shadow:
        stock = ScheduleBatch.prepare_for_decode

        def compare(batch: ScheduleBatch) -> None:
            stock(batch)  # SGLang's, then the shadow's replay on the one Pools
            replica = shadow.replica
            assert replica is not None
            label = shadow.operations[-1].batch
            record = replica.records[label]
            assert isinstance(record, Decoding)
            fields = BatchFields(record)
            rids = replica.state(label).rids
            theirs = dict(
                zip((r.rid for r in batch.reqs), batch.seq_lens_cpu.tolist(), strict=True)
            )
            ours = dict(zip(rids, fields.seq_lens_cpu.tolist(), strict=True))
            assert ours == theirs  # the same rows, each at the same length
            assert fields.seq_lens_sum == int(batch.seq_lens_cpu.sum())
            assert len(fields.out_cache_loc) == len(batch.out_cache_loc) == len(rids)
            # Which free KV location each row got may differ; each writes its own.
            _writes_its_own_kv(fields, replica.pools)
            compared.append(len(rids))

        ScheduleBatch.prepare_for_decode = compare
        try:
            while loop.busy and len(compared) < 4000:
                loop.step()
        finally:
            ScheduleBatch.prepare_for_decode = stock
    assert shadow.divergences == [] and not loop.busy
    assert len(compared) >= 300 and max(compared) >= 4
