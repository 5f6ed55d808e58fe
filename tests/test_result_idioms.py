"""The result idioms docs/api.md recommends keep mypy's types; the one it warns about loses them."""

from __future__ import annotations

import functools
from typing import Final

import pytest

from tests.typecheck import mypy_errors

# Under xdist, one worker runs every test that runs mypy: one cache, warm after the first.
pytestmark = pytest.mark.xdist_group("mypy")

_PRELUDE: Final = """\
from typing import assert_type
from returns.pipeline import is_successful
from returns.result import Result, Success
from batchstate import *

def snippet(batch: Filtered, pools: Pools) -> None:
    result = decode(batch, pools)
"""

SNIPPETS: Final = {
    "is_successful_keeps_types": """\
    if is_successful(result):
        assert_type(result.unwrap(), Step[Decoding])
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
    assert_type(result.value_or(None), Step[Decoding] | None)
    assert_type(unwrap(result), Step[Decoding])
""",
    "isinstance_success_loses_types": """\
    if isinstance(result, Success):
        assert_type(result.unwrap(), Step[Decoding])
""",
}


@functools.cache
def _errors() -> dict[str, list[str]]:
    return mypy_errors({name: _PRELUDE + body for name, body in SNIPPETS.items()})


def test_recommended_idioms_are_typed() -> None:
    assert _errors()["is_successful_keeps_types"] == []
    assert _errors()["map_and_value_or_keep_types"] == []


def test_isinstance_on_success_gives_any_as_the_docs_warn() -> None:
    assert any('"Any"' in error for error in _errors()["isinstance_success_loses_types"])
