"""What can go wrong: expected failures as values, broken contracts as exceptions.

A transition that can run out of something returns a `returns` `Failure`
holding one of the frozen records below, with the facts needed to act on it;
`str()` of a record says them in one line, and `batchstate.unwrap` raises
with that line as its message (`returns`' own `.unwrap()` says nothing).
A caller that breaks a contract (a wrong phase, bad keep indices, two
batches that share a request) gets an exception that subclasses the builtin
a caller would already catch.

Every one of them, failure value or exception, derives from `Error`, so
`except batchstate.errors.Error` catches whatever batchstate raises, and
`isinstance(failure, Error)` holds for whatever it returns in a `Failure`.
"""

from __future__ import annotations

from typing import TypeAlias, final

import attrs
from returns.primitives.exceptions import UnwrapFailedError
from returns.result import Result

__all__ = [
    "AllocError",
    "BatchConflict",
    "ColumnError",
    "ContextTooLong",
    "DraftError",
    "EmptyExtend",
    "EmptyPrompt",
    "InvariantViolation",
    "KeepIndicesError",
    "MemoryKindError",
    "NoChunkBudget",
    "NotHeld",
    "NotOwned",
    "OutOfKVTokens",
    "OutOfReqSlots",
    "PhaseError",
    "PoolsArgumentError",
    "RecordShapeError",
    "ReleaseError",
    "StaleRecord",
    "StillRunning",
    "TokenIdError",
]


class Error(Exception):
    """The base of every failure value batchstate returns and every exception it raises.

    The failure values (`OutOfKVTokens`, `NotHeld`, ...) are frozen attrs
    records that compare by value; as exceptions they can also be raised,
    though no transition raises them. The exceptions subclass the builtin a
    caller would already catch as well (`ValueError`, `TypeError`, ...).
    """

    def __reduce__(self) -> str | tuple[object, ...]:
        # A failure value pickles as its fields (BaseException's own reduce would call
        # the class with its positional arguments only, losing keyword-only fields).
        cls = type(self)
        if attrs.has(cls):
            fields = {field.alias: getattr(self, field.name) for field in attrs.fields(cls)}
            return (_rebuilt, (cls, fields))
        return super().__reduce__()


def _rebuilt(cls: type[Error], fields: dict[str, object]) -> Error:
    return cls(**fields)


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class OutOfReqSlots(Error):
    """More requests than free request slots.

    `fits`: how many of the requests an admission (`extend`, `admit_prefilled`,
    `mix`) was offered, in the order given, these pools would take: the same
    call with only those succeeds (for `mix`, each with the chunk its budget
    gives it, beside the running rows' decode tokens); 0: not even the
    first. A transition offered no requests (`decode`, `verify`) says 0.
    Equality compares the shortage, not this count.
    """

    requested: int
    available: int
    fits: int = attrs.field(default=0, kw_only=True, eq=False)  # a count, not the shortage

    def __str__(self) -> str:
        return (
            f"out of request slots: {self.requested} requested, {self.available} free;"
            f" {self.fits} of the requests offered fit"
        )


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class OutOfKVTokens(Error):
    """More KV tokens (whole pages) than the pool has free.

    `fits`: as `OutOfReqSlots.fits`.
    """

    requested_pages: int
    available_pages: int
    page_size: int
    fits: int = attrs.field(default=0, kw_only=True, eq=False)  # a count, not the shortage

    def __str__(self) -> str:
        return (
            f"out of KV tokens: {self.requested_pages} pages of {self.page_size} requested,"
            f" {self.available_pages} free; {self.fits} of the requests offered fit"
        )


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class ContextTooLong(Error):
    """A request would grow past the request-to-token table's width."""

    rid: int
    length: int
    max_context_len: int

    def __str__(self) -> str:
        return (
            f"request {self.rid} needs {self.length} tokens of context,"
            f" the table holds {self.max_context_len}"
        )


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class EmptyExtend(Error):
    """An extend with no requests."""

    def __str__(self) -> str:
        return "extend needs at least one request"


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class EmptyPrompt(Error):
    """A request with no tokens left to compute."""

    rid: int
    num_input_ids: int
    prefix_len: int

    def __str__(self) -> str:
        return (
            f"request {self.rid} has nothing to extend:"
            f" {self.num_input_ids} input ids, {self.prefix_len} already cached"
        )


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class NotOwned(Error):
    """Releasing request slots that the pools do not hold as owned (a double free)."""

    slots: tuple[int, ...]

    def __str__(self) -> str:
        return (
            f"request slots {list(self.slots)} are not owned: already released or never allocated"
        )


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class StillRunning(Error):
    """Releasing request slots that the running batch still uses."""

    slots: tuple[int, ...]

    def __str__(self) -> str:
        return f"request slots {list(self.slots)} are still in the running batch"


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class NotHeld(Error):
    """A chunk whose slot does not hold its cached tokens: never held, or already moved on.

    A `Chunked` is good for one continuation: once `mix` has continued it,
    merged its last chunk into the running batch, or `release` has freed it,
    the pools no longer hold `cached` tokens in its slot.
    """

    rid: int
    slot: int
    cached: int
    owned: int  # tokens the pools hold in the slot (0: free or out of range)
    # The slot holds that many tokens, but for a later owner: it was released and
    # handed out again (the chunk's generation is not the slot's).
    stale: bool = False
    # The slot holds that many tokens at the chunk's generation, but for other
    # tokens than the start of the chunk's request (the request was swapped): the
    # chunk remembers the request it was made for, and with the prefix cache on the
    # cached prefix its row reads must be the start of the request too.
    other_tokens: bool = False

    def __str__(self) -> str:
        if self.other_tokens:
            return (
                f"request {self.rid} is not held in slot {self.slot}: the slot's KV is for"
                " other tokens than the start of this request (the chunk's request was"
                " swapped)"
            )
        if self.stale:
            return (
                f"request {self.rid} is not held in slot {self.slot}: the slot was released"
                " and handed out again (another generation), the chunk is stale"
            )
        return (
            f"request {self.rid} is not held in slot {self.slot}: the chunk says"
            f" {self.cached} cached tokens, the pools hold {self.owned}"
        )


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class NoChunkBudget(Error):
    """A chunk budget below one token: no prompt could make progress."""

    budget: int

    def __str__(self) -> str:
        return f"the chunk budget must be at least 1 token per step, got {self.budget}"


AllocError: TypeAlias = OutOfReqSlots | OutOfKVTokens | ContextTooLong | EmptyExtend | EmptyPrompt
ReleaseError: TypeAlias = NotOwned | StillRunning


class PhaseError(Error, TypeError):
    """A transition was handed a record of a phase it does not accept.

    A `TypeError`: mypy rejects these calls; this is for callers without it.
    """


class KeepIndicesError(Error, IndexError):
    """Keep indices that are not strictly increasing positions inside the batch."""


class BatchConflict(Error, ValueError):
    """Two batches being merged share a request or a request slot."""


class StaleRecord(Error, ValueError):
    """A record and the pools disagree about what a request slot owns.

    One of them is older than the other: a batch decoded with pools from
    before its last step, or after its rows were released. Caught before
    anything is allocated or written.
    """


class StalePools(Error, ValueError):
    """Pools used after a later value was derived from them by a successful transition.

    Pools are linear: every value of one lineage shares the table and the
    free lists, so only the newest may allocate or free. Raised before
    anything is read or written.
    """


class PoolsArgumentError(Error, ValueError):
    """An argument to a public `Pools` method that does not fit the pools it is handed.

    A negative count, an array of the wrong dtype or shape, a slot the
    pools do not hold, or a length other than what the slot owns: the
    message names the argument. Raised before anything is taken or freed.
    """


class DraftError(Error, ValueError):
    """Draft lengths or accepted counts that do not fit the rows they describe.

    A `ValueError`: a speculative engine handed `verify` or `sync` numbers
    its own drafter or verify kernel should never produce.
    """


class TokenIdError(Error, ValueError):
    """A request's input ids hold a negative value: no token id, an embedding read out of range.

    Raised by `extend`, `admit_prefilled` and `mix` (for a running row's input token
    too) before the table is written or the pools committed.
    """


class RecordShapeError(Error, ValueError):
    """A record whose fields disagree in length, dtype or device."""


class ColumnError(Error, ValueError):
    """A column set that is not one, or a column of the wrong length, dtype or device.

    Raised before anything is allocated: the pools passed in stay as they were.
    """


class MemoryKindError(Error, ValueError):
    """A description of the pools' memory kinds that they cannot hold.

    A window of 0 or longer than the context, window token slots that are
    not whole pages, a state size that does not fit, or two kinds of one
    sort. Raised by `make_pools`, before anything is made.
    """


class InvariantViolation(Error, AssertionError):
    """A record or pool breaks one of the invariants of docs/design.md.

    An `AssertionError`: it means a bug, in batchstate or in code that
    reached past its API, never bad input.
    """


class PaddingError(Error, ValueError):
    """Captured sizes or a fill table that cannot pad anything (nothing was padded)."""


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class TooLargeToPad(Error):
    """The forward (or the largest data-parallel rank's) is larger than every captured size."""

    count: int  # tokens to pad (rows, for decode)
    largest: int  # the largest captured size

    def __str__(self) -> str:
        return f"{self.count} tokens exceed the largest captured size, {self.largest}"


class GraphBuffersError(Error, ValueError):
    """A bucket that cannot be allocated, or inputs of another device or page size."""


@final
@attrs.frozen(auto_exc=False)  # compared by value, as a record
class DoesNotFit(Error):
    """A forward larger than the bucket in one of its sizes: nothing was written."""

    what: str  # "rows", "tokens", "pages per row" or "kv pages"
    needed: int
    capacity: int

    def __str__(self) -> str:
        return f"{self.needed} {self.what} exceed the bucket's {self.capacity}"


class ForwardInputsError(Error, ValueError):
    """Arguments to `forward_inputs` that do not describe the record.

    A page size other than the pools', a table of other pools, or (for a
    verify window) `slot_tokens` that do not hold the window's drafts.
    """


class UnwrapError(Error, UnwrapFailedError):
    """`unwrap` was handed a `Failure`: the message is the failure record's one line.

    A subclass of `returns`' `UnwrapFailedError`, so code that catches that
    catches this too. `failure` is the record itself (for example an
    `OutOfKVTokens`, with its counts); `halted_container` is the `Failure`.
    """

    def __init__(self, container: Result[object, object]) -> None:
        super().__init__(container)
        self.failure: object = container.failure()
        self.args = (str(self.failure),)


ExtendError: TypeAlias = AllocError | NotHeld
DecodeError: TypeAlias = OutOfKVTokens | ContextTooLong
MixError: TypeAlias = AllocError | NoChunkBudget | NotHeld
