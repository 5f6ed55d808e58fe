"""`Rows`: the requests and per-row columns every phase record shares, as one value.

In this module, top to bottom: the layout of `Rows.ints` (a batch's four
int64 host columns, one row each); the shape checks of a `Rows` and of the
host arrays and device tensors records carry (each raises `RecordShapeError`
naming the field); `Req` and `Rows` themselves; and `expect_current`, the
check that pools still hold a batch's rows as the batch says.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Final, Generic, final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate.base.errors import (
    ColumnError,
    KeepIndicesError,
    RecordShapeError,
    StaleRecord,
    TokenIdError,
)
from batchstate.base.mirrored import (
    NO_INTS,
    DeviceOnly,
    HostArray,
    Mirrored,
    frozen,
    host_int64,
    upload,
)
from batchstate.base.read_only import read_only_copies
from batchstate.base.setters import new_record, slot_setters
from batchstate.columns.arguments import check_column_set
from batchstate.columns.building import empty_columns
from batchstate.columns.columns import NO_COLUMNS, C
from batchstate.columns.rows import Pending, cat_pending, take_pending
from batchstate.pools.pools import Pools

__all__ = [
    "GENS",
    "NUM_INTS",
    "RIDS",
    "SEQ_LENS",
    "SLOTS",
    "Req",
    "Rows",
    "build_rows",
    "check_columns",
    "check_device",
    "check_host",
    "expect_current",
    "expect_token_ids",
    "pack_ints",
]


# The lengths and slots first, the two columns a forward reads, then the host-only
# request ids and slot generations.
SEQ_LENS: Final = 0
SLOTS: Final = 1
RIDS: Final = 2
GENS: Final = 3
NUM_INTS: Final = 4


def pack_ints(seq_lens: HostArray, slots: HostArray, rids: HostArray, gens: HostArray) -> HostArray:
    """A fresh read-only `[4, num_reqs]` int64 array of host columns, laid out as `Rows.ints`."""
    packed = np.concatenate((seq_lens, slots, rids, gens), dtype=np.int64)
    # Frozen before the reshape: the result is a view, and its base must not be writable.
    return frozen(packed).reshape(NUM_INTS, seq_lens.shape[0])


# Shape checks of a `Rows` and of the host arrays and device tensors records carry.
#
# Each raises `RecordShapeError` naming the field that does not fit: the
# wrong length, dtype or device, or a host array that is writable (it could
# change without its device side).


def check_columns(rows: Rows[C]) -> None:
    """Raise `RecordShapeError` unless every column has `len(reqs)` rows, its dtype and device.

    Host sides must also be read-only numpy arrays: a writable one could be
    changed without its device side.
    """
    num_reqs = len(rows.reqs)
    hosts = (
        ("rids", rows.rids),
        ("gens", rows.gens),
        ("req_pool_indices.host", rows.req_pool_indices.host),
        ("seq_lens.host", rows.seq_lens.host),
    )
    for name, array in hosts:
        check_host(f"Rows.{name}", array, np.int64, num_reqs)
    devices = (
        ("req_pool_indices.device", rows.req_pool_indices.device, torch.int64),
        ("seq_lens.device", rows.seq_lens.device, torch.int64),
        ("orig_seq_lens", rows.orig_seq_lens.device, torch.int32),
    )
    for name, tensor, dtype in devices:
        check_device(f"Rows.{name}", tensor, dtype, num_reqs, rows.device)
    try:
        check_column_set(rows.columns, num_reqs, rows.device, "Rows")
    except ColumnError as error:
        raise RecordShapeError(str(error)) from error
    slots = rows.req_pool_indices.host
    if num_reqs and slots.min() < 1:
        raise RecordShapeError(
            f"Rows.req_pool_indices: slot {int(slots.min())} is padding (0) or negative"
        )


def check_host(name: str, array: object, dtype: type[np.generic], length: int) -> None:
    """Raise `RecordShapeError` unless `array` is a read-only numpy `dtype` array `[length]`."""
    if (
        not isinstance(array, np.ndarray)
        or array.shape != (length,)
        or array.dtype != dtype
        or array.flags.writeable
    ):
        got = (
            f"a {'writable' if array.flags.writeable else 'read-only'} {array.dtype}"
            f" array {list(array.shape)}"
            if isinstance(array, np.ndarray)
            else type(array).__name__
        )
        raise RecordShapeError(
            f"{name}: expected a read-only {np.dtype(dtype)} array [{length}], got {got}"
        )


def check_device(
    name: str, tensor: torch.Tensor, dtype: torch.dtype, length: int, device: torch.device
) -> None:
    """Raise `RecordShapeError` unless `tensor` is `dtype [length]` on `device`."""
    if tensor.shape != (length,) or tensor.dtype != dtype or tensor.device != device:
        raise RecordShapeError(
            f"{name}: expected {dtype} [{length}] on {device},"
            f" got {tensor.dtype} {list(tensor.shape)} on {tensor.device}"
        )


# Requests and the per-row columns every phase shares.


# Up to this many rows, picking them one by one beats `operator.itemgetter`.
_MAX_ONE_BY_ONE: Final = 8


@final
@attrs.frozen
class Req:
    """A request, as the scheduler sees it: an id and the tokens so far.

    Args:
        rid: unique among live requests; batches check it on merge.
        input_ids: the prompt, plus any tokens generated before a retraction.
    """

    rid: int
    input_ids: tuple[int, ...]


@read_only_copies
@final
@attrs.frozen(eq=False)
class Rows(Generic[C]):
    """The per-row columns of a batch: one row per request, in order.

    Every column has `num_reqs` rows on each of its sides, the scheduler's
    own `columns` (a `Columns` set, `NoColumns` by default) included. Filter,
    merge and decode compute every new host column first and upload them
    together (`build_rows`), so a transition costs one host-to-device copy
    however many columns change.

    The four int64 host columns live in one read-only array, `ints`
    `[4, num_reqs]` (rows `SEQ_LENS`, `SLOTS`, `RIDS`, `GENS`): filter and
    split take its columns once, merge joins it once, decode adds one to a
    row. `seq_lens.host`, `rids` and `gens` are always views of its rows,
    and so is `req_pool_indices.host` except where a transition kept the
    slots' pair (decode, speculative sync, a mixed step with no extending
    row): the earlier rows' array, the same values. Built by hand or by
    `attrs.evolve`, the rows pack a copy of the fields and view it; a copy
    or pickle views its own array again.
    """

    device: torch.device
    reqs: tuple[Req, ...]
    rids: HostArray  # read-only int64 [num_reqs], row -> reqs[row].rid
    # read-only int64 [num_reqs], row -> the generation it holds its slot at (see Pools)
    gens: HostArray
    req_pool_indices: Mirrored  # int64 [num_reqs], row -> request slot
    seq_lens: Mirrored  # int64 [num_reqs], row -> KV tokens after this step
    orig_seq_lens: DeviceOnly  # int32 [num_reqs], equals seq_lens (before truncation tricks)
    seq_lens_sum: int  # host only: equals seq_lens.host.sum()
    max_seq_len: int  # host only: equals seq_lens.host.max(), 0 when empty
    columns: C = NO_COLUMNS  # type: ignore[assignment]  # the default C is NoColumns
    # read-only int64 [4, num_reqs]: seq_lens, slots, rids, gens (host sides), one row each
    ints: HostArray = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        check_columns(self)
        # Pack a copy and make the fields its rows: the caller may still write the arrays it
        # passed (or their base), and `ints` and the fields must not come to disagree.
        host = (self.seq_lens.host, self.req_pool_indices.host, self.rids, self.gens)
        self._view(pack_ints(*host))

    def _rebuilt(self) -> None:
        # A copy copies `ints` and each field apart: make the fields its rows again.
        self._view(self.ints)

    def _view(self, ints: HostArray) -> None:
        """Set `ints` (read-only) and make the four fields views of its rows."""
        _, _, set_rids, set_gens, set_slots, set_seq_lens, *_, set_ints = _ROW_SETTERS
        set_rids(self, ints[RIDS])
        set_gens(self, ints[GENS])
        set_slots(self, Mirrored.trusted(ints[SLOTS], self.req_pool_indices.device))
        set_seq_lens(self, Mirrored.trusted(ints[SEQ_LENS], self.seq_lens.device))
        set_ints(self, ints)

    @staticmethod
    def empty(device: torch.device, columns: type[C]) -> Rows[C]:
        """Zero rows on every column, device and host, the `columns` set's included."""
        return Rows(
            device,
            (),
            NO_INTS,
            NO_INTS,
            Mirrored.empty(np.int64, device),
            Mirrored.empty(np.int64, device),
            DeviceOnly.empty(torch.int32, device),
            0,
            0,
            empty_columns(columns, device),
        )

    @staticmethod
    def from_host(
        device: torch.device,
        reqs: Sequence[Req],
        slots: Sequence[int],
        seq_lens: Sequence[int],
        columns: C,
        *,
        gens: Sequence[int] | None = None,
    ) -> Rows[C]:
        """Build every column and its mirror from host lists, in one upload.

        `gens` is the generation each row holds its slot at (`pools.slot_gens`
        of the pools that own the slots); by default 0, which no owned slot
        has: rows a transition will refuse as stale.
        """
        rows, _ = build_rows(
            device,
            tuple(reqs),
            pack_ints(
                host_int64(seq_lens),
                host_int64(slots),
                host_int64([req.rid for req in reqs]),
                host_int64([0] * len(reqs) if gens is None else gens),
            ),
            None,
            sum(seq_lens),
            max(seq_lens, default=0),
            columns,
        )
        check_columns(rows)
        return rows

    def __len__(self) -> int:
        return len(self.reqs)

    def take(self, index: HostArray) -> Rows[C]:
        """The rows at host positions `index` (strictly increasing), on both sides.

        Raises:
            KeepIndicesError: `index` is not a 1-D integer numpy array of strictly
                increasing positions in `[0, num_reqs)` (nothing is taken).
        """
        _expect_positions(index, len(self.reqs))
        if index.shape[0] == len(self.reqs):
            return self  # strictly increasing and in range: every row, in order
        return self.gather(index)

    def gather(self, index: HostArray) -> Rows[C]:
        """The rows at host positions `index`, in that order (any order), on both sides."""
        ints = self.ints.take(index, axis=1)
        seq_lens = ints[SEQ_LENS]
        rows, _ = build_rows(
            self.device,
            _take_tuple(self.reqs, index),
            ints,
            None,
            int(seq_lens.sum()),
            int(seq_lens.max()) if index.shape[0] else 0,
            take_pending(self.columns, index),
        )
        return rows

    def without(
        self, kept: HostArray, dropped: Sequence[int], dropped_lens: Sequence[int]
    ) -> Rows[C]:
        """The rows at `kept`, given the few rows it drops and their lengths (the host knows them).

        The same as `take(kept)`, with the host values derived from the
        dropped rows instead of summed over the kept ones, and `reqs` copied
        as slices between the dropped positions.
        """
        reqs: tuple[Req, ...] = ()
        start = 0
        for stop in dropped:
            reqs += self.reqs[start:stop]
            start = stop + 1
        reqs += self.reqs[start:]
        ints = self.ints.take(kept, axis=1)
        longest = self.max_seq_len
        if max(dropped_lens, default=0) >= longest:
            longest = int(ints[SEQ_LENS].max()) if reqs else 0  # the longest row may have left
        rows, _ = build_rows(
            self.device,
            reqs,
            ints,
            None,
            self.seq_lens_sum - sum(dropped_lens),
            longest,
            take_pending(self.columns, kept),
        )
        return rows

    def cat(self, other: Rows[C]) -> Rows[C]:
        """These rows followed by `other`'s."""
        rows, _ = build_rows(
            self.device,
            self.reqs + other.reqs,
            np.concatenate((self.ints, other.ints), axis=1),
            None,
            self.seq_lens_sum + other.seq_lens_sum,
            max(self.max_seq_len, other.max_seq_len),
            cat_pending(self.columns, other.columns),
        )
        return rows

    def __repr__(self) -> str:
        return (
            f"Rows(num_reqs={len(self.reqs)}, seq_lens_sum={self.seq_lens_sum},"
            f" max_seq_len={self.max_seq_len}, device={self.device})"
        )


def build_rows(  # noqa: PLR0917  # the attrs __init__ it stands in for is positional too
    device: torch.device,
    reqs: tuple[Req, ...],
    ints: HostArray,
    slots: Mirrored | None,
    seq_lens_sum: int,
    max_seq_len: int,
    columns: C | Pending,
    extra: Sequence[npt.NDArray[np.generic]] = (),
) -> tuple[Rows[C], list[torch.Tensor]]:
    """Rows from a new `ints` array, uploaded with `extra` host arrays in one copy.

    `ints` is `[4, num_reqs]`, laid out as `Rows.ints` (`pack_ints` builds
    one from its columns). `slots` is the rows' pair when they keep their
    slots (equal to `ints[SLOTS]`: nothing to upload), `None` to upload them.
    `columns` is the rows' column set, or a `Pending` one whose host sides
    join the same upload.
    Host arrays must be fresh (no one else holds them): they are frozen, not
    copied. Returns the rows and the device copies of `extra`, in order.

    NOTE: skips `Rows`' checks (~5 µs): only for columns that a transition
    derived from checked ones, row for row. The table tests check every
    such result.
    """
    ints.setflags(write=False)  # its rows, the host sides below, are read-only views
    seq_lens = ints[SEQ_LENS]
    hosts: list[npt.NDArray[np.generic]] = [seq_lens, seq_lens.astype(np.int32), *extra]
    if slots is None:
        hosts.append(ints[SLOTS])
    if isinstance(columns, Pending):
        hosts.extend(columns.hosts)
    sides = upload(hosts, device)
    if isinstance(columns, Pending):
        pending = len(columns.hosts)
        columns = columns.finish(sides[len(sides) - pending :])  # type: ignore[assignment]  # finish rebuilds the same set
        del sides[len(sides) - pending :]
    if slots is None:
        slots = Mirrored.trusted(ints[SLOTS], sides.pop())
    rows = new_record(Rows)
    # What attrs' frozen __init__ does, unrolled, through each slot's own setter.
    (set_device, set_reqs, set_rids, set_gens, set_slots, set_seq_lens, set_orig, set_sum,
     set_max, set_columns, set_ints) = _ROW_SETTERS  # fmt: skip
    set_device(rows, device)
    set_reqs(rows, reqs)
    set_rids(rows, ints[RIDS])
    set_gens(rows, ints[GENS])
    set_slots(rows, slots)
    set_seq_lens(rows, Mirrored.trusted(seq_lens, sides[0]))
    set_orig(rows, DeviceOnly(sides[1]))
    set_sum(rows, seq_lens_sum)
    set_max(rows, max_seq_len)
    set_columns(rows, columns)
    set_ints(rows, ints)
    return rows, sides[2:]


# Each field's slot setter, in field order (`build_rows`' too): past the frozen check
# without `object.__setattr__`'s lookup of the slot by name (0.6 µs against 1.0 for 11).
_ROW_SETTERS: Final = slot_setters(Rows, *(field.name for field in attrs.fields(Rows)))


def _expect_positions(index: object, num_rows: int) -> None:
    # `Rows.take`'s index: 1-D integer positions, strictly increasing, in range. Its one
    # caller among the transitions (`split`) gathers indices `keep_indices` checked.
    if not isinstance(index, np.ndarray) or index.dtype.kind not in "iu" or index.ndim != 1:
        got = (
            f"{index.dtype} {list(index.shape)}"
            if isinstance(index, np.ndarray)
            else type(index).__name__
        )
        raise KeepIndicesError(f"Rows.take: expected a 1-D integer numpy array, got {got}")
    if not index.shape[0]:
        return
    if index.shape[0] > 1 and not (index[1:] > index[:-1]).all():
        at = int((index[1:] <= index[:-1]).argmax())
        kind = "a duplicate" if index[at + 1] == index[at] else "out of order"
        raise KeepIndicesError(
            f"Rows.take: positions must be strictly increasing: {kind} at position {at + 1}"
            f" ({int(index[at])} then {int(index[at + 1])})"
        )
    if index[0] < 0:
        raise KeepIndicesError(f"Rows.take: position {int(index[0])} is negative")
    if index[-1] >= num_rows:
        raise KeepIndicesError(
            f"Rows.take: position {int(index[-1])} is out of range for {num_rows} rows"
        )


def _take_tuple(items: tuple[Req, ...], index: HostArray) -> tuple[Req, ...]:
    positions = index.tolist()
    if len(positions) <= _MAX_ONE_BY_ONE:
        return tuple(items[position] for position in positions)
    return tuple(operator.itemgetter(*positions)(items))


def expect_token_ids(ids: HostArray, reqs: Sequence[Req], tokens: Sequence[int] = ()) -> None:
    """Raise `TokenIdError` unless the ids a forward computes (`ids`, int64) are all >= 0.

    `ids` are the prompt ids of `reqs` past what each holds, then the running
    rows' input `tokens`, if any. One host reduction on the happy path; the
    message names the first request (or running row) with a negative id.
    """
    if not ids.shape[0] or int(np.minimum.reduce(ids)) >= 0:
        return
    for req in reqs:
        for position, token in enumerate(req.input_ids):
            if token < 0:
                raise TokenIdError(
                    f"request {req.rid}: input id {token} at position {position} is negative:"
                    " token ids are >= 0"
                )
    for row, token in enumerate(tokens):
        if token < 0:
            raise TokenIdError(f"running row {row}'s input token {token} is negative")
    raise TokenIdError("an input id is negative: token ids are >= 0")  # not reached


def expect_current(rows: Rows[C], pools: Pools) -> None:
    """Raise `StaleRecord` unless each row's slot owns exactly the row's length at its generation.

    Two host gathers and compares on the happy path; the message names the
    first row that differs.
    """
    slots, lengths = rows.req_pool_indices.host, rows.seq_lens.host
    try:
        held = pools.slot_tokens[slots]
        gens = pools.slot_gens[slots]
    except IndexError:
        pass  # a slot outside the table: say which below
    else:
        # A negative slot would read from the end: Rows' checks refuse slots < 1. Both
        # sides int64 and one row per slot: equal bytes are equal values (`same` without
        # its dtype and shape tests).
        if held.tobytes() == lengths.tobytes() and gens.tobytes() == rows.gens.tobytes():
            return
    owned = pools.slot_tokens[slots.clip(0, pools.max_reqs)].tolist()
    rows_seen = zip(slots.tolist(), lengths.tolist(), owned, strict=True)
    for row, (slot, length, owns) in enumerate(rows_seen):
        in_table = 1 <= slot <= pools.max_reqs
        if not in_table or owns != length:
            raise StaleRecord(
                f"row {row} (request {rows.reqs[row].rid}) has {length} tokens in slot {slot},"
                f" the pools hold {owns if in_table else 'no such slot'}:"
                " the batch or the pools are stale"
            )
    held_gens = pools.slot_gens[slots].tolist()
    rows_gens = zip(slots.tolist(), rows.gens.tolist(), held_gens, strict=True)
    for row, (slot, gen, held_gen) in enumerate(rows_gens):
        if gen != held_gen:
            raise StaleRecord(
                f"row {row} (request {rows.reqs[row].rid}) holds slot {slot} at generation"
                f" {gen}, the pools' slot is at generation {held_gen}: it was released"
                " and handed out again, the batch is stale"
            )
