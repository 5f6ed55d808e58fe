"""The deprecated `outcome`, `Ok` and `Err` still work for the release that keeps them.

`returns`' own idioms replace them (tests/base/test_result_idioms.py); until
they are removed, `outcome` takes a Result apart into `Ok` or `Err`, keeping
the value or the record itself. They are imported here from the module that
defines them, which does not warn; the package's names warn
(tests/base/test_public_face.py).
"""

from __future__ import annotations

import pickle

import attrs
import pytest
from returns.result import Failure, Result, Success

from batchstate import (
    BatchAndPools,
    ContextTooLong,
    Decoding,
    OutOfKVTokens,
    Req,
    decode,
    extend,
    idle,
)
from batchstate.base.results import Err, Ok, outcome
from tests.builders import CPU, make_test_pools


def test_a_success_is_ok_with_its_value() -> None:
    value = object()
    result = outcome(Success(value))
    assert type(result) is Ok
    assert result.value is value


def test_a_failure_is_err_with_its_record() -> None:
    record = OutOfKVTokens(4, 2, 16)
    result = outcome(Failure(record))
    assert type(result) is Err
    assert result.error is record


def test_a_real_transition_matches_by_its_failure_record() -> None:
    """A decode with no page left: `case Err(OutOfKVTokens(...))` binds the record's counts."""
    pools = make_test_pools(2, num_kv_tokens=2)
    batch, pools = extend(idle(CPU), [Req(0, (5, 6))], pools).unwrap()
    match outcome(decode(batch, pools)):
        case Ok(_):
            pytest.fail("the decode had no page to allocate")
        case Err(OutOfKVTokens(requested_pages=pages, available_pages=free)):
            assert (pages, free) == (1, 0)
        case Err(ContextTooLong()):
            pytest.fail("the table is wide enough")


def test_a_real_success_matches_as_ok_with_the_step() -> None:
    pools = make_test_pools()
    batch, pools = extend(idle(CPU), [Req(0, (5, 6))], pools).unwrap()
    result: Result[BatchAndPools[Decoding], object] = decode(batch, pools)
    match outcome(result):
        case Ok(BatchAndPools(decoded, after)):
            assert decoded.rows.seq_lens.host.tolist() == [3]
            assert after is not pools
        case Err(error):
            pytest.fail(f"the decode failed: {error}")


def test_ok_and_err_are_frozen_values() -> None:
    """Equal by value, frozen, picklable; neither is the other, whatever it holds."""
    assert Ok(3) == Ok(3)
    assert Ok(3) != Err(3)  # type: ignore[comparison-overlap]  # mypy refuses it too
    assert Err("x") == Err("x")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Ok(3).value = 4  # type: ignore[misc]  # the point
    assert pickle.loads(pickle.dumps(Err(OutOfKVTokens(1, 0, 16)))) == Err(OutOfKVTokens(1, 0, 16))
    assert Ok.__match_args__ == ("value",)
    assert Err.__match_args__ == ("error",)


def test_outcome_refuses_what_is_not_a_result() -> None:
    with pytest.raises(TypeError, match=r"^outcome: result must be Result, got str$"):
        outcome("not a result")  # type: ignore[arg-type]  # the point
