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


def _run(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    assert main(["simulate", "--device", "meta", "--json", "--no-progress", *extra]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert isinstance(summary, dict)
    return summary


def test_the_prefix_cache_does_not_serialise_the_default_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Cached pages count as room: with the cache on, admission keeps pace with the cache off.

    The default workload shares no prefix, so the cache can only fill memory with
    evictable pages. Counting only free pages at admission once ran it one request at
    a time: 5,620 steps against 678 with the cache off.
    """
    on, off = _run(capsys), _run(capsys, "--no-prefix-cache")
    assert isinstance(on["steps"], int) and isinstance(off["steps"], int)
    assert on["steps"] <= 1.1 * off["steps"]
    assert on["steps"] <= 800
