"""`unwrap`: a `Result`'s value, or an exception whose message is the failure's facts."""

from __future__ import annotations

from typing import TypeVar

from returns.primitives.exceptions import UnwrapFailedError
from returns.result import Result

from batchstate._expect import expect_instance

__all__ = ["UnwrapError", "unwrap"]

_Value = TypeVar("_Value")
_Error = TypeVar("_Error")


class UnwrapError(UnwrapFailedError):
    """`unwrap` was handed a `Failure`: the message is the failure record's one line.

    A subclass of `returns`' `UnwrapFailedError`, so code that catches that
    catches this too. `failure` is the record itself (for example an
    `OutOfKVTokens`, with its counts); `halted_container` is the `Failure`.
    """

    def __init__(self, container: Result[object, object]) -> None:
        super().__init__(container)
        self.failure: object = container.failure()
        self.args = (str(self.failure),)


def unwrap(result: Result[_Value, _Error]) -> _Value:
    """The value inside a `Success`; for a `Failure`, raise `UnwrapError` saying why.

    Typed like `result.unwrap()`, and chained from the error that raises.

    >>> import torch
    >>> from batchstate import Req, extend, idle, make_pools
    >>> pools = make_pools(1, 8, 16, torch.device("cpu"))
    >>> unwrap(extend(idle("cpu"), [Req(0, (1, 2)), Req(1, (3,))], pools))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    batchstate._unwrap.UnwrapError: out of request slots: 2 requested, 1 free; 1 of the ...
    """
    expect_instance(result, Result, "unwrap: result")
    try:
        return result.unwrap()
    except UnwrapFailedError as error:
        raise UnwrapError(result) from error
