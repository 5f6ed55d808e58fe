"""Seeded engine runs across the capability matrix give the summaries kept in tests/data.

The kept summaries (`tests/data/engine_summaries.json`, written by
`tools/engine_summaries.py --write`) hold the fields a change to the engine's
structure must not move: steps, tokens, cache hits, retractions, chunks,
drafts, padding and the pools at the end. A difference names each field, with
the kept value and the new one.
"""

from __future__ import annotations

import json

import pytest
from tools.engine_summaries import GOLDEN, RUNS, compare, summary_of

KEPT = json.loads(GOLDEN.read_text())


def test_every_run_is_kept() -> None:
    assert sorted(KEPT) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_summary_is_the_kept_one(name: str) -> None:
    assert compare({name: summary_of(RUNS[name])}, {name: KEPT[name]}) == []


def test_a_moved_field_is_named() -> None:
    kept = {"run": {"steps": 10, "retractions": 1}}
    moved = {"run": {"steps": 11, "retractions": 1}}
    assert compare(moved, kept) == ["run.steps: kept 10, now 11"]
    assert compare({}, kept) == ["run: missing now"]
