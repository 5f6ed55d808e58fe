"""batchstate.sglang against SGLang's real scheduler bookkeeping (pools, radix cache,
PrefillAdder, ScheduleBatch), stepped with seeded tokens on CPU.

Skipped when SGLang is not installed (CI installs it as docs/sglang.md says).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from batchstate.sglang import Divergence, UnsupportedSGLang, Watch, audit, cpu_topology
from batchstate.sglang._fields import BATCH_FIELDS
from batchstate.sglang.drive import Driver

pytestmark = SGLANG_MARKS


@pytest.fixture(scope="module")
def topology() -> Iterator[None]:
    with cpu_topology():
        yield


def _loaded(page_size: int, kv_tokens: int, requests: int = 40, seed: int = 1) -> Driver:
    """Requests sharing prefixes of one system prompt, prompts long enough to be chunked,
    outputs long enough to retract."""
    chunk = 32 if page_size == 1 else 64
    driver = Driver(page_size=page_size, kv_tokens=kv_tokens, rows=16, seed=seed, chunk=chunk)
    rng = random.Random(seed)
    shared = [rng.randrange(100, 30000) for _ in range(48)]
    for _ in range(requests):
        prompt = shared[: rng.randrange(0, 48)] + [
            rng.randrange(100, 30000) for _ in range(rng.randrange(4, 120))
        ]
        driver.submit(prompt, rng.randrange(30, 100))
    return driver


def _run(
    driver: Driver, steps: int = 2000
) -> list[tuple[str, tuple[str, ...], tuple[int, ...], tuple[int, ...]]]:
    """Step until idle; each step's kind, rows and lengths (what SGLang would forward)."""
    outputs: list[tuple[str, tuple[str, ...], tuple[int, ...], tuple[int, ...]]] = []
    for _ in range(steps):
        kind = driver.step()
        if kind == "idle" and not driver.waiting and driver.chunked_req is None:
            break
        batch = driver.running
        rows: tuple[int, ...] = ()
        lens: tuple[int, ...] = ()
        if batch.reqs and batch.req_pool_indices_cpu is not None:
            rows, lens = (
                tuple(batch.req_pool_indices_cpu.tolist()),
                tuple(batch.seq_lens_cpu.tolist()),
            )
        outputs.append((kind, tuple(r.rid for r in batch.reqs), rows, lens))
    return outputs


@pytest.mark.parametrize(("page_size", "kv_tokens"), [(1, 420), (16, 640)])
def test_default_lifecycle_runs_hundreds_of_steps_without_a_divergence(
    topology: None, page_size: int, kv_tokens: int
) -> None:
    driver = _loaded(page_size, kv_tokens)
    with Watch() as watch:
        steps = _run(driver)
    assert watch.divergences == []
    assert len(steps) >= 250
    assert driver.finished == 40  # every request ran to its length
    assert max(len(rids) for _, rids, _, _ in steps) >= 4  # requests ran together
    assert driver.retracted > 0  # memory pressure retracted and re-admitted requests
    assert driver.chunks > 0  # prompts over the chunk size were prefilled in chunks
    assert {s.operation for s in watch.trace} >= {
        "prepare_for_extend",
        "prepare_for_decode",
        "filter_batch",
        "merge_batch",
        "retract_decode",
    }
    assert driver.tree_cache.evictable_size() > 0  # finished requests left their KV cached


def test_watch_never_changes_what_sglang_does(topology: None) -> None:
    without = _run(_loaded(1, 420, seed=3))
    with Watch():
        watched = _run(_loaded(1, 420, seed=3))
    assert watched == without


def _first_divergence(driver: Driver) -> Divergence:
    with Watch() as watch, pytest.raises(Divergence) as raised:
        _run(driver)
    assert watch.divergences == [raised.value]
    return raised.value


def _patch(monkeypatch: pytest.MonkeyPatch, name: str, after: Any) -> None:
    """Reintroduce a bug: run SGLang's method, then `after(batch)`."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    original = getattr(ScheduleBatch, name)

    def patched(batch: Any, *args: object, **kwargs: object) -> object:
        result = original(batch, *args, **kwargs)
        after(batch)
        return result

    monkeypatch.setattr(ScheduleBatch, name, patched)


def test_a_decode_batch_built_without_req_pool_indices_cpu_is_named(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch(monkeypatch, "prepare_for_decode", lambda b: setattr(b, "req_pool_indices_cpu", None))
    divergence = _first_divergence(_loaded(1, 420))
    assert divergence.operation == "prepare_for_decode"
    assert (divergence.violation.field, divergence.violation.actual) == (
        "req_pool_indices_cpu",
        "None",
    )


def test_seq_lens_sum_drifting_from_seq_lens_cpu_is_named(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stale sum: the one before this decode's new token.
    _patch(
        monkeypatch,
        "prepare_for_decode",
        lambda b: setattr(b, "seq_lens_sum", int(b.seq_lens_cpu.sum()) - len(b.reqs)),
    )
    divergence = _first_divergence(_loaded(16, 640))
    assert (divergence.operation, divergence.violation.field) == (
        "prepare_for_decode",
        "seq_lens_sum",
    )
    assert divergence.violation.expected.startswith("sum(seq_lens_cpu) = ")


def test_stale_rows_of_an_empty_filter_merged_back_are_named(topology: None) -> None:
    driver = _loaded(1, 420, requests=6)
    driver.step()  # one prefill batch of every request
    from sglang.srt.mem_cache.common import release_kv_cache

    for req in driver.running.reqs:  # every request leaves (an abort), as SGLang does it
        release_kv_cache(req, driver.tree_cache, checkpoint=False)
    with Watch() as watch, pytest.raises(Divergence) as raised:
        stale = driver.running
        stale.filter_batch(keep_indices=[])  # SGLang keeps the old tensors behind reqs == []
        driver.submit([7, 8, 9], 4)
        fresh = driver._prefill()
        stale.merge_batch(fresh)  # the missing is_empty() guard: old rows come back
    assert raised.value.operation == "merge_batch"
    assert raised.value.violation.check == "row count"
    assert [s.operation for s in watch.trace][:2] == ["filter_batch", "prepare_for_extend"]


def test_a_slot_freed_while_its_row_still_reads_it_is_named(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch(
        monkeypatch,
        "prepare_for_decode",
        lambda b: b.token_to_kv_pool_allocator.free(b.out_cache_loc[:1]),
    )
    divergence = _first_divergence(_loaded(1, 420))
    assert (divergence.operation, divergence.violation.check) == (
        "prepare_for_decode",
        "freed while held",
    )
    assert divergence.violation.request == "r0"


def test_a_lock_never_released_is_named_at_the_release(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.mem_cache.radix_cache import RadixCache

    original = RadixCache.unlock
    monkeypatch.setattr(RadixCache, "unlock", lambda cache, lock, *a, **k: None)
    driver = _loaded(1, 420)
    divergence = _first_divergence(driver)
    monkeypatch.setattr(RadixCache, "unlock", original)
    assert divergence.violation.check == "lock leaked"
    assert divergence.violation.field == "tree_cache.protected_size()"
    assert divergence.operation == "release_kv_cache"
    released = divergence.violation.request  # the request whose release kept its lock
    assert released.startswith("r") and "," not in released


def test_pages_allocated_twice_to_two_rows_are_named(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def double(batch: Any) -> None:
        if len(batch.reqs) >= 2:  # the second row's first new page is the first row's
            first, second = batch.reqs[0].kv, batch.reqs[1].kv
            table = batch.req_to_token_pool.req_to_token
            table[second.req_pool_idx, second.cache_protected_len] = table[
                first.req_pool_idx, first.cache_protected_len
            ]

    _patch(monkeypatch, "prepare_for_extend", double)
    divergence = _first_divergence(_loaded(1, 420))
    assert (divergence.operation, divergence.violation.check) == (
        "prepare_for_extend",
        "owned twice",
    )
    assert divergence.violation.request == "r1"


def test_a_batch_whose_fields_moved_is_refused_by_name(topology: None) -> None:
    driver = _loaded(1, 420, requests=2)
    driver.step()
    chunked = [] if driver.chunked_req is None else [driver.chunked_req]
    assert audit(driver.running, also_live=chunked).ok
    moved = SimpleNamespace(
        **{f: getattr(driver.running, f) for f in BATCH_FIELDS if f != "req_pool_indices_cpu"}
    )
    with pytest.raises(UnsupportedSGLang, match=r"'req_pool_indices_cpu'.*0\.5\.23"):
        audit(moved)
    assert audit(driver.running, also_live=chunked).ok  # nothing changed


def test_the_trace_names_every_call_and_lands_on_disk(
    topology: None, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch(monkeypatch, "prepare_for_decode", lambda b: setattr(b, "seq_lens_sum", -1))
    trace = tmp_path / "trace.jsonl"
    with Watch(on_divergence="log", trace_path=trace) as watch:
        _run(_loaded(1, 420, requests=4))
    lines = trace.read_text().splitlines()
    assert len(lines) == len(watch.trace) > 10
    assert len(watch.divergences) > 1  # "log" goes on past the first
    assert '"operation": "prepare_for_extend"' in lines[0]


def test_a_chunk_written_over_its_previous_chunk_is_named(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def overwrite(batch: Any) -> None:
        req = batch.chunked_req
        if req is not None and req.kv.cache_protected_len > 0 and req in batch.reqs:
            table, kv = batch.req_to_token_pool.req_to_token, req.kv
            # The previous chunk's last page handed out again to this chunk.
            table[kv.req_pool_idx, kv.cache_protected_len - 1] = table[
                kv.req_pool_idx, kv.cache_protected_len
            ]

    _patch(monkeypatch, "prepare_for_extend", overwrite)
    divergence = _first_divergence(_loaded(1, 420))
    assert (divergence.operation, divergence.violation.check) == (
        "prepare_for_extend",
        "prefix row",
    )


def _free_row_twice(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Reintroduce a double free: `ReqToTokenPool.free` gives the row back twice. Returns
    the rids whose row it freed twice, in order."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    original = ReqToTokenPool.free

    def twice(pool: Any, req: Any) -> None:
        row = req.kv.req_pool_idx
        original(pool, req)
        pool.free_rows([row])
        freed.append(req.rid)

    freed: list[str] = []
    monkeypatch.setattr(ReqToTokenPool, "free", twice)
    return freed


def _share_one_row(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Reintroduce a double allocation: the second request a call admits gets the first's
    row (its own row goes back to the free list). Returns the rids given one row."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    original = ReqToTokenPool.alloc

    def shared(pool: Any, reqs: list[Any]) -> Any:
        new = [r for r in reqs if not r.kv.holds_kv]
        rows = original(pool, reqs)
        if rows is not None and len(new) >= 2:
            pool.free_rows([new[1].kv.req_pool_idx])
            new[1].kv.req_pool_idx = new[0].kv.req_pool_idx
            rows = [r.kv.req_pool_idx for r in reqs]
            given.extend([new[0].rid, new[1].rid])
        return rows

    given: list[str] = []
    monkeypatch.setattr(ReqToTokenPool, "alloc", shared)
    return given


def _leak_on_release(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Reintroduce a leak: a row's KV given back short of its last page, where it gives
    back more than one. Returns the rows it leaked from, in order."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    original = RadixCache.free_kv_row

    def short(tree: Any, kv: Any, ranges: list[tuple[int, int]]) -> None:
        start, end = ranges[-1]
        page = int(tree.page_size)
        if end - start > page:
            ranges = [*ranges[:-1], (start, end - page)]
            leaked.append(int(kv.req_pool_idx))
        original(tree, kv, ranges)

    leaked: list[int] = []
    monkeypatch.setattr(RadixCache, "free_kv_row", short)
    return leaked


def test_a_row_given_back_twice_is_named_at_the_release(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    freed = _free_row_twice(monkeypatch)
    divergence = _first_divergence(_loaded(1, 420))
    violation = divergence.violation
    assert (divergence.operation, violation.check) == ("release_kv_cache", "row given back twice")
    assert violation.field == "req_to_token_pool.free_slots"
    assert violation.request == freed[0] and violation.actual.endswith("freed 2 times")


def test_one_row_given_to_two_requests_is_named_at_the_extend(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    given = _share_one_row(monkeypatch)
    divergence = _first_divergence(_loaded(1, 420))
    violation = divergence.violation
    assert (divergence.operation, violation.check) == ("prepare_for_extend", "row shared")
    assert violation.field == "req.kv.req_pool_idx"
    assert violation.request == ", ".join(given[:2])


def test_kv_leaked_by_a_release_is_named_at_the_release(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    leaked = _leak_on_release(monkeypatch)
    with Watch() as watch, pytest.raises(Divergence) as raised:
        _run(_loaded(1, 420))
    divergence, violation = raised.value, raised.value.violation
    assert (divergence.operation, violation.check) == ("release_kv_cache", "conservation")
    assert violation.field == "available + evictable + protected + rows' own KV"
    assert watch.trace[-1].rows == (leaked[0],)  # the release that leaked first
    assert violation.request == watch.trace[-1].rids[0]
    assert violation.actual.endswith(f"= {420 - 1}")  # one slot short of the allocator's size


def test_a_chunk_allocated_twice_is_named_at_its_extend(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunked: list[str] = []

    def again(batch: Any) -> None:
        req = batch.chunked_req
        if req is not None and req in batch.reqs:  # the chunk's pages taken a second time
            chunked.append(req.rid)
            batch.token_to_kv_pool_allocator.alloc(req.extend_len)

    _patch(monkeypatch, "prepare_for_extend", again)
    divergence = _first_divergence(_loaded(16, 640))
    violation = divergence.violation
    assert (divergence.operation, violation.check) == ("prepare_for_extend", "conservation")
    assert chunked[0] in violation.request.split(", ")  # the extend's rows, the chunk's among them
