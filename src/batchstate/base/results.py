"""`unwrap`, a `Result`'s value or an exception that says why; and the deprecated `outcome`.

`returns`' own idioms read a result with mypy's types: `is_successful`,
then `.unwrap()` or `.failure()` (and a `match` on the failure records),
`.map`, `.alt`, `.value_or` (docs/api.md, "Results and failures").
`Ok`, `Err`, `Outcome` and `outcome` were a second vocabulary for the same
branch: `outcome` turned a `Result[T, E]` into `Ok[T] | Err[E]`. They are
deprecated, kept for one release: the package's names for them warn.
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
    """Deprecated: a transition's value, from a `Success` (use `is_successful`, `.unwrap()`)."""

    value: _Value_co


@final
@attrs.frozen
class Err(Generic[_Error_co]):
    """Deprecated: a transition's failure record (use `is_successful`, `.failure()`)."""

    error: _Error_co


Outcome: TypeAlias = Ok[_Value] | Err[_Error]


def outcome(result: Result[_Value, _Error]) -> Outcome[_Value, _Error]:
    """Deprecated: `Ok(value)` for a `Success`, `Err(error)` for a `Failure`.

    Use the result itself: `is_successful(result)`, then `result.unwrap()`,
    or `match result.failure():` on the failure records.

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
