"""The result idioms docs/api.md recommends keep mypy's types; the ones it warns about lose them.

`returns.pipeline.is_successful(result)` splits a result in two: `.unwrap()`
is typed as the `Success`'s value, `.failure()` as the union of failure
records, and a `match` on `.failure()` ending in `assert_never` proves
every record handled. What mypy does not prove, the docs say too: matching
`Success` itself (or `isinstance`) gives `Any`, and `is_successful` narrows
nothing, so `.unwrap()` on the failure branch type-checks.
"""

from __future__ import annotations

import functools
from typing import Final

import pytest

from tests.typecheck import Report, mypy_reports

# Under xdist, one worker runs every test that runs mypy: one cache, warm after the first.
pytestmark = pytest.mark.xdist_group("mypy")

_PRELUDE: Final = """\
from typing import assert_never, assert_type
from returns.pipeline import is_successful
from returns.result import Failure, Result, Success
from batchstate import *
from batchstate.captured import *
from batchstate.checks import *
from batchstate.columns import *
from batchstate.errors import *
from batchstate.forward import *
from batchstate.memory import *
from batchstate.records import *
from batchstate.speculative import *
from batchstate.transitions import *

def snippet(batch: Filtered, pools: Pools) -> None:
    result = decode(batch, pools)
"""

SNIPPETS: Final = {
    "is_successful_keeps_types": """\
    if is_successful(result):
        assert_type(result.unwrap(), BatchAndPools[Decoding])
        reveal_type(result.unwrap().batch)
    else:
        assert_type(result.failure(), OutOfKVTokens | ContextTooLong)
        match result.failure():
            case OutOfKVTokens(requested_pages=pages):
                assert_type(pages, int)
            case ContextTooLong(rid=rid):
                assert_type(rid, int)
""",
    "map_alt_and_value_or_keep_types": """\
    assert_type(result.map(lambda step: len(step.batch.rows)), Result[int, DecodeError])
    assert_type(result.alt(str), Result[BatchAndPools[Decoding], str])
    assert_type(result.value_or(None), BatchAndPools[Decoding] | None)
    assert_type(unwrap(result), BatchAndPools[Decoding])
""",
    "failure_match_is_exhaustive": """\
    if is_successful(result):
        print(result.unwrap().pools)
    else:
        match result.failure():
            case OutOfKVTokens(requested_pages=pages):
                print(pages)
            case ContextTooLong(rid=rid):
                print(rid)
            case unhandled:
                assert_never(unhandled)
""",
    "failure_match_missing_a_record_is_an_error": """\
    if not is_successful(result):
        match result.failure():
            case OutOfKVTokens():
                pass
            case unhandled:
                assert_never(unhandled)
""",
    "isinstance_success_loses_types": """\
    if isinstance(result, Success):
        assert_type(result.unwrap(), BatchAndPools[Decoding])
""",
    "match_on_success_loses_types": """\
    match result:
        case Success(step):
            reveal_type(step)
        case Failure(error):
            reveal_type(error)
""",
    "unwrap_on_the_failure_branch_type_checks": """\
    if not is_successful(result):
        print(result.unwrap().batch)
""",
}


@functools.cache
def _reports() -> dict[str, Report]:
    return mypy_reports({name: _PRELUDE + body for name, body in SNIPPETS.items()})


def _errors() -> dict[str, list[str]]:
    return {name: report.errors for name, report in _reports().items()}


def test_is_successful_then_unwrap_and_failure_are_typed() -> None:
    """Under --strict: the step's record, the failure union, each record's fields."""
    report = _reports()["is_successful_keeps_types"]
    assert report.errors == []
    assert report.revealed == [
        "batchstate.records.phases.Decoding[batchstate.columns.columns.NoColumns]"
    ]


def test_map_alt_and_value_or_are_typed() -> None:
    assert _errors()["map_alt_and_value_or_keep_types"] == []


def test_a_match_on_the_failure_is_proved_exhaustive() -> None:
    assert _errors()["failure_match_is_exhaustive"] == []


def test_a_match_on_the_failure_missing_a_record_is_an_error() -> None:
    assert _errors()["failure_match_missing_a_record_is_an_error"] == [
        'Argument 1 to "assert_never" has incompatible type "ContextTooLong"; expected "Never"'
        "  [arg-type]"
    ]


def test_isinstance_on_success_gives_any_as_the_docs_warn() -> None:
    assert any('"Any"' in error for error in _errors()["isinstance_success_loses_types"])


def test_a_match_on_success_and_failure_gives_any_as_the_docs_warn() -> None:
    report = _reports()["match_on_success_loses_types"]
    assert report.errors == []
    assert report.revealed == ["Any", "Any"]


def test_is_successful_narrows_nothing_as_the_docs_warn() -> None:
    """mypy does not tie `.unwrap()` to the success branch: the mistake type-checks."""
    assert _errors()["unwrap_on_the_failure_branch_type_checks"] == []
