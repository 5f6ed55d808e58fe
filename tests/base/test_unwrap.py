"""Unwrapping a Failure with `batchstate.unwrap` says why, and keeps the record."""

from __future__ import annotations

import pickle
import traceback

import pytest
from returns.primitives.exceptions import UnwrapFailedError
from returns.result import Failure, Result, Success

from batchstate import (
    ContextTooLong,
    EmptyExtend,
    EmptyPrompt,
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    Req,
    StillRunning,
    UnwrapError,
    decode,
    extend,
    idle,
    unwrap,
)
from tests.builders import CPU, make_test_pools

RECORDS = (
    OutOfReqSlots(3, 1),
    OutOfKVTokens(4, 2, 16),
    ContextTooLong(7, 80, 64),
    EmptyExtend(),
    EmptyPrompt(7, 3, 3),
    NotOwned((1, 2)),
    StillRunning((4,)),
)


def _out_of_kv() -> Result[object, object]:
    """A real decode that runs out of KV: one page of 2 tokens, a 2-token prompt."""
    pools = make_test_pools(2, num_kv_tokens=2)
    batch, pools = extend(idle(CPU), [Req(0, (5, 6))], pools).unwrap()
    return decode(batch, pools)


def test_unwrap_returns_the_value_of_a_success() -> None:
    assert unwrap(Success(3)) == 3


def test_unwrap_of_a_real_failure_says_why_and_keeps_the_record() -> None:
    """Out of KV on decode: the message is the record's line, the record is on the error."""
    result = _out_of_kv()
    with pytest.raises(UnwrapError) as raised:
        unwrap(result)
    assert (
        str(raised.value)
        == "out of KV tokens: 1 pages of 2 requested, 0 free; 0 of the requests offered fit"
    )
    assert raised.value.failure == OutOfKVTokens(1, 0, 2)
    assert raised.value.halted_container is result
    # Still the error returns raises, for code that already catches that one.
    assert isinstance(raised.value, UnwrapFailedError)
    assert isinstance(raised.value.__cause__, UnwrapFailedError)


def test_the_traceback_of_unwrap_ends_with_the_facts() -> None:
    """What a user sees when an uncaught `unwrap` stops a script: the record's line, last."""
    with pytest.raises(UnwrapError) as raised:
        unwrap(_out_of_kv())
    printed = "".join(traceback.format_exception(raised.value)).rstrip()
    assert printed.endswith(
        "UnwrapError: out of KV tokens: 1 pages of 2 requested, 0 free;"
        " 0 of the requests offered fit"
    )


@pytest.mark.parametrize("record", RECORDS, ids=lambda record: type(record).__name__)
def test_every_record_is_one_line_and_a_value(record: object) -> None:
    """Each record prints its facts on one line, compares by value and survives pickling."""
    line = str(record)
    assert line and "\n" not in line
    assert record == pickle.loads(pickle.dumps(record))
    assert hash(record) == hash(pickle.loads(pickle.dumps(record)))
    with pytest.raises(UnwrapError, match="^" + line.replace("[", r"\[").replace("]", r"\]")):
        unwrap(Failure(record))


def test_unwrap_error_pickles_with_its_message() -> None:
    error = UnwrapError(Failure(OutOfReqSlots(2, 0)))
    again = pickle.loads(pickle.dumps(error))
    assert (
        str(again)
        == str(error)
        == "out of request slots: 2 requested, 0 free; 0 of the requests offered fit"
    )
