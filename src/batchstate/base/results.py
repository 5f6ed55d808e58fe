"""Reading a transition's `Result`: `unwrap`, and the deprecated `outcome` vocabulary.

`unwrap(result)` is `result.unwrap()` with a message: for a `Failure` it
raises `UnwrapError`, whose message is the failure record's one line.

`outcome` took a `Result` apart into a closed union that `match` keeps typed:
mypy narrows a `Result[T, E]` matched by `case Success(value)` (or tested
with `isinstance`) to `Success[Any]`, so `value` comes out as `Any`; `Ok` and
`Err` are two final frozen records with one field each, and `outcome` turns a
`Result[T, E]` into `Ok[T] | Err[E]`, so that `case Ok(step)` types `step`
as `T`. `returns`' own idioms keep the types too (`is_successful(result)`,
then `.unwrap()` or `.failure()`); batchstate keeps one vocabulary, and
these names are deprecated.
"""

from __future__ import annotations

from typing import Generic, TypeAlias, final

import attrs
from returns.pipeline import is_successful
from returns.primitives.exceptions import UnwrapFailedError
from returns.result import Result
from typing_extensions import TypeVar

from batchstate.base.errors import UnwrapError
from batchstate.base.expect import expect_instance

__all__ = ["Err", "Ok", "Outcome", "UnwrapError", "outcome", "unwrap"]


_Value = TypeVar("_Value")
_Error = TypeVar("_Error")
_Value_co = TypeVar("_Value_co", covariant=True)
_Error_co = TypeVar("_Error_co", covariant=True)


@final
@attrs.frozen
class Ok(Generic[_Value_co]):
    """A transition's value, from a `Success`: match it as `Ok(value)`."""

    value: _Value_co


@final
@attrs.frozen
class Err(Generic[_Error_co]):
    """A transition's failure record, from a `Failure`: match it as `Err(error)`."""

    error: _Error_co


Outcome: TypeAlias = Ok[_Value] | Err[_Error]


def outcome(result: Result[_Value, _Error]) -> Outcome[_Value, _Error]:
    """`Ok(value)` for a `Success`, `Err(error)` for a `Failure`: one typed `match` for both.

    >>> import torch
    >>> from batchstate import OutOfReqSlots, Req, extend, idle, make_pools
    >>> pools = make_pools(1, 8, 16, torch.device("cpu"))
    >>> match outcome(extend(idle("cpu"), [Req(0, (1, 2)), Req(1, (3,))], pools)):
    ...     case Ok(step):
    ...         print(len(step.batch.rows), "rows")
    ...     case Err(OutOfReqSlots(requested=wanted, available=free)):
    ...         print(f"{wanted} slots wanted, {free} free")
    ...     case Err(error):
    ...         print(error)
    2 slots wanted, 1 free
    """
    expect_instance(result, Result, "outcome: result")
    if is_successful(result):
        return Ok(result.unwrap())
    return Err(result.failure())


# `unwrap`: a `Result`'s value, or an exception whose message is the failure's facts.


def unwrap(result: Result[_Value, _Error]) -> _Value:
    """The value inside a `Success`; for a `Failure`, raise `UnwrapError` saying why.

    Typed like `result.unwrap()`, and chained from the error that raises.

    >>> import torch
    >>> from batchstate import Req, extend, idle, make_pools
    >>> pools = make_pools(1, 8, 16, torch.device("cpu"))
    >>> unwrap(extend(idle("cpu"), [Req(0, (1, 2)), Req(1, (3,))], pools))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    batchstate.base.errors.UnwrapError: out of request slots: 2 requested, 1 free; 1 of the ...
    """
    expect_instance(result, Result, "unwrap: result")
    try:
        return result.unwrap()
    except UnwrapFailedError as error:
        raise UnwrapError(result) from error
