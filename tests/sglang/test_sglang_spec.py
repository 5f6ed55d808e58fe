"""SGLang's EAGLE bookkeeping (spec v2: the draft batches, the KV reserved for each
verify window, the commit of accepted tokens, the reserve freed at release) stepped on
CPU with a fake draft worker, under `Watch`. Skipped when SGLang is not installed."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from batchstate.sglang import Divergence, NotReplayed, Shadow, Watch, cpu_topology
from batchstate.sglang.spec_drive import SpecDriver, cpu_kernels

pytestmark = SGLANG_MARKS

DRAFT_TOKENS = 4


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def page_size(request: pytest.FixtureRequest) -> Iterator[int]:
    with (
        cpu_topology(
            page_size=request.param,
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=DRAFT_TOKENS,
            speculative_draft_model_path="dummy",  # never loaded: the draft is fake
        ),
        cpu_kernels(),
    ):
        yield request.param


def _loaded(page_size: int, requests: int = 30) -> SpecDriver:
    """Requests sharing prefixes of a system prompt, some chunked, accepting 0 to 3 of
    each verify's 4 draft tokens."""
    driver = SpecDriver(
        accept=3,
        page_size=page_size,
        kv_tokens=800 if page_size == 1 else 1024,
        rows=16,
        seed=1,
        chunk=64,
    )
    rng = random.Random(1)
    shared = [rng.randrange(100, 30000) for _ in range(48)]
    for _ in range(requests):
        head = shared[: rng.randrange(0, 48)]
        tail = [rng.randrange(100, 30000) for _ in range(rng.randrange(4, 120))]
        driver.submit(head + tail, rng.randrange(30, 100))
    return driver


def _run(driver: SpecDriver) -> list[tuple[str, tuple[str, ...], tuple[int, ...]]]:
    steps: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = []
    for _ in range(3000):
        kind = driver.step()
        if kind == "idle" and not driver.waiting and driver.chunked_req is None:
            break
        batch = driver.running
        lens = tuple(batch.seq_lens_cpu.tolist()) if batch.reqs else ()
        steps.append((kind, tuple(r.rid for r in batch.reqs), lens))
    return steps


def test_eagle_steps_run_under_the_watch_without_a_finding(page_size: int) -> None:
    without = _run(_loaded(page_size))
    driver = _loaded(page_size)
    with Watch() as watch:
        steps = _run(driver)
    assert watch.divergences == []
    assert steps == without  # the watch changes nothing SGLang does
    assert driver.finished == 30 and driver.chunks > 0
    assert driver.verifies >= 100 and driver.accepted >= 1000  # measured: 125-140, 1121-1128
    assert max(len(rids) for _, rids, _ in steps) >= 4
    ops = {s.operation for s in watch.trace}
    assert ops >= {"prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch"}
    # The reserve SGLang keeps past each row's committed length, seen by the audit.
    assert driver.tree_cache.evictable_size() > 0


def test_a_reserve_short_of_the_verify_window_is_named(
    page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reintroduced: the reserve sized by the draft steps (3) instead of the verify's
    # draft tokens (4), so the verify's last token lands past the row's KV.
    from sglang.srt.speculative import eagle_utils

    monkeypatch.setattr(eagle_utils, "get_alloc_reserve_per_decode", lambda: DRAFT_TOKENS - 1)
    with Watch() as watch, pytest.raises(Divergence) as raised:
        _run(_loaded(page_size, requests=4))
    assert watch.divergences == [raised.value]
    assert raised.value.operation == "prepare_for_decode"
    assert raised.value.violation.check == "verify window"


def test_a_reserve_never_freed_at_release_is_named(
    page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reintroduced: release_kv_cache keeps the reserve past the committed length.
    from sglang.srt.mem_cache import common

    monkeypatch.setattr(common, "_release_overallocated_kv_indices", lambda *a, **k: None)
    with Watch() as watch, pytest.raises(Divergence) as raised:
        _run(_loaded(page_size, requests=4))
    assert watch.divergences == [raised.value]
    assert raised.value.violation.check == "conservation"


def test_a_shadow_refuses_speculative_batches_by_name(page_size: int) -> None:
    driver = _loaded(page_size, requests=2)
    with Shadow() as shadow, pytest.raises(NotReplayed, match="EAGLE"):
        driver.step()
    assert shadow.operations == [] and shadow.replica is None  # nothing replayed
