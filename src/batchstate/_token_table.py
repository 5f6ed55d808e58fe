"""The request-to-token table: the one piece of batch memory written in place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import attrs
import torch

from batchstate._errors import BatchConflict
from batchstate._mirrored import Mirrored, _describe

__all__ = ["TokenTable"]


@final
@attrs.frozen(eq=False, repr=False)
class TokenTable:
    """`[max_reqs + 1, max_context_len]` int32: slot, position -> KV token location.

    Row 0 is padding and never handed out. A table is too large to copy per
    step, so it is the one thing transitions write in place, on both sides
    at once.

    NOTE: transitions write it only after every allocation of that
    transition has succeeded, and only at cells that the records and pools
    handed in treat as unused (free slots, positions past a row's length).
    An abandoned result therefore leaves every earlier value valid.
    """

    host: torch.Tensor  # CPU int32 [max_reqs + 1, max_context_len]
    device: torch.Tensor  # the same, on the batch's device

    @classmethod
    def zeros(cls, max_reqs: int, max_context_len: int, device: torch.device) -> TokenTable:
        """An all-padding table for `max_reqs` request slots."""
        shape = (max_reqs + 1, max_context_len)
        return cls(
            torch.zeros(shape, dtype=torch.int32),
            torch.zeros(shape, dtype=torch.int32, device=device),
        )

    @property
    def max_context_len(self) -> int:
        return self.host.shape[1]

    def expect_on(self, device: torch.device) -> None:
        """Raise `BatchConflict` unless the device side lives on `device` (a batch's).

        NOTE: transitions write both sides with the batch's index tensors; on
        another device the device side would be left unwritten.
        """
        if self.device.device != device:
            raise BatchConflict(
                f"the batch is on {device}, the pools' table on {self.device.device}"
            )

    def write(self, slots: Mirrored, positions: Mirrored, locs: Mirrored) -> None:
        """Set `table[slots[i], positions[i]] = locs[i]` on both sides (mutates the table)."""
        host_locs, device_locs = _as_int32(locs)
        # NOTE: convert both, then write the device side first: if it fails (out of
        # memory, say) neither side has changed. The host write, last, indexes CPU
        # memory at cells the device write just accepted.
        self.device[slots.device, positions.device] = device_locs
        self.host[slots.host, positions.host] = host_locs

    def write_rows(self, slots: Sequence[int], lengths: Sequence[int], locs: Mirrored) -> None:
        """Set `table[slots[i], :lengths[i]]` to the next `lengths[i]` of `locs` (mutates it).

        For freshly admitted rows: one slice per row and side, no index tensors.
        """
        host_locs, device_locs = _as_int32(locs)
        rows = list(zip(slots, lengths, strict=True))
        done = 0  # rows written on the device side
        try:
            for side, values in ((self.device, device_locs), (self.host, host_locs)):  # as `write`
                start = 0
                for slot, length in rows:
                    side[slot, :length] = values[start : start + length]
                    start += length
                    done += side is self.device
        except BaseException:
            # NOTE: a row write failing after others leaves the sides different:
            # put the device rows back from the host side, untouched until now.
            for slot, length in rows[:done]:
                self.device[slot, :length] = self.host[slot, :length].to(self.device.device)
            raise

    def __repr__(self) -> str:
        return _describe("TokenTable", self.device)


def _as_int32(locs: Mirrored) -> tuple[torch.Tensor, torch.Tensor]:
    # Both sides as int32; on a CPU device they share storage, so convert once.
    host = locs.host.to(torch.int32)
    return host, host if locs.device is locs.host else locs.device.to(torch.int32)
