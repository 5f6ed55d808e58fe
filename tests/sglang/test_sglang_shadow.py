"""`Shadow` beside SGLang's real scheduler bookkeeping, `replay` of its traces, and the
`batchstate replay` command. Skipped when SGLang is not installed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from batchstate.cli import main
from batchstate.sglang import Shadow, ShadowDivergence, cpu_topology, replay
from tests.sglang.test_sglang import (
    _free_row_twice,
    _leak_on_release,
    _loaded,
    _patch,
    _run,
    _share_one_row,
)

pytestmark = SGLANG_MARKS


@pytest.fixture(scope="module")
def topology() -> Iterator[None]:
    with cpu_topology():
        yield


@pytest.mark.parametrize(("page_size", "kv_tokens"), [(1, 420), (16, 640)])
def test_the_shadow_follows_hundreds_of_steps_without_a_divergence(
    topology: None, page_size: int, kv_tokens: int, tmp_path: Path
) -> None:
    driver = _loaded(page_size, kv_tokens)
    trace = tmp_path / "trace.jsonl"
    with Shadow(trace_path=trace) as shadow:
        steps = _run(driver)
    assert shadow.divergences == []
    assert len(steps) >= 250 and driver.finished == 40
    assert driver.retracted > 0 and driver.chunks > 0  # memory pressure, chunked prefill
    ops = {op.op for op in shadow.operations}
    assert ops >= {"prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch"}
    assert ops >= {"retract_decode", "release_kv_cache"}
    assert any(op.evicted for op in shadow.operations)  # SGLang evicted; batchstate followed
    assert any(p for op in shadow.operations for p in op.state.prefix_lens)  # cache hits
    assert shadow.replica is not None
    assert shadow.replica.pools.num_free_slots == driver.req_to_token_pool.available_size()
    done = replay(trace)  # the trace replays through batchstate alone, to the same end
    assert (done.operations, done.mismatch) == (len(shadow.operations), None)


def test_the_shadow_never_changes_what_sglang_does(topology: None) -> None:
    without = _run(_loaded(16, 640, seed=3))
    with Shadow(on_divergence="log") as shadow:  # goes on past any divergence
        shadowed = _run(_loaded(16, 640, seed=3))
    assert shadowed == without
    assert len(shadow.operations) > 500 and shadow.divergences == []


def _first(driver: Any, every: int = 1) -> ShadowDivergence:
    with Shadow(full_check_every=every) as shadow, pytest.raises(ShadowDivergence) as raised:
        _run(driver)
    assert shadow.divergences == [raised.value]
    return raised.value


def _where(divergence: ShadowDivergence) -> tuple[str, str]:
    return divergence.mismatch.op, divergence.mismatch.field


def test_a_decode_batch_built_without_req_pool_indices_cpu_is_named(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch(monkeypatch, "prepare_for_decode", lambda b: setattr(b, "req_pool_indices_cpu", None))
    divergence = _first(_loaded(1, 420))
    assert _where(divergence) == ("prepare_for_decode", "req_pool_indices_cpu rows")
    assert divergence.mismatch.sglang == "-1"


def test_seq_lens_sum_drifting_is_named(topology: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch(
        monkeypatch,
        "prepare_for_decode",
        lambda b: setattr(b, "seq_lens_sum", int(b.seq_lens_cpu.sum()) - len(b.reqs)),
    )
    assert _where(_first(_loaded(16, 640))) == ("prepare_for_decode", "seq_lens_sum")


def test_stale_rows_of_an_empty_filter_merged_back_are_named(topology: None) -> None:
    driver = _loaded(1, 420, requests=6)
    with Shadow() as shadow, pytest.raises(ShadowDivergence) as raised:
        driver.step()  # one prefill batch of every request
        from sglang.srt.mem_cache.common import release_kv_cache

        for req in driver.running.reqs:  # every request leaves (an abort)
            release_kv_cache(req, driver.tree_cache, checkpoint=False)
        stale = driver.running
        stale.filter_batch(keep_indices=[])  # SGLang keeps the old tensors behind reqs == []
        driver.submit([7, 8, 9], 4)
        stale.merge_batch(driver._prefill())  # the missing is_empty() guard
    assert _where(raised.value) == ("merge_batch", "req_pool_indices_cpu rows")
    assert shadow.operations[-2].op == "prepare_for_extend"


def test_a_slot_freed_while_its_row_still_reads_it_is_named(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch(
        monkeypatch,
        "prepare_for_decode",
        lambda b: b.token_to_kv_pool_allocator.free(b.out_cache_loc[:1]),
    )
    divergence = _first(_loaded(1, 420))
    assert _where(divergence) == ("prepare_for_decode", "free_tokens + evictable_tokens")
    assert int(divergence.mismatch.sglang) == int(divergence.mismatch.batchstate) + 1


def test_a_lock_never_released_is_named_at_the_release(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.mem_cache.radix_cache import RadixCache

    monkeypatch.setattr(RadixCache, "unlock", lambda cache, lock, *a, **k: None)
    divergence = _first(_loaded(1, 420))
    assert _where(divergence) == ("release_kv_cache", "protected_tokens")
    released = divergence.mismatch.request  # the request whose release kept its lock
    assert released.startswith("r") and "," not in released


def test_a_chunk_allocated_twice_is_named(topology: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def again(batch: Any) -> None:
        req = batch.chunked_req
        if req is not None and req in batch.reqs:  # the chunk's pages taken a second time
            batch.token_to_kv_pool_allocator.alloc(req.extend_len)

    _patch(monkeypatch, "prepare_for_extend", again)
    divergence = _first(_loaded(16, 640))
    assert divergence.mismatch.field == "free_tokens + evictable_tokens"
    assert divergence.mismatch.op == "checkpoint_kv_cache"  # the chunk's own checkpoint


def test_a_tampered_trace_diverges_at_the_step_changed(topology: None, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    with Shadow(trace_path=trace):
        _run(_loaded(1, 420, requests=8))
    lines = trace.read_text().splitlines()
    assert main(["replay", str(trace)]) == 0
    step = next(
        n for n, line in enumerate(lines[1:]) if json.loads(line)["op"] == "prepare_for_decode"
    )
    op = json.loads(lines[step + 1])
    op["state"]["seq_lens"][0] += 1
    lines[step + 1] = json.dumps(op)
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join(lines) + "\n")
    done = replay(tampered)
    assert done.mismatch is not None
    assert (done.mismatch.step, done.mismatch.field) == (step, "seq_len")
    assert main(["replay", str(tampered)]) == 1


def test_replay_refuses_what_is_not_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"op": "decode"}\n')
    assert main(["replay", str(bad)]) == 2
    assert "the first line must be the pools line" in capsys.readouterr().err


def test_a_batch_whose_fields_moved_is_refused_by_name(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchstate.sglang import UnsupportedSGLang

    # A request from a release that renamed `full_untruncated_fill_ids`.
    _patch(
        monkeypatch,
        "prepare_for_extend",
        lambda b: delattr(b.reqs[0], "full_untruncated_fill_ids"),
    )
    driver = _loaded(1, 420, requests=2)
    with (
        Shadow() as shadow,
        pytest.raises(UnsupportedSGLang, match=r"'full_untruncated_fill_ids'.*0\.5\.23"),
    ):
        driver.step()
    assert shadow.operations == []  # nothing was replayed


@pytest.mark.parametrize("every", [1, 16])
def test_a_mirror_listing_the_right_rows_in_another_order_is_named(
    topology: None, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    import torch

    def permute(batch: Any) -> None:
        if len(batch.reqs) >= 2:  # the host mirror reversed, the device rows left as they are
            batch.req_pool_indices_cpu = torch.flip(batch.req_pool_indices_cpu, [0])

    _patch(monkeypatch, "filter_batch", permute)
    divergence = _first(_loaded(1, 420), every)  # sampled or not: SGLang's order, every call
    assert _where(divergence) == ("filter_batch", "req_pool_indices_cpu order")
    rid = divergence.mismatch.request
    assert rid.startswith("r") and divergence.mismatch.batchstate == f"{rid}'s row"
    assert divergence.mismatch.sglang != divergence.mismatch.batchstate


def test_a_row_given_back_twice_is_named_at_the_release(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _free_row_twice(monkeypatch)
    divergence = _first(_loaded(1, 420))
    assert _where(divergence) == ("release_kv_cache", "free_slots")
    assert int(divergence.mismatch.sglang) == int(divergence.mismatch.batchstate) + 1
    assert divergence.mismatch.request.startswith("r")


def test_one_row_given_to_two_requests_is_named_at_the_extend(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    given = _share_one_row(monkeypatch)
    divergence = _first(_loaded(1, 420))
    assert _where(divergence) == ("prepare_for_extend", "free_slots")
    assert int(divergence.mismatch.sglang) == int(divergence.mismatch.batchstate) + 1
    assert set(given[:2]) <= set(divergence.mismatch.request.split(", "))


def test_kv_leaked_by_a_release_is_named_at_the_release(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _leak_on_release(monkeypatch)
    divergence = _first(_loaded(1, 420))
    assert _where(divergence) == ("release_kv_cache", "free_tokens + evictable_tokens")
    assert int(divergence.mismatch.sglang) == int(divergence.mismatch.batchstate) - 1
    assert divergence.mismatch.request.startswith("r") and "," not in divergence.mismatch.request


def _stale_mirror_row(monkeypatch: pytest.MonkeyPatch, shadow: Shadow, at: int) -> dict[str, Any]:
    """Reintroduce a bug at the `at`-th decode: one row's `seq_lens_cpu` is not advanced (its
    device length is), the row whose request has the most tokens left. Returns where it was
    done: the step its call gets in the shadow, the batch and the request."""
    done: dict[str, Any] = {}
    decodes = 0

    def stale(batch: Any) -> None:
        nonlocal decodes
        decodes += 1
        if decodes != at:
            return
        left = [r.sampling_params.max_new_tokens - len(r.output_ids) for r in batch.reqs]
        row = left.index(max(left))
        batch.seq_lens_cpu[row] -= 1
        done.update(step=len(shadow.operations), rid=batch.reqs[row].rid)

    _patch(monkeypatch, "prepare_for_decode", stale)
    return done


@pytest.mark.parametrize("every", [1, 8])
def test_a_stale_mirror_row_is_named_at_the_next_full_check(
    topology: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, every: int
) -> None:
    trace = tmp_path / "trace.jsonl"
    shadow = Shadow(full_check_every=every, trace_path=trace)
    done = _stale_mirror_row(monkeypatch, shadow, at=30)
    with shadow, pytest.raises(ShadowDivergence) as raised:
        _run(_loaded(1, 2000, requests=12))
    found = raised.value.mismatch
    assert (found.field, found.request) == ("seq_len", done["rid"])
    assert int(found.sglang) == int(found.batchstate) - 1
    ops = shadow.operations
    bug = ops[done["step"]]
    assert bug.op == "prepare_for_decode"
    if every == 1:  # every call compared in full: named at its own call
        assert (found.step, found.since) == (bug.step, bug.step)
        return
    # Sampled: the buggy call compared counts only, which the bug leaves equal; the batch's
    # next full check names it, with a range that holds the buggy call.
    assert not bug.full
    after = [op for op in ops[bug.step + 1 :] if op.batch == bug.batch and op.full]
    assert found.step == after[0].step > bug.step
    assert found.since <= bug.step < found.step
    assert f"arose in steps {found.since} to {found.step}" in str(raised.value)
    assert all(op.full for op in ops if op.op == "prepare_for_extend")
    assert sum(op.full for op in ops if op.op == "prepare_for_decode") < len(ops) / every
    done_replay = replay(trace)  # the sampled trace replays to the same finding
    assert done_replay.mismatch == found


def test_a_sampled_shadow_names_what_its_counts_see_at_its_call(
    topology: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch(
        monkeypatch,
        "prepare_for_decode",
        lambda b: b.token_to_kv_pool_allocator.free(b.out_cache_loc[:1]),
    )
    with Shadow(full_check_every=16) as shadow, pytest.raises(ShadowDivergence) as raised:
        _run(_loaded(1, 420))
    found = raised.value.mismatch
    assert (found.op, found.field) == ("prepare_for_decode", "free_tokens + evictable_tokens")
    # Named at the first decode, the buggy call, though it compared counts only.
    first = next(op for op in shadow.operations if op.op == "prepare_for_decode")
    assert found.step == first.step and not first.full
    assert found.since <= found.step
    assert found.request == ", ".join(first.kept)  # the decode's rows, though none recorded


@pytest.mark.parametrize(
    ("full", "field"),
    [
        (True, "req_pool_indices_cpu order"),
        (False, "req_pool_indices_cpu order"),
        (False, "free_slots"),
    ],
)
def test_a_sampled_trace_checks_the_mirror_order_and_free_rows_at_every_call(
    topology: None, tmp_path: Path, full: bool, field: str
) -> None:
    trace = tmp_path / "trace.jsonl"
    with Shadow(trace_path=trace, full_check_every=4):
        _run(_loaded(1, 420, requests=8))
    lines = trace.read_text().splitlines()
    step, op = next(
        (n, raw)
        for n, raw in enumerate(map(json.loads, lines[1:]))
        if raw["op"] == "prepare_for_decode" and raw["full"] == full and len(raw["kept"]) >= 2
    )
    if field == "free_slots":
        op["state"]["free_slots"] += 1
    else:  # the rows' own, listed in reverse: recorded, so the check cannot take its fast path
        op["mirror_order"] = op["kept"][::-1]
    lines[step + 1] = json.dumps(op)
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join(lines) + "\n")
    found = replay(tampered).mismatch
    assert found is not None and (found.step, found.field) == (step, field)
    if field == "free_slots":  # a pool-level mismatch names the decode's rows
        assert found.request == ", ".join(op["kept"])
    else:
        assert found.request == op["kept"][0] and found.sglang == f"{op['kept'][-1]}'s row"


def test_a_sampled_shadow_follows_hundreds_of_steps_and_replays(
    topology: None, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    with Shadow(trace_path=trace, full_check_every=8) as shadow:
        steps = _run(_loaded(16, 640))
    assert shadow.divergences == [] and len(steps) >= 250
    batch_ops = [op for op in shadow.operations if op.batch]
    assert 0 < sum(op.full for op in batch_ops) < len(batch_ops) / 2
    done = replay(trace)
    assert (done.operations, done.mismatch) == (len(shadow.operations), None)


def test_full_check_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Shadow(full_check_every=0)
