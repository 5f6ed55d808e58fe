"""SGLang's data-parallel attention on CPU: two ranks, each its own scheduler and pools,
synced by SGLang's own `prepare_mlp_sync_batch` (idle batches for the rank with nothing
to run), under a `Watch` and a `Shadow` per rank. Skipped when SGLang is not
installed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from batchstate.sglang import Divergence, Shadow, ShadowDivergence, Watch, cpu_topology
from batchstate.sglang.dp_loop import DataParallelLoop

pytestmark = SGLANG_MARKS


@pytest.fixture(scope="module")
def topology() -> Iterator[None]:
    with cpu_topology(
        page_size=16,
        chunked_prefill_size=128,
        max_running_requests=16,
        pp_max_micro_batch_size=16,
        enable_dp_attention=True,
        dp_size=2,
        tp_size=2,
    ):
        yield


def _loaded(requests: int = 24) -> DataParallelLoop:
    """Three requests of four on rank 0: rank 1 runs out of work first and then runs
    idle batches while rank 0 still decodes."""
    dp = DataParallelLoop(ranks=2, page_size=16, kv_tokens=1024, rows=16)
    rng = random.Random(1)
    shared = [rng.randrange(100, 30000) for _ in range(48)]
    for i in range(requests):
        head = shared[: rng.randrange(0, 48)]
        tail = [rng.randrange(100, 30000) for _ in range(rng.randrange(4, 300))]
        dp.submit(0 if i % 4 else 1, head + tail, rng.randrange(30, 100))
    return dp


def _run(dp: DataParallelLoop) -> list[list[str]]:
    steps: list[list[str]] = []
    while dp.busy and len(steps) < 3000:
        steps.append(dp.step())
    return steps


def _shadows(dp: DataParallelLoop, **kwargs: Any) -> list[Shadow]:
    return [Shadow(tree_cache=loop.scheduler.tree_cache, **kwargs) for loop in dp.loops]


def test_two_ranks_run_under_a_watch_and_a_shadow_each_without_a_finding(
    topology: None,
) -> None:
    dp = _loaded()
    first, second = _shadows(dp)
    watch, other = (Watch(tree_cache=loop.scheduler.tree_cache) for loop in dp.loops)
    with watch, other, first, second:
        steps = _run(dp)
    assert watch.divergences == [] and other.divergences == []
    assert first.divergences == [] and second.divergences == []
    assert not dp.busy and len(steps) >= 300
    assert dp.idle[1] >= 100 and dp.idle[0] == 0  # rank 1 idled while rank 0 decoded
    assert any(kinds == ["decode", "idle-batch"] for kinds in steps)
    for rank, shadow in enumerate((first, second)):
        released = {op.rid for op in shadow.operations if op.op == "release_kv_cache"}
        assert released == {r.rid for r in dp.submitted[rank]}  # its own requests only
    assert "prepare_for_idle" in {op.op for op in second.operations}
    assert "prepare_for_idle" in {s.operation for s in other.trace}
    assert "prepare_for_idle" not in {s.operation for s in watch.trace}  # rank 0 never idled


def _idle_without_its_mirror(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reintroduce a bug: an idle batch built without `req_pool_indices_cpu` (the device
    side set, the host mirror left None), so the host code every rank runs on it reads
    None."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    original = ScheduleBatch.prepare_for_idle

    def prepare_for_idle(batch: Any) -> None:
        original(batch)
        batch.req_pool_indices_cpu = None

    monkeypatch.setattr(ScheduleBatch, "prepare_for_idle", prepare_for_idle)


def test_an_idle_batch_without_its_mirror_is_named_by_the_watch(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _idle_without_its_mirror(monkeypatch)
    dp = _loaded(requests=8)
    watch = Watch(tree_cache=dp.loops[1].scheduler.tree_cache)
    with watch, pytest.raises(Divergence) as raised:
        _run(dp)
    assert watch.divergences == [raised.value]
    assert raised.value.operation == "prepare_for_idle"
    assert (raised.value.violation.field, raised.value.violation.actual) == (
        "req_pool_indices_cpu",
        "None",
    )


def test_an_idle_batch_without_its_mirror_is_named_by_the_shadow(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _idle_without_its_mirror(monkeypatch)
    dp = _loaded(requests=8)
    first, second = _shadows(dp)
    with first, second, pytest.raises(ShadowDivergence) as raised:
        _run(dp)
    assert first.divergences == [] and second.divergences == [raised.value]
    mismatch = raised.value.mismatch
    assert (mismatch.op, mismatch.field, mismatch.sglang) == (
        "prepare_for_idle",
        "req_pool_indices_cpu rows",
        "-1",
    )
