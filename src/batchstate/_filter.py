"""Filter: keep some rows of a running batch, by position."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from batchstate._errors import KeepIndicesError, PhaseError
from batchstate._mirrored import Mirrored
from batchstate._phases import Decoding, Extended, Filtered, Running

__all__ = ["filter_batch"]


def filter_batch(batch: Running, keep: Sequence[int] | torch.Tensor) -> Filtered:
    """The rows at `keep`, in order, on every column, device and host.

    Keeping none gives a well-formed empty `Filtered`: zero rows on every
    field and `seq_lens_sum == 0`. Reads nothing from the device. Does not
    free memory: hand the rows that left to `release`.

    Args:
        batch: a running batch.
        keep: strictly increasing row positions: a list of ints, or a CPU
            integer tensor `[num_kept]`.

    Raises:
        PhaseError: `batch` is `Idle` (or not a batch at all).
        KeepIndicesError: `keep` is not strictly increasing positions in
            `[0, num_reqs)`, is not integer, or is on a device.

    >>> from batchstate import Req, extend, idle, make_pools
    >>> pools = make_pools(4, 16, 32, torch.device("cpu"))
    >>> reqs = [Req(rid, (1, 2, 3)) for rid in range(3)]
    >>> batch, pools = extend(idle("cpu"), reqs, pools).unwrap()
    >>> filter_batch(batch, [0, 2]).rows.req_pool_indices.host.tolist()
    [1, 3]
    >>> filter_batch(batch, []).rows.seq_lens_sum
    0
    """
    if not isinstance(batch, Extended | Decoding | Filtered):
        raise PhaseError(
            f"filter_batch takes Extended, Decoding or Filtered, got {type(batch).__name__}"
        )
    rows = batch.rows
    index = keep_indices(keep, len(rows))
    if index.shape[0] == len(rows):
        return Filtered(rows)  # every row, in order: nothing to copy
    return Filtered(rows.take(Mirrored.from_host(index, rows.device)))


def keep_indices(keep: Sequence[int] | torch.Tensor, num_rows: int) -> torch.Tensor:
    """Check keep positions on the host and return them as CPU int64 `[num_kept]`."""
    index = _as_host_int64(keep)
    if index.dim() != 1:
        raise KeepIndicesError(f"keep indices must be 1-D, got shape {list(index.shape)}")
    if index.shape[0] == 0:
        return index
    steps = index.diff()
    if not bool((steps > 0).all()):
        at = int((steps <= 0).nonzero()[0])
        kind = "a duplicate" if int(steps[at]) == 0 else "out of order"
        raise KeepIndicesError(
            f"keep indices must be strictly increasing: {kind} at position {at + 1}"
            f" ({int(index[at])} then {int(index[at + 1])})"
        )
    first, last = index[_ENDS].tolist()
    if first < 0:
        raise KeepIndicesError(f"keep index {first} is negative")
    if last >= num_rows:
        raise KeepIndicesError(f"keep index {last} is out of range for {num_rows} rows")
    return index


def _as_host_int64(keep: Sequence[int] | torch.Tensor) -> torch.Tensor:
    if isinstance(keep, torch.Tensor):
        if keep.device.type != "cpu":
            raise KeepIndicesError(
                f"keep indices must be on the CPU, got {keep.device}: reading them would sync"
            )
        if keep.dtype.is_floating_point or keep.dtype.is_complex or keep.dtype == torch.bool:
            raise KeepIndicesError(f"keep indices must be integers, got {keep.dtype}")
        return keep.to(torch.int64)
    if bool in map(type, keep):  # C-speed scan: a generator costs 80 ns a row
        raise KeepIndicesError("keep indices must be integers, got a bool")
    try:
        return torch.frombuffer(array("q", keep), dtype=torch.int64) if keep else _EMPTY
    except TypeError as error:
        raise KeepIndicesError(f"keep indices must be integers: {error}") from None
    except OverflowError as error:
        raise KeepIndicesError(f"keep indices must fit in int64: {error}") from None


_EMPTY = torch.empty(0, dtype=torch.int64)
_ENDS = torch.tensor([0, -1])
