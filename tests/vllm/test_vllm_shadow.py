"""`Shadow` beside vLLM 0.33's real v1 scheduler (sync and async), `replay` of its traces,
and bugs reintroduced into vLLM, each named at its step. Skipped when vLLM is absent."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM 0.33 is not installed: docs/vllm.md#install gives the commands",
        allow_module_level=True,
    )

from batchstate.cli import main
from batchstate.vllm import Shadow, ShadowDivergence, ShadowError, TraceError, replay
from batchstate.vllm.drive import Driven, SchedulerShape, drive, make_scheduler
from batchstate.vllm.worker import Worker

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
    ),
    pytest.mark.xdist_group("vllm"),
]

SMALL = 40  # blocks of 16 tokens: the workload's requests preempt one another


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_thousands_of_steps_under_preemption_without_a_finding(
    async_scheduling: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = make_scheduler(SchedulerShape(num_blocks=SMALL, async_scheduling=async_scheduling))
    trace = tmp_path / "trace.jsonl"
    shadow = Shadow(scheduler, trace_path=trace)
    moves = _count_row_moves(monkeypatch)
    with shadow:
        driven = _drive_with_worker(shadow, scheduler, Worker(scheduler), seed=1)
    assert shadow.divergences == []
    # Every schedule and output compared, and the input batch's two sides after each schedule.
    assert len(shadow.steps) >= 4 * driven.steps
    assert moves["move_row"] > 50 and moves["swap_row"] > 50  # condense and the reordering ran
    # The workload did what it claims: preemptions, aborts, prefix hits, evictions.
    assert driven.preempted > 50 and driven.aborted > 10
    assert sum(1 for s in shadow.steps for e in s.events if getattr(e, "hit", 0)) > 50
    assert sum(1 for s in shadow.steps for e in s.events if type(e).__name__ == "Evict") > 50
    done = replay(trace)
    assert done.mismatch is None and done.operations == len(shadow.steps)
    assert main(["replay", str(trace)]) == 0


def test_a_roomy_cache_keeps_every_prefix_and_never_preempts() -> None:
    scheduler = make_scheduler(SchedulerShape(num_blocks=2000))
    with Shadow(scheduler) as shadow:
        driven = drive(scheduler, 400, seed=2)
    assert shadow.divergences == [] and driven.preempted == 0
    # Detached: the scheduler, its manager and its pool run vLLM's own methods again.
    manager = scheduler.kv_cache_manager
    assert not {"schedule", "update_from_output", "finish_requests"} & set(vars(scheduler))
    assert not {"allocate_slots", "free"} & set(vars(manager))
    assert "_maybe_evict_cached_block" not in vars(manager.block_pool)


def _drive_with_worker(shadow: Shadow, scheduler: Any, worker: Worker, seed: int) -> Driven:
    def scheduled(output: Any) -> None:
        worker.update(output)
        shadow.check_input_batch(worker.batch, output)

    return drive(scheduler, 1500, seed, on_schedule=scheduled, on_output=worker.sampled)


def _count_row_moves(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often vLLM's block table moves a row (condense) and swaps two (the reordering)."""
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    counts = {"move_row": 0, "swap_row": 0}
    for name in counts:
        original = getattr(MultiGroupBlockTable, name)

        def counted(
            self: Any, src: int, tgt: int, name: str = name, original: Any = original
        ) -> None:
            counts[name] += 1
            original(self, src, tgt)

        monkeypatch.setattr(MultiGroupBlockTable, name, counted)
    return counts


def _inject(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, bug: Callable[..., Any]
) -> list[int]:
    """Replace `owner.name` by `bug(original, self, ...)`; the list gets the shadow step at
    which the bug first acted."""
    original = getattr(owner, name)
    acted: list[int] = []

    def buggy(self: Any, *args: Any, **kwargs: Any) -> Any:
        return bug(original, acted, self, *args, **kwargs)

    monkeypatch.setattr(owner, name, buggy)
    return acted


def _run_until_divergence(shadow: Shadow, scheduler: Any) -> ShadowDivergence:
    with pytest.raises(ShadowDivergence) as caught, shadow:
        _drive_with_worker(shadow, scheduler, Worker(scheduler), seed=3)
    return caught.value


def test_a_duplicate_cached_block_evicted_leaves_its_twin_hit(tmp_path: Path) -> None:
    """A prompt of exactly two blocks hits only its first (vLLM computes at least its last
    token), so a second request with it caches a twin of the first's second block under the
    same hash. Evicting one twin leaves the prefix cached in vLLM: batchstate keeps it too."""
    import random

    from batchstate.vllm.drive import fake_output, make_request

    scheduler = make_scheduler(SchedulerShape(num_blocks=10))
    pool = scheduler.kv_cache_manager.block_pool
    rng = random.Random(0)
    prompt = list(range(1, 33))
    shadow = Shadow(scheduler, trace_path=tmp_path / "t.jsonl")

    def run(rid: str, tokens: list[int]) -> Any:
        scheduler.add_request(make_request(rid, tokens, 1))
        output = scheduler.schedule()
        scheduler.update_from_output(output, fake_output(scheduler, output, rng))
        return output.scheduled_new_reqs[0]

    def copies(key: Any) -> int:  # the blocks vLLM caches under one hash
        held = pool.cached_block_hash_to_block._cache.get(key)
        return 0 if held is None else len(held) if isinstance(held, dict) else 1

    with shadow:
        first, second = run("a", prompt), run("b", prompt)
        assert second.num_computed_tokens == 16
        assert first.block_ids[0][0] == second.block_ids[0][0]  # the hit
        assert first.block_ids[0][1] != second.block_ids[0][1]  # the twin
        key = pool.blocks[second.block_ids[0][1]].block_hash
        assert copies(key) == 2
        # Seven blocks: the six uncached free ones, then the head of the cached ones, a twin.
        filler = run("f", list(range(500, 611)))
        assert first.block_ids[0][1] in filler.block_ids[0]
        assert copies(key) == 1
        evicted = [e for step in shadow.steps for e in step.events if type(e).__name__ == "Evict"]
        assert evicted == []  # the other twin still holds the prefix
        again = run("c", [*prompt, *[7] * 17])
    assert again.num_computed_tokens == 32  # both blocks hit, the second in the other twin
    assert shadow.divergences == []
    assert replay(tmp_path / "t.jsonl").mismatch is None


def test_vllm_evicts_no_block_from_the_middle_of_a_cached_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each prefix vLLM evicts ends a cached chain: batchstate, which caches what vLLM
    caches, holds no cached page below it (docs/vllm.md, "Eviction", says why)."""
    from batchstate.pools.eviction import unlocked_leaves
    from batchstate.vllm.replica import Evict, Replica

    ends: list[bool] = []
    original = Replica.evict

    def evict(self: Replica, event: Evict) -> None:
        # An unlocked leaf has no cached page below it; and no other leaf extends it.
        prefix = event.tokens
        below = [leaf for leaf, _ in unlocked_leaves(self.pools) if leaf[: len(prefix)] == prefix]
        ends.append(below == [prefix])
        original(self, event)

    monkeypatch.setattr(Replica, "evict", evict)
    scheduler = make_scheduler(SchedulerShape(num_blocks=SMALL))
    with Shadow(scheduler) as shadow:
        drive(scheduler, 400, seed=3)
    assert shadow.divergences == []
    assert len(ends) > 50 and all(ends)


def test_a_device_copy_left_stale_by_condense_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit that copies only the rows written since the last one (appended, added,
    cleared) and forgets the rows condense() moved and the reordering swapped."""
    from vllm.v1.worker.block_table import BlockTable

    scheduler = make_scheduler(SchedulerShape(num_blocks=SMALL))
    shadow = Shadow(scheduler)
    dirty: dict[int, set[int]] = {}
    moved: list[int] = []

    def tracked(name: str) -> None:
        original = getattr(BlockTable, name)

        def write(self: Any, *args: Any) -> None:
            original(self, *args)
            dirty.setdefault(id(self), set()).add(args[-1])

        monkeypatch.setattr(BlockTable, name, write)

    for name in ("append_row", "add_row", "clear_row"):
        tracked(name)

    def untracked(name: str) -> None:
        original = getattr(BlockTable, name)

        def move(self: Any, src: int, tgt: int) -> None:
            original(self, src, tgt)
            if not moved:
                moved.append(len(shadow.steps))

        monkeypatch.setattr(BlockTable, name, move)

    for name in ("move_row", "swap_row"):
        untracked(name)

    def commit(self: Any, num_reqs: int) -> None:
        rows = sorted(r for r in dirty.pop(id(self), set()) if r < num_reqs)
        table = self.block_table
        table.gpu[rows] = table.cpu[rows]

    monkeypatch.setattr(BlockTable, "commit_block_table", commit)
    found = _run_until_divergence(shadow, scheduler)
    # Named after the schedule whose update first moved or swapped a row: its CPU tensor
    # agrees with batchstate, its device copy does not.
    assert found.mismatch.op == "input_batch device copy"
    assert found.mismatch.step == moved[0] + 1


def test_a_block_freed_while_its_request_holds_it_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler = make_scheduler(SchedulerShape(num_blocks=SMALL))
    shadow = Shadow(scheduler, trace_path=tmp_path / "t.jsonl")

    def bug(original: Any, acted: list[int], self: Any, output: Any) -> Any:
        result = original(self, output)
        manager = self.kv_cache_manager
        if not acted and self.current_step >= 50:
            for blocks in manager.coordinator.single_type_managers[0].req_to_blocks.values():
                if blocks and blocks[0].ref_cnt == 1:
                    manager.block_pool.free_blocks([blocks[0]])  # still in the table
                    acted.append(len(shadow.steps))
                    break
        return result

    acted = _inject(monkeypatch, Scheduler, "_update_after_schedule", bug)
    found = _run_until_divergence(shadow, scheduler)
    assert found.mismatch.step == acted[0] and found.mismatch.op == "schedule"
    assert found.mismatch.field == "free blocks"
    assert int(found.mismatch.vllm) == int(found.mismatch.batchstate) + 1
    assert replay(tmp_path / "t.jsonl").mismatch == found.mismatch


def test_computed_tokens_kept_after_preemption_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler = make_scheduler(SchedulerShape(num_blocks=SMALL))
    shadow = Shadow(scheduler)
    victims: list[str] = []

    def bug(
        original: Any, acted: list[int], self: Any, request: Any, *args: Any, **kwargs: Any
    ) -> Any:
        kept = request.num_computed_tokens
        original(self, request, *args, **kwargs)
        if not acted:
            request.num_computed_tokens = kept  # forgets to start the request over
            acted.append(len(shadow.steps))
            victims.append(request.request_id)

    acted = _inject(monkeypatch, Scheduler, "_preempt_request", bug)
    found = _run_until_divergence(shadow, scheduler)
    assert found.mismatch.step == acted[0] and found.mismatch.request == victims[0]
    # vLLM says it computed tokens it holds no block for; batchstate released them all.
    assert (found.mismatch.field, found.mismatch.vllm, found.mismatch.batchstate) == (
        "holds KV",
        "yes",
        "no",
    )


def test_an_extra_computed_token_is_named_at_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler = make_scheduler(SchedulerShape(num_blocks=SMALL))
    shadow = Shadow(scheduler)
    who: list[str] = []

    def bug(original: Any, acted: list[int], self: Any, output: Any) -> Any:
        result = original(self, output)
        if not acted and self.current_step >= 30 and output.num_scheduled_tokens:
            rid = sorted(output.num_scheduled_tokens)[0]
            self.requests[rid].num_computed_tokens += 1  # advanced one token too far
            acted.append(len(shadow.steps))
            who.append(rid)
        return result

    acted = _inject(monkeypatch, Scheduler, "_update_after_schedule", bug)
    found = _run_until_divergence(shadow, scheduler)
    assert (found.mismatch.step, found.mismatch.request) == (acted[0], who[0])
    assert found.mismatch.field == "computed"
    assert int(found.mismatch.vllm) == int(found.mismatch.batchstate) + 1


def test_a_scheduler_without_prefix_caching_is_refused_by_name() -> None:
    scheduler = make_scheduler(SchedulerShape())
    scheduler.kv_cache_manager.enable_caching = False
    with pytest.raises(ShadowError, match="caching off"):
        Shadow(scheduler)


def test_what_is_not_a_scheduler_is_refused_by_name() -> None:
    with pytest.raises(ShadowError, match="got object"):
        Shadow(object())


def test_a_trace_that_is_not_one_is_refused_by_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"op": "pools", "engine": "vllm", "num_blocks": 4}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:1"):
        replay(bad)
