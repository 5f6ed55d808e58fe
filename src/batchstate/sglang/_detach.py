"""What a `Watch` or `Shadow` does with what it cannot read: raise it, or log it once and
detach so that the scheduler it rides on runs on unchecked (the launcher's default)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, Protocol, TypeVarTuple

Args = TypeVarTuple("Args")

Unsupported = Literal["raise", "detach"]
"""`on_unsupported`: raise what the checker cannot read, or log it once and detach."""

_log = logging.getLogger("batchstate.sglang")


class Detachable(Protocol):
    """A checker attached to SGLang (`Watch`, `Shadow`)."""

    def detach(self) -> None: ...


@contextmanager
def detach_on_unsupported(
    checker: Detachable, mode: Unsupported, divergences: tuple[type[BaseException], ...]
) -> Iterator[None]:
    """Run a check after SGLang's call has returned; under `"detach"`, any error it raises
    that is not one of `divergences` (what the check is for) is logged once and the
    checker detached, instead of stopping the scheduler."""
    try:
        yield
    except divergences:
        raise
    except Exception as error:
        _unsupported(checker, mode, error)


def call_detaching(
    checker: Detachable,
    mode: Unsupported,
    divergences: tuple[type[BaseException], ...],
    check: Callable[[*Args], None],
    *args: *Args,
) -> None:
    """`check(*args)` under `detach_on_unsupported`, as a plain call: a check run after
    every SGLang call pays no generator-based context manager."""
    try:
        check(*args)
    except divergences:
        raise
    except Exception as error:
        _unsupported(checker, mode, error)


def _unsupported(checker: Detachable, mode: Unsupported, error: Exception) -> None:
    if mode == "raise":
        raise error
    checker.detach()
    _log.error(
        "batchstate.sglang detached %s, SGLang runs on unchecked: %s: %s",
        type(checker).__name__,
        type(error).__name__,
        error,
    )
