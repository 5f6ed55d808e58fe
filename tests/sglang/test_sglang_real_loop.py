"""`Watch` and `Shadow` riding SGLang's whole scheduler loop on CPU: its own
`get_next_batch_to_run`, `run_batch` (a fake model worker, inputs through the
overlap future map) and `process_batch_result`, in its default configuration
(radix cache, chunked prefill, overlap), with retraction, SGLang's own aborts and
client aborts mid-chunk and mid-decode. Skipped when SGLang is not installed."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

import torch

from batchstate.sglang import Divergence, Shadow, ShadowDivergence, Watch, cpu_topology
from batchstate.sglang.fake_worker import next_token
from batchstate.sglang.scheduler_loop import SchedulerLoop

pytestmark = SGLANG_MARKS

KV_TOKENS = {1: 800, 16: 1024}  # short enough that decoding runs out and retracts
CHUNK = 128


@contextmanager
def _topology(page_size: int) -> Iterator[None]:
    # SGLang's defaults (radix cache on) but the chunk and the limits a model would set.
    with cpu_topology(
        chunked_prefill_size=CHUNK,
        page_size=page_size,
        max_running_requests=16,
        pp_max_micro_batch_size=16,
    ):
        yield


class Workload:
    """Seeded requests sharing prefixes of one system prompt: some page-exact, some over
    the chunk, some asking 0 or 1 new tokens, one over the KV budget (SGLang aborts it at
    admission); outputs long enough to retract. `run` steps the loop to idle, aborting a
    request now and then as a client does (a request between chunks, or a running one)."""

    def __init__(self, loop: SchedulerLoop, seed: int, requests: int = 40) -> None:
        self.loop = loop
        self.rng = random.Random(seed)
        page = loop.driver.page_size
        shared = [self.rng.randrange(100, 30000) for _ in range(48)]
        self.prompts: dict[str, list[int]] = {}
        for n in range(requests):
            head = shared[: self.rng.randrange(0, 48)]
            prompt = head + [
                self.rng.randrange(100, 30000) for _ in range(self.rng.randrange(4, 300))
            ]
            if n % 7 == 3:  # page-exact: whole pages, nothing more
                prompt = prompt[: max(page, len(prompt) // page * page)]
            new = {0: 0, 5: 1}.get(n % 10, self.rng.randrange(30, 100))
            self._submit(prompt, new)
        kv_tokens = int(loop.driver.allocator.size)
        self._submit([self.rng.randrange(100, 30000) for _ in range(kv_tokens + 8)], 4)
        self.aborted_mid_chunk = 0
        self.aborted_mid_decode = 0

    def _submit(self, prompt: list[int], max_new_tokens: int) -> None:
        self.prompts[f"r{len(self.prompts)}"] = prompt
        self.loop.submit(prompt, max_new_tokens)

    def run(self, steps: int = 5000) -> int:
        taken = 0
        while self.loop.busy and taken < steps:
            self._maybe_abort(taken)
            self.loop.step()
            taken += 1
        return taken

    def _maybe_abort(self, step: int) -> None:
        scheduler = self.loop.scheduler
        # SGLang aborts every rid starting with the one given: pick rids no other extends.
        unique = {
            r for r in self.prompts if not any(o != r and o.startswith(r) for o in self.prompts)
        }
        chunked = scheduler.chunked_req
        running = [r for r in scheduler.running_batch.reqs if not r.finished() and r.rid in unique]
        first = self.aborted_mid_chunk == 0
        if chunked is not None and chunked.rid in unique and (first or self.rng.random() < 0.04):
            self.loop.abort(chunked.rid)
            self.aborted_mid_chunk += 1
        elif running and step % 150 == 75:
            self.loop.abort(self.rng.choice(running).rid)
            self.aborted_mid_decode += 1

    def expected(self, rid: str, count: int) -> list[int]:
        """The fake model's first `count` tokens after `rid`'s prompt (greedy)."""
        prompt, out = self.prompts[rid], []
        last = prompt[-1]
        for k in range(count):
            last = int(next_token(torch.tensor(last), torch.tensor(len(prompt) - 1 + k)))
            out.append(last)
        return out


def _check_end_state(loop: SchedulerLoop, workload: Workload) -> None:
    """Every request left, SGLang's pools hold nothing for any of them, and every output
    is what the fake model computes from the request's own inputs and positions."""
    outputs = loop.outputs
    assert not loop.busy
    assert set(outputs.finished) | set(outputs.aborted) == set(workload.prompts)
    pool, allocator, tree = (
        loop.driver.req_to_token_pool,
        loop.driver.allocator,
        loop.driver.tree_cache,
    )
    assert pool.available_size() == pool.size
    assert tree.protected_size() == 0
    assert allocator.available_size() + tree.evictable_size() == allocator.size
    for rid, reason in outputs.finished.items():
        tokens = outputs.tokens[rid]
        if reason == "FINISH_LENGTH":
            assert tokens == workload.expected(rid, len(tokens)), rid
    over_budget = f"r{len(workload.prompts) - 1}"  # longer than the KV pool
    assert outputs.finished[over_budget] == "FINISH_ABORT"


# SGLang's default (overlap) over three seeds at both page sizes, the normal loop over
# one: about 12 to 20 s a cell on a shared 2-core machine, none marked slow.
CELLS = [
    *[(page, True, seed) for page in (1, 16) for seed in (1, 2, 3)],
    *[(page, False, 1) for page in (1, 16)],
]


@pytest.mark.parametrize(("page", "overlap", "seed"), CELLS)
def test_watch_and_shadow_follow_the_real_loop_without_a_finding(
    page: int, overlap: bool, seed: int
) -> None:
    with _topology(page):
        loop = SchedulerLoop(page_size=page, kv_tokens=KV_TOKENS[page], rows=16, overlap=overlap)
        workload = Workload(loop, seed)
        with Watch() as watch, Shadow() as shadow:  # each raises at its first finding
            steps = workload.run()
        _check_end_state(loop, workload)
    assert watch.divergences == [] and shadow.divergences == []
    assert steps >= 300 and loop.worker.forwards >= 300
    ops = {op.op for op in shadow.operations}
    assert {"prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch"} <= ops
    assert workload.aborted_mid_chunk > 0 and workload.aborted_mid_decode > 0


def _overlap_workload(requests: int, page: int = 16) -> Workload:
    loop = SchedulerLoop(page_size=page, kv_tokens=KV_TOKENS[page], rows=16, overlap=True)
    return Workload(loop, seed=1, requests=requests)


def test_a_reintroduced_seq_lens_sum_drift_is_named_at_its_call_under_the_real_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _topology(16):
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        original = ScheduleBatch.prepare_for_decode

        def drifting(batch: ScheduleBatch) -> None:
            original(batch)
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum()) - len(batch.reqs)

        monkeypatch.setattr(ScheduleBatch, "prepare_for_decode", drifting)
        for checker, error in ((Watch, Divergence), (Shadow, ShadowDivergence)):
            workload = _overlap_workload(requests=8)
            with checker(), pytest.raises(error) as raised:
                workload.run()
            if isinstance(raised.value, Divergence):
                assert raised.value.operation == "prepare_for_decode"
                assert raised.value.violation.check == "seq_lens_sum"
            else:
                assert isinstance(raised.value, ShadowDivergence)
                found = raised.value.mismatch
                assert (found.op, found.field) == ("prepare_for_decode", "seq_lens_sum")


def test_a_lock_leaked_by_result_processing_is_named_at_its_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _topology(16):
        from sglang.srt.mem_cache.radix_cache import RadixCache

        monkeypatch.setattr(RadixCache, "unlock", lambda cache, lock, *a, **k: None)
        workload = _overlap_workload(requests=8)
        with Shadow(), pytest.raises(ShadowDivergence) as raised:
            workload.run()
    # process_batch_result checkpoints a prefilled request: it locks the request's new
    # tree node and (here, no longer) unlocks its old one; named at that very call.
    assert (raised.value.mismatch.op, raised.value.mismatch.field) == (
        "checkpoint_kv_cache",
        "protected_tokens",
    )


def test_the_launchers_choice_logs_what_it_cannot_read_once_and_detaches(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from batchstate.sglang import UnsupportedSGLang, watch

    def moved(batch: object, **kwargs: object) -> None:
        raise UnsupportedSGLang("ScheduleBatch", "req_pool_indices_cpu")

    monkeypatch.setattr(watch, "audit", moved)
    with _topology(16), caplog.at_level(logging.ERROR, logger="batchstate.sglang"):
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        original = ScheduleBatch.prepare_for_extend
        workload = _overlap_workload(requests=6)
        with Watch(on_unsupported="detach") as attached:
            workload.run()  # SGLang runs on to the end
    assert not workload.loop.busy and attached.divergences == []
    detached = [r for r in caplog.records if "detached Watch" in r.getMessage()]
    assert len(detached) == 1 and "req_pool_indices_cpu" in detached[0].getMessage()
    assert ScheduleBatch.prepare_for_extend is original  # SGLang's own method is back


def test_a_request_left_in_the_last_extend_batch_keeps_the_loop_busy() -> None:
    with _topology(16):
        loop = SchedulerLoop(page_size=16, kv_tokens=1024, rows=4)
        loop.submit(list(range(100, 140)), 5)
        assert loop.step() == "prefill"
        s = loop.scheduler
        # Nothing waits, nothing runs yet: the request is only in the last (extend) batch,
        # merged into the running batch at the next turn.
        busy = loop.busy
        assert not s.waiting_queue and s.running_batch.is_empty() and busy
        while loop.busy:
            loop.step()
    assert loop.outputs.finished == {"r0": "FINISH_LENGTH"}
    assert len(loop.outputs.tokens["r0"]) == 5
