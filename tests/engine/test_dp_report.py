"""The data-parallel summary's table."""

from __future__ import annotations

from batchstate.engine._dp_report import DataParallelSummary, RankSummary, render_dp_summary


def _summary(ok: bool) -> DataParallelSummary:
    rank = RankSummary(0, 8, 10, 2, 40, 0, 0, 3, True, "32/32 slots free", 400.0)
    return DataParallelSummary(
        "cpu", "gloo", 3, 8, 8, 40, 12, 1, 2, {"decode+extend": 12}, 1.0, 12.0, 40.0,
        (rank,), "pass (8/8 requests match)" if ok else "FAIL", ok, 0.5,
    )  # fmt: skip


def test_the_header_names_the_command_with_its_rank_count() -> None:
    """`--dp` alone would read as an option missing its value: the header gives N."""
    lines = render_dp_summary(_summary(ok=True)).splitlines()
    assert lines[0] == "batchstate simulate --dp 3   OK"
    assert lines[1].startswith("ranks") and "3 on cpu (gloo)" in lines[1]
    assert render_dp_summary(_summary(ok=False)).startswith("batchstate simulate --dp 3   FAILED\n")
