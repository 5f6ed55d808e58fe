"""SGLang's mixed chunk (`enable_mixed_chunk`: a prefill chunk and the running decode
rows in one forward, `ScheduleBatch.mix_with_running`) run by SGLang's own scheduler on
CPU under `Watch` and `Shadow`. Skipped when SGLang is not installed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from batchstate.sglang import Divergence, Shadow, ShadowDivergence, Watch, cpu_topology
from batchstate.sglang.scheduler_loop import SchedulerLoop

pytestmark = SGLANG_MARKS

PAGE = 16


@pytest.fixture(scope="module")
def topology() -> Iterator[None]:
    with cpu_topology(
        chunked_prefill_size=128,
        page_size=PAGE,
        max_running_requests=16,
        pp_max_micro_batch_size=16,
        enable_mixed_chunk=True,
    ):
        yield


def _loaded(*, overlap: bool = False, requests: int = 40) -> SchedulerLoop:
    """Requests sharing prefixes of a system prompt, many over the 128-token chunk, so
    that chunks are mixed with the running rows' decodes."""
    loop = SchedulerLoop(page_size=PAGE, kv_tokens=1024, rows=16, overlap=overlap)
    # Scheduler.init_chunked_prefill sets it from the published arguments; the loop
    # does not run that step (it reads the model's configuration).
    loop.scheduler.is_mixed_chunk = True
    rng = random.Random(1)
    shared = [rng.randrange(100, 30000) for _ in range(48)]
    for _ in range(requests):
        head = shared[: rng.randrange(0, 48)]
        tail = [rng.randrange(100, 30000) for _ in range(rng.randrange(4, 300))]
        loop.submit(head + tail, rng.randrange(30, 100))
    return loop


def _run(loop: SchedulerLoop) -> list[tuple[str, tuple[str, ...], tuple[int, ...]]]:
    """Step until every request left: each batch's forward mode, rids and lengths."""
    steps: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = []
    while loop.busy and len(steps) < 4000:
        loop.step()
        batch = loop.scheduler.last_batch
        if batch:
            lens = tuple(batch.seq_lens_cpu.tolist())
            steps.append((batch.forward_mode.name, tuple(r.rid for r in batch.reqs), lens))
    return steps


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_mixed_steps_run_under_the_watch_without_a_finding(topology: None, overlap: bool) -> None:
    without = _run(_loaded(overlap=overlap))
    with Watch() as watch:
        steps = _run(_loaded(overlap=overlap))
    assert watch.divergences == []
    assert steps == without  # the watch changes nothing SGLang does
    mixed = [rids for mode, rids, _ in steps if mode == "MIXED"]
    assert len(steps) >= 600 and len(mixed) >= 50
    assert max(map(len, mixed)) >= 4  # a chunk beside several decoding rows
    assert "mix_with_running" in {s.operation for s in watch.trace}


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_mixed_steps_run_under_the_shadow_without_a_divergence(
    topology: None, overlap: bool
) -> None:
    loop = _loaded(overlap=overlap)
    with Shadow() as shadow:
        steps = _run(loop)
    assert shadow.divergences == [] and not loop.busy
    assert sum(mode == "MIXED" for mode, _, _ in steps) >= 50
    mixes = [op for op in shadow.operations if op.op == "mix_with_running"]
    assert len(mixes) >= 50
    # A chunk cut by the budget rode in a mixed batch, held, not a row, until filtered out.
    assert any(op.state.held for op in mixes)
    released = {op.rid for op in shadow.operations if op.op == "release_kv_cache"}
    assert released == {f"r{n}" for n in range(40)}


def _tails_from_request_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reintroduce a bug: the mixed batch's decode tails take their `seq_lens_cpu` from
    request state (`req.seqlen`), as the speculative branch of `mix_with_running` does.
    Under the overlap loop the request's output lags its row by the token in flight."""
    import torch
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    original = ScheduleBatch.mix_with_running

    def mix_with_running(batch: Any, running_batch: Any) -> None:
        tails = [int(r.seqlen) for r in running_batch.reqs]
        original(batch, running_batch)
        batch.seq_lens_cpu = torch.cat(
            [batch.seq_lens_cpu[: -len(tails)], torch.tensor(tails, dtype=torch.int64)]
        )

    monkeypatch.setattr(ScheduleBatch, "mix_with_running", mix_with_running)


def test_a_mixed_tail_length_from_request_state_is_named_by_the_watch(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tails_from_request_state(monkeypatch)
    with Watch() as watch, pytest.raises(Divergence) as raised:
        _run(_loaded(overlap=True, requests=12))
    assert watch.divergences == [raised.value]
    assert raised.value.operation == "mix_with_running"
    assert (raised.value.violation.check, raised.value.violation.field) == (
        "cpu mirror",
        "seq_lens_cpu",
    )


def test_a_mixed_tail_length_from_request_state_is_named_by_the_shadow(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tails_from_request_state(monkeypatch)
    with Shadow() as shadow, pytest.raises(ShadowDivergence) as raised:
        _run(_loaded(overlap=True, requests=12))
    assert shadow.divergences == [raised.value]
    mismatch = raised.value.mismatch
    assert (mismatch.op, mismatch.field) == ("mix_with_running", "seq_len")
    assert int(mismatch.sglang) == int(mismatch.batchstate) - 1  # the token in flight
