"""`Watch` beside SGLang's own `Scheduler.get_next_batch_to_run` (normal and overlap
loops): zero findings on a clean run, and a bug named at the call that made it, with its
request. Skipped when SGLang is not installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from batchstate.sglang import Divergence, Watch, cpu_topology
from tests.sglang.test_sglang import _free_row_twice, _leak_on_release
from tests.sglang.test_sglang_scheduler_loop import _loaded, _run

pytestmark = SGLANG_MARKS


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def page_size(request: pytest.FixtureRequest) -> Iterator[int]:
    with cpu_topology(
        chunked_prefill_size=128,
        page_size=request.param,
        max_running_requests=16,
        pp_max_micro_batch_size=16,
    ):
        yield request.param


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_the_real_scheduler_runs_under_the_watch_without_a_finding(
    page_size: int, overlap: bool
) -> None:
    loop = _loaded(page_size, overlap=overlap)
    with Watch() as watch:  # raises at the first finding
        steps = _run(loop)
    assert watch.divergences == [] and not loop.busy and len(steps) >= 500
    calls = {s.operation for s in watch.trace}
    assert calls >= {"prepare_for_extend", "prepare_for_decode", "release_kv_cache"}
    assert calls >= {"checkpoint_kv_cache", "retract_decode"}  # chunks stashed, retraction
    assert watch.holdings.held == {}  # every request gave its row back


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_bugs_in_the_real_scheduler_are_named_at_the_release(
    page_size: int, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patched:
        leaked = _leak_on_release(patched)
        with Watch() as watch, pytest.raises(Divergence) as raised:
            _run(_loaded(page_size, overlap=overlap))
    assert (raised.value.operation, raised.value.violation.check) == (
        "release_kv_cache",
        "conservation",
    )
    assert watch.trace[-1].rows == (leaked[0],)  # the release that leaked first
    assert raised.value.violation.request == watch.trace[-1].rids[0]
    with monkeypatch.context() as patched:
        freed = _free_row_twice(patched)
        with Watch() as watch, pytest.raises(Divergence) as raised:
            _run(_loaded(page_size, overlap=overlap))
    assert (raised.value.operation, raised.value.violation.check) == (
        "release_kv_cache",
        "row given back twice",
    )
    assert raised.value.violation.request == freed[0]
