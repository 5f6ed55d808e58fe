"""Filter: keep some rows of a running batch, by position, and hand over the rest."""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence
from itertools import islice
from typing import Final, Generic, NamedTuple, TypeAlias, final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate.base.errors import KeepIndicesError, PhaseError
from batchstate.base.mirrored import NO_INTS, HostArray, frozen
from batchstate.base.read_only import read_only_copies
from batchstate.base.setters import new_record, slot_setters
from batchstate.columns.columns import C
from batchstate.records.phases import RUNNING_PHASES, Filtered, Running
from batchstate.records.rows import GENS, SEQ_LENS, SLOTS, Req, Rows

__all__ = ["Departed", "Keep", "Split", "filter_batch", "keep_indices", "split"]

# Row positions to keep: Python ints, or a 1-D integer numpy array or CPU tensor.
Keep: TypeAlias = Sequence[int] | npt.NDArray[np.integer] | torch.Tensor


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class Departed:
    """The rows that left a batch, host side only: what `release` needs to free them.

    `gens` (keyword-only) is the generation each row holds its slot at:
    `release` refuses a slot at another generation (released and handed out
    again), so releasing the same `Departed` twice is always refused.
    """

    reqs: tuple[Req, ...]
    slots: HostArray  # read-only int64 [num_left], the request slots they own
    seq_lens: HostArray  # read-only int64 [num_left], the tokens each holds in its slot
    gens: HostArray = attrs.field(kw_only=True)  # read-only int64 [num_left], slot generations
    # The rows that stayed, from the same split: disjoint from these by
    # construction, so `release` need not compare slots against them. Only
    # `split` sets it: not an argument, and `attrs.evolve` resets it, so a
    # value built or changed by hand is always compared. Compared by identity.
    stayed: object = attrs.field(default=None, init=False)

    def _held_slots(self) -> list[tuple[int, int, int]]:
        # (slot, tokens it holds, generation) per row: what `find_leaks` compares.
        slots, lens = self.slots.tolist(), self.seq_lens.tolist()
        return list(zip(slots, lens, self.gens.tolist(), strict=True))

    def __repr__(self) -> str:
        return f"Departed(rids={[req.rid for req in self.reqs]}, slots={self.slots.tolist()})"


class Split(NamedTuple, Generic[C]):
    """A batch cut in two: the rows that go on, and the rows that left."""

    kept: Filtered[C]
    left: Departed


def split(batch: Running[C], keep: Keep) -> Split[C]:
    """The rows at `keep` as a `Filtered`, and the others as `Departed`, in one pass.

    What an engine does when requests finish: `kept` goes on, `left` goes to
    `release`. Keep positions are checked once; host values of `kept` are
    derived from the rows that left. Reads nothing from the device.

    Args:
        batch: a running batch.
        keep: strictly increasing row positions: a list of ints, or a 1-D
            integer numpy array or CPU tensor `[num_kept]`.

    Raises:
        PhaseError: `batch` is `Idle` (or not a batch at all).
        KeepIndicesError: `keep` is not strictly increasing positions in
            `[0, num_reqs)`, is not integer, or is on a device.

    >>> from batchstate import Req, extend, idle, make_pools, release
    >>> pools = make_pools(4, 16, 32, torch.device("cpu"))
    >>> reqs = [Req(rid, (1, 2, 3)) for rid in range(3)]
    >>> batch, pools = extend(idle("cpu"), reqs, pools).unwrap()
    >>> kept, left = split(batch, [0, 2])
    >>> kept.rows.req_pool_indices.host.tolist(), left.slots.tolist()
    ([1, 3], [2])
    >>> release(left, kept, pools).unwrap().num_free_slots
    2
    """
    return _split(batch, keep, "split")


def filter_batch(batch: Running[C], keep: Keep) -> Filtered[C]:
    """The rows at `keep`, in order, on every column, device and host.

    `split(batch, keep).kept`: the same arguments and errors. Keeping none
    gives a well-formed empty `Filtered`: zero rows on every field and
    `seq_lens_sum == 0`. Reads nothing from the device. Frees nothing: use
    `split` to hand the rows that left to `release`.

    >>> from batchstate import Req, extend, idle, make_pools
    >>> pools = make_pools(4, 16, 32, torch.device("cpu"))
    >>> reqs = [Req(rid, (1, 2, 3)) for rid in range(3)]
    >>> batch, pools = extend(idle("cpu"), reqs, pools).unwrap()
    >>> filter_batch(batch, [0, 2]).rows.req_pool_indices.host.tolist()
    [1, 3]
    >>> filter_batch(batch, []).rows.seq_lens_sum
    0
    """
    return _split(batch, keep, "filter_batch").kept


def keep_indices(keep: Keep, num_rows: int) -> HostArray:
    """Check keep positions on the host and return them as a read-only int64 array `[num_kept]`.

    Raises:
        KeepIndicesError: naming the first bad position.
    """
    index = _as_host_int64(keep)
    if index.ndim != 1:
        raise KeepIndicesError(f"keep indices must be 1-D, got shape {list(index.shape)}")
    if index.shape[0] == 0:
        return index
    listed = _is_sequence(keep)
    if not _increasing(keep, index, listed=listed):
        if listed and bool in set(map(type, keep)):
            raise KeepIndicesError("keep indices must be integers, got a bool")  # off the hot path
        at = int((index[1:] <= index[:-1]).argmax())
        kind = "a duplicate" if index[at + 1] == index[at] else "out of order"
        raise KeepIndicesError(
            f"keep indices must be strictly increasing: {kind} at position {at + 1}"
            f" ({int(index[at])} then {int(index[at + 1])})"
        )
    # Sorted: the ends bound the rest. A list gives them without a tensor op.
    first, last = (keep[0], keep[-1]) if listed else (index[0], index[-1])
    if first < 0:
        raise KeepIndicesError(f"keep index {first} is negative")
    if last >= num_rows:
        raise KeepIndicesError(f"keep index {last} is out of range for {num_rows} rows")
    return index


def _split(batch: Running[C], keep: Keep, transition: str) -> Split[C]:
    if not isinstance(batch, RUNNING_PHASES):
        raise PhaseError(
            f"{transition} takes Extended, Decoding or Filtered, got {type(batch).__name__}"
        )
    rows = batch.rows
    num_rows = len(rows)
    index = keep_indices(keep, num_rows)
    if index.shape[0] == num_rows:
        return Split(Filtered(rows), _NOBODY)  # every row, in order: nothing to copy
    dropped = np.empty(num_rows, dtype=np.bool_)
    dropped.fill(True)  # two C calls: `np.ones` is a Python function around them, twice the cost
    dropped[index] = False
    left_index = dropped.nonzero()[0]
    positions = left_index.tolist()
    gone = frozen(rows.ints.take(left_index, axis=1))  # the host columns of the rows that left
    if len(positions) > index.shape[0]:
        stayed = rows.gather(index)  # few kept: sum over them (`keep_indices` checked them)
    else:
        stayed = rows.without(index, positions, gone[SEQ_LENS].tolist())
    reqs = rows.reqs
    left = _departed(tuple([reqs[position] for position in positions]), gone, stayed)
    return Split(Filtered(stayed), left)


def _departed(reqs: tuple[Req, ...], gone: HostArray, stayed: Rows[C]) -> Departed:
    # `Departed`'s fields set as its attrs __init__ sets them, and `stayed`, which is not
    # an __init__ argument: rows of checked rows need no checks, and `Departed` has none.
    set_reqs, set_slots, set_seq_lens, set_gens, set_stayed = _DEPARTED_SETTERS
    left = new_record(Departed)
    set_reqs(left, reqs)
    set_slots(left, gone[SLOTS])
    set_seq_lens(left, gone[SEQ_LENS])
    set_gens(left, gone[GENS])
    set_stayed(left, stayed)
    return left


_DEPARTED_SETTERS: Final = slot_setters(Departed, "reqs", "slots", "seq_lens", "gens", "stayed")


def _is_sequence(keep: Keep) -> bool:
    # A list or tuple by its type first: `isinstance` against the ABC costs ~0.3 µs a call.
    return type(keep) in _PLAIN_SEQUENCES or isinstance(keep, Sequence)


def _increasing(keep: Keep, index: HostArray, *, listed: bool) -> bool:
    # Short lists are checked faster in Python than with three tensor ops.
    if index.shape[0] < 2:
        return True
    if listed and len(keep) <= _MAX_PYTHON_CHECK:
        return all(map(operator.lt, keep, islice(keep, 1, None)))
    # Compared, not subtracted: the difference of two int64 positions can overflow.
    return bool((index[1:] > index[:-1]).all())


def _as_host_int64(keep: Keep) -> HostArray:
    if isinstance(keep, torch.Tensor):
        if keep.device.type != "cpu":
            raise KeepIndicesError(
                f"keep indices must be on the CPU, got {keep.device}: reading them would sync"
            )
        if keep.dtype.is_floating_point or keep.dtype.is_complex or keep.dtype == torch.bool:
            raise KeepIndicesError(f"keep indices must be integers, got {keep.dtype}")
        keep = keep.numpy()
    if isinstance(keep, np.ndarray):
        if keep.dtype.kind not in "iu":
            raise KeepIndicesError(f"keep indices must be integers, got {keep.dtype}")
        if keep.dtype.kind == "u" and keep.size and int(keep.max()) > _INT64_MAX:
            raise KeepIndicesError(f"keep indices must fit in int64, got {int(keep.max())}")
        return frozen(keep.astype(np.int64))
    # A bool is an int to `array`: a mask would pass as positions 0 and 1. In
    # strictly increasing positions a bool can only stand first or second
    # (`keep_indices` names one elsewhere when the order check fails).
    if bool in map(type, keep[:2]):
        raise KeepIndicesError("keep indices must be integers, got a bool")
    try:
        return frozen(np.frombuffer(array("q", keep), dtype=np.int64)) if keep else NO_INTS
    except TypeError as error:
        raise KeepIndicesError(f"keep indices must be integers: {error}") from None
    except OverflowError as error:
        raise KeepIndicesError(f"keep indices must fit in int64: {error}") from None


_INT64_MAX: Final = int(np.iinfo(np.int64).max)
_PLAIN_SEQUENCES: Final = (list, tuple)
_MAX_PYTHON_CHECK: Final = 128
_NOBODY: Final = Departed((), NO_INTS, NO_INTS, gens=NO_INTS)
