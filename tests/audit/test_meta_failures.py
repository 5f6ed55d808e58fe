"""Every path of the decode-path transitions, failures included, reads nothing from the device.

The records live on the `meta` device, which holds no data, under the audit
in forbid mode: a read anywhere on these paths raises `DeviceReadError`. Each
case also proves the audit would see one: the same path with a device read
added raises.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from returns.result import Failure

import batchstate.transitions.decoding
from batchstate import (
    BatchConflict,
    ContextTooLong,
    Decoding,
    NotOwned,
    OutOfKVTokens,
    Pools,
    Req,
    Rows,
    StaleRecord,
    StillRunning,
    decode,
    extend,
    idle,
    make_pools,
    merge,
    release,
    split,
)
from batchstate.audit import DeviceReadError, device_reads

META = torch.device("meta")


def _running(max_context_len: int = 64, num_kv_tokens: int = 64) -> tuple[Decoding, Pools]:
    pools = make_pools(8, max_context_len, num_kv_tokens, META, page_size=4)
    reqs = [Req(rid, tuple(range(1, 6 + rid))) for rid in range(3)]
    extended, pools = extend(idle(META), reqs, pools).unwrap()
    return decode(extended, pools).unwrap()


def _too_long() -> object:
    batch, pools = _running(max_context_len=8)
    for _ in range(4):
        result = decode(batch, pools)
        if isinstance(result, Failure):
            return result
        batch, pools = result.unwrap()
    raise AssertionError("decode never ran out of context")


def _out_of_kv() -> object:
    batch, pools = _running(num_kv_tokens=24)
    for _ in range(8):
        result = decode(batch, pools)
        if isinstance(result, Failure):
            return result
        batch, pools = result.unwrap()
    raise AssertionError("decode never ran out of KV")


def _stale() -> object:
    batch, pools = _running()
    decode(batch, copy.deepcopy(pools)).unwrap()  # on a copy: pools are linear
    return decode(batch, pools.free(batch.rows.req_pool_indices.host[:1]).unwrap())


def _release_still_running() -> object:
    batch, pools = _running()
    _, left = split(batch, [0, 2])
    return release(left, batch, pools)


def _release_twice() -> object:
    batch, pools = _running()
    kept, left = split(batch, [0, 2])
    pools = release(left, kept, pools).unwrap()
    return release(left, kept, pools)


FAILURES: dict[str, tuple[Callable[[], object], type[object]]] = {
    "decode-context-too-long": (_too_long, ContextTooLong),
    "decode-out-of-kv": (_out_of_kv, OutOfKVTokens),
    "release-still-running": (_release_still_running, StillRunning),
    "release-twice": (_release_twice, NotOwned),
}


@pytest.mark.parametrize("name", FAILURES)
def test_failure_paths_read_nothing(name: str) -> None:
    """Each failure comes back as its value, on meta, under a forbidding audit."""
    path, expected = FAILURES[name]
    with device_reads(forbid=True) as log:
        result = path()
    assert isinstance(result, Failure)
    assert type(result.failure()) is expected
    assert log.report().count == 0


def test_stale_record_path_reads_nothing() -> None:
    """decode refuses a batch its pools no longer back, naming the row, without a read."""
    with device_reads(forbid=True), pytest.raises(StaleRecord, match="row 0"):
        _stale()


def test_merge_conflict_path_reads_nothing() -> None:
    """Merging a batch into itself is refused from host mirrors alone."""
    batch, _ = _running()
    kept, _ = split(batch, [0, 1, 2])
    with device_reads(forbid=True), pytest.raises(BatchConflict, match="in both batches"):
        merge(batch, kept)


@pytest.mark.parametrize(("helper", "path"), [("_too_long", _too_long), ("expect_current", _stale)])
def test_a_read_added_to_a_failure_path_is_caught(
    monkeypatch: pytest.MonkeyPatch, helper: str, path: Callable[[], object]
) -> None:
    """The audit is not blind there: the same path with a device read raises."""
    original = getattr(batchstate.transitions.decoding, helper)

    def reading(*args: object) -> object:
        first = args[0]
        rows = first.rows if isinstance(first, Decoding) else first
        assert isinstance(rows, Rows)
        rows.seq_lens.device.tolist()  # the read being planted
        return original(*args)

    monkeypatch.setattr(batchstate.transitions.decoding, helper, reading)
    with device_reads(forbid=True), pytest.raises(DeviceReadError):
        path()
