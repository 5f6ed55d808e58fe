"""What a user feels: the default run keeps many requests running together.

An exact oracle says nothing about concurrency: an engine that runs one request
at a time still produces every right token. These tests fail when admission
collapses, measured in steps and rows per forward on the meta device (seeded
tokens, no model), where both counts are deterministic.
"""

from __future__ import annotations

import json

import pytest

from batchstate.cli import main


def _run(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, float]:
    """The `--json` summary's numbers (booleans and text left out)."""
    assert main(["simulate", "--device", "meta", "--json", "--no-progress", *extra]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert isinstance(summary, dict)
    return {
        key: value
        for key, value in summary.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def test_the_prefix_cache_does_not_serialise_the_default_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Cached pages count as room: with the cache on, admission keeps pace with the cache off.

    The default workload shares no prefix, so the cache can only fill memory with
    evictable pages. Counting only free pages at admission once ran it one request at
    a time: 5,620 steps against 678 with the cache off.
    """
    on, off = _run(capsys), _run(capsys, "--no-prefix-cache")
    assert on["steps"] <= 1.1 * off["steps"]
    assert on["steps"] <= 800


def test_the_default_run_keeps_requests_running_together(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The summary's mean batch size: the cache on stays within 10% of the cache off.

    Measured on meta with the default workload: 9.0 rows per forward on average
    (17 at most) both ways, with 62% of the KV pool in use on average; the run
    that admitted one request at a time averaged about 1.1 rows.
    """
    on, off = _run(capsys), _run(capsys, "--no-prefix-cache")
    for summary in (on, off):
        assert 0 < summary["mean_kv_use"] <= summary["peak_kv_use"] <= 1
        assert summary["mean_batch_size"] <= summary["max_batch_size"] <= 32  # --max-running
    assert on["mean_batch_size"] >= 0.9 * off["mean_batch_size"]
    assert on["mean_batch_size"] >= 6
    # Memory, not the admission budget, is what limits the batch: KV fills up.
    assert on["peak_kv_use"] >= 0.5
