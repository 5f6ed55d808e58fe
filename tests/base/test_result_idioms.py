"""The result idioms docs/api.md recommends keep mypy's types; the one it warns about loses them.

`outcome` is the typed way to `match` a result: `case Ok(step)` and `case
Err(error)` bind typed names, `assert_never` proves the two cases cover it,
and a nested `match` on the error proves its records are covered.
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
from returns.result import Result, Success
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
from batchstate.base import Err, Ok, Outcome, outcome

def snippet(batch: Filtered, pools: Pools) -> None:
    result = decode(batch, pools)
"""

SNIPPETS: Final = {
    "is_successful_keeps_types": """\
    if is_successful(result):
        assert_type(result.unwrap(), BatchAndPools[Decoding])
    else:
        error = result.failure()
        assert_type(error, OutOfKVTokens | ContextTooLong)
        match error:
            case OutOfKVTokens(requested_pages=pages):
                assert_type(pages, int)
            case _:
                pass
""",
    "map_and_value_or_keep_types": """\
    assert_type(result.map(lambda step: len(step.batch.rows)), Result[int, DecodeError])
    assert_type(result.value_or(None), BatchAndPools[Decoding] | None)
    assert_type(unwrap(result), BatchAndPools[Decoding])
""",
    "outcome_match_is_typed": """\
    match outcome(result):
        case Ok(step):
            assert_type(step, BatchAndPools[Decoding])
            reveal_type(step.batch)
        case Err(OutOfKVTokens(requested_pages=pages)):
            assert_type(pages, int)
        case Err(error):
            reveal_type(error)
""",
    "outcome_is_exhaustive": """\
    match outcome(result):
        case Ok(step):
            print(step.pools)
        case Err(error):
            match error:
                case OutOfKVTokens(requested_pages=pages):
                    assert_type(pages, int)
                case ContextTooLong(rid=rid):
                    assert_type(rid, int)
                case _:
                    assert_never(error)
        case other:
            assert_never(other)
""",
    "outcome_missing_a_case_is_an_error": """\
    match outcome(result):
        case Ok(step):
            print(step)
        case other:
            assert_never(other)
""",
    "outcome_missing_a_record_is_an_error": """\
    match outcome(result):
        case Ok(step):
            print(step)
        case Err(error):
            match error:
                case OutOfKVTokens():
                    pass
                case _:
                    assert_never(error)
""",
    "isinstance_success_loses_types": """\
    if isinstance(result, Success):
        assert_type(result.unwrap(), BatchAndPools[Decoding])
""",
}


@functools.cache
def _reports() -> dict[str, Report]:
    return mypy_reports({name: _PRELUDE + body for name, body in SNIPPETS.items()})


def _errors() -> dict[str, list[str]]:
    return {name: report.errors for name, report in _reports().items()}


def test_recommended_idioms_are_typed() -> None:
    assert _errors()["is_successful_keeps_types"] == []
    assert _errors()["map_and_value_or_keep_types"] == []


def test_isinstance_on_success_gives_any_as_the_docs_warn() -> None:
    assert any('"Any"' in error for error in _errors()["isinstance_success_loses_types"])


def test_outcome_match_binds_typed_names() -> None:
    """Under --strict: the step, a record's field and the error union, none of them Any."""
    report = _reports()["outcome_match_is_typed"]
    assert report.errors == []
    assert report.revealed == [
        "batchstate.records.phases.Decoding[batchstate.columns.columns.NoColumns]",
        "batchstate.base.errors.OutOfKVTokens | batchstate.base.errors.ContextTooLong",
    ]


def test_outcome_match_is_proved_exhaustive() -> None:
    assert _errors()["outcome_is_exhaustive"] == []


@pytest.mark.parametrize(
    ("name", "left"),
    [
        ("outcome_missing_a_case_is_an_error", "Err[OutOfKVTokens | ContextTooLong]"),
        ("outcome_missing_a_record_is_an_error", "ContextTooLong"),
    ],
)
def test_outcome_match_missing_a_case_is_an_error(name: str, left: str) -> None:
    assert _errors()[name] == [
        f'Argument 1 to "assert_never" has incompatible type "{left}"; expected "Never"  [arg-type]'
    ]
