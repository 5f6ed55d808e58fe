"""SGLang's own scheduler loop (`get_next_batch_to_run`, `run_batch` with a fake model
worker, `process_batch_result`) stepped on CPU, with the `Shadow` and the `Watch`
attached. Skipped when SGLang is not installed."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from batchstate.sglang import Shadow, Watch, cpu_topology
from batchstate.sglang.scheduler_loop import SchedulerLoop

pytestmark = SGLANG_MARKS

Step = tuple[str, tuple[str, ...], tuple[int, ...], bool]


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def page_size(request: pytest.FixtureRequest) -> Iterator[int]:
    # SGLang's defaults but the chunk (128 tokens) and the limits the model would set.
    with cpu_topology(
        chunked_prefill_size=128,
        page_size=request.param,
        max_running_requests=16,
        pp_max_micro_batch_size=16,
    ):
        yield request.param


def _loaded(page_size: int, seed: int = 1, *, overlap: bool = False) -> SchedulerLoop:
    """40 requests sharing prefixes of one system prompt, some over the 128-token chunk,
    with outputs long enough to run the KV pool short (retraction)."""
    kv_tokens = 800 if page_size == 1 else 1024
    loop = SchedulerLoop(page_size=page_size, kv_tokens=kv_tokens, rows=16, overlap=overlap)
    rng = random.Random(seed)
    shared = [rng.randrange(100, 30000) for _ in range(48)]
    for _ in range(40):
        head = shared[: rng.randrange(0, 48)]
        tail = [rng.randrange(100, 30000) for _ in range(rng.randrange(4, 300))]
        loop.submit(head + tail, rng.randrange(30, 100))
    return loop


def _run(loop: SchedulerLoop) -> list[Step]:
    """Step until every request left; each step's kind, the batch SGLang ran (rids,
    lengths) and whether a request was held between chunks."""
    steps: list[Step] = []
    while loop.busy and len(steps) < 4000:
        kind = loop.step()
        batch = loop.scheduler.last_batch
        rids = tuple(r.rid for r in batch.reqs) if batch else ()
        lens = tuple(batch.seq_lens_cpu.tolist()) if batch else ()
        steps.append((kind, rids, lens, loop.scheduler.chunked_req is not None))
    return steps


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_the_real_scheduler_runs_hundreds_of_steps_under_the_shadow(
    page_size: int, overlap: bool
) -> None:
    loop = _loaded(page_size, overlap=overlap)
    with Watch() as watch, Shadow() as shadow:
        steps = _run(loop)
    assert shadow.divergences == [] and watch.divergences == []
    assert not loop.busy and len(steps) >= 500
    released = {op.rid for op in shadow.operations if op.op == "release_kv_cache"}
    assert released >= {f"r{n}" for n in range(40)}  # every request left
    assert any(chunked for *_, chunked in steps)  # prompts over 128 tokens were chunked
    assert max(len(rids) for _, rids, _, _ in steps) >= 4  # requests ran together
    ops = {op.op for op in shadow.operations}
    assert ops >= {"prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch"}
    assert "retract_decode" in ops  # SGLang's update_running_batch retracted under pressure
    assert any(p for op in shadow.operations for p in op.state.prefix_lens)  # cache hits
    # Under overlap a finishing request leaves the batch before its result is processed.
    assert loop.scheduler.enable_skip_finishing_decode == overlap


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_the_shadow_changes_nothing_the_real_scheduler_does(page_size: int, overlap: bool) -> None:
    without = _run(_loaded(page_size, seed=2, overlap=overlap))
    with Shadow() as shadow:  # raises at the first divergence
        shadowed = _run(_loaded(page_size, seed=2, overlap=overlap))
    assert shadowed == without
    assert shadow.divergences == []


@pytest.mark.parametrize("seed", range(1, 7))
def test_the_overlap_loop_runs_seed_after_seed_without_a_divergence(
    page_size: int, seed: int
) -> None:
    loop = _loaded(page_size, seed, overlap=True)
    with Shadow() as shadow:
        steps = _run(loop)
    assert shadow.divergences == [] and not loop.busy and len(steps) >= 500
    # Requests were admitted while a prefill they may share pages with was in flight:
    # each read what SGLang's cache held then, not what batchstate had published.
    assert shadow.replica is not None and shadow.replica.capped > 0
