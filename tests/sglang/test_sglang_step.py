"""The side-by-side benchmark against SGLang's real step runs and reports every phase.

Skipped when SGLang is not installed (CI installs it as docs/sglang.md says).
"""

from __future__ import annotations

import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from benchmarks.impl_batchstate import BatchstateStep
from benchmarks.production import run_turn
from benchmarks.production_batchstate import BatchstateProduction
from benchmarks.production_plan import make_production_plan
from benchmarks.scenario import Config, make_plan
from benchmarks.sglang_batch import SGLangDefault, SGLangPlain
from benchmarks.sglang_step import DEFAULT, PLAIN, main, run

from batchstate.sglang import cpu_topology

pytestmark = SGLANG_MARKS


def test_the_quick_run_prints_both_workloads_with_every_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["--quick"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| plain", "| default"))]
    # Each point prints as it lands, then again in the final table.
    assert [row.split("|")[1].strip() for row in rows] == ["plain", "default"] * 2
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1:3] == ["1", "8"]
        assert len(cells) == 3 + 3 + 5 + 2
        assert all(float(cell) > 0 for cell in cells[5].split(" / "))
        assert all(float(cell.strip("*")) > 0 for cell in (*cells[3:5], *cells[6:12]))


def test_both_sides_time_every_phase_of_every_step() -> None:
    (plain, default) = run([4], [16], steps=3, warmup=1, quiet=True)
    for point, phases in ((plain, PLAIN), (default, DEFAULT)):
        for side in (point.sglang_us, point.batchstate_us):
            assert set(side) == {*phases, "step"}
            assert all(value > 0 for value in side.values())
        assert point.ratio("step") == pytest.approx(
            point.batchstate_us["step"] / point.sglang_us["step"]
        )


@pytest.mark.parametrize("page_size", [1, 16])
def test_both_sides_run_the_same_requests_to_the_same_lengths(page_size: int) -> None:
    """The comparison is fair only if SGLang admits, chunks and finishes what batchstate
    does: after the plans, both running batches hold the same rids at the same lengths, and
    on the default workload SGLang holds the same chunk and its cache evicted."""
    with cpu_topology():
        plan = make_plan(Config(8, page_size), 20)
        sglang, ours = SGLangPlain(plan), BatchstateStep(plan, columns="sampling")
        for join in plan.steps:
            sglang.decode()
            sglang.forward(join)
            sglang.release(join)
            sglang.filter(join)
            sglang.extend(join)
            sglang.prefill_forward()
            sglang.merge()
            ours.decode()
            ours.filter(join)
            ours.release()
            ours.extend(join)
            ours.merge()
        sglang.decode()
        ours.decode()
        outcome = ours.outcome()
        assert sglang.rows() == list(zip(outcome.rids, outcome.seq_lens, strict=True))

        production = make_production_plan(8, page_size, 30)
        default = SGLangDefault(production)
        mine = BatchstateProduction(production, sampling=True)
        for turn in production.turns:
            default.decode()
            default.prefill(turn)
            default.forward(turn)
            default.settle()
            default.release(turn)
            default.merge()
            run_turn(mine, turn)
        default.decode()
        mine.decode()
        state = mine.outcome()
        assert default.rows() == list(zip(state.rids, state.seq_lens, strict=True))
        held = default.chunked_req
        assert int(held.rid) == state.held[0]
        # Paged, SGLang's chunk can end a page short: its budget rounds the held chunk's
        # last partial page up.
        assert state.held[2] - page_size <= held.prefix_len <= state.held[2]
        assert default.tree_cache.evictable_size() > 0
        assert state.num_evicted > 0
