"""A verify forward's outcome on the host: accepted tokens and counts in one named read.

The host needs both after a verify forward: the counts to set each row's
length (`sync`, `exact_window`), the tokens to stream output and check
finishes. Read apart, they are two waits; `read_verified` packs them on
the device and copies them back once, inside `permitted_reads`.
"""

from __future__ import annotations

from typing import final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate.audit import permitted_reads
from batchstate.base.errors import DraftError
from batchstate.base.mirrored import HostArray, frozen

__all__ = ["Verified", "read_verified"]


@final
@attrs.frozen(eq=False, repr=False)
class Verified:
    """What a verify forward decided, on the host: read-only int64 arrays.

    Row i accepted `counts[i]` drafts; `tokens[i, : counts[i] + 1]` are
    its accepted drafts and then the token the forward sampled after them.
    """

    counts: HostArray  # [num_rows]
    tokens: npt.NDArray[np.int64]  # [num_rows, max_drafts + 1]

    def accepted_tokens(self, row: int) -> list[int]:
        """Row `row`'s new tokens: its accepted drafts, then the one sampled after them."""
        tokens: list[int] = self.tokens[row, : int(self.counts[row]) + 1].tolist()
        return tokens

    def __repr__(self) -> str:
        return f"Verified(num_rows={self.counts.shape[0]}, width={self.tokens.shape[1]})"


def read_verified(counts: torch.Tensor, tokens: torch.Tensor) -> Verified:
    """Copy a verify forward's accepted counts and tokens to the host: one read, permitted.

    It waits for the forward that wrote them. Packing both into one
    tensor is a device `cat`; the copy runs inside
    `permitted_reads("speculative verify: accepted tokens and counts")`.

    Args:
        counts: int32 or int64 `[num_rows]`, accepted drafts per row (SGLang's
            `accept_length` is int32).
        tokens: integer `[num_rows, width]` on the same device: each row's
            accepted drafts, then the token sampled after them.

    Raises:
        DraftError: shapes, dtypes or devices that do not match.
    """
    given: tuple[object, object] = (counts, tokens)  # callers without mypy may pass anything
    if not all(isinstance(tensor, torch.Tensor) for tensor in given):
        raise DraftError("read_verified takes two torch tensors: counts and tokens")
    if (
        counts.dim() != 1
        or counts.dtype not in (torch.int32, torch.int64)
        or tokens.dim() != 2
        or tokens.shape[0] != counts.shape[0]
        or tokens.dtype not in (torch.int32, torch.int64)
        or tokens.device != counts.device
    ):
        raise DraftError(
            f"read_verified: expected int32/int64 counts [rows] and tokens [rows, width] on one"
            f" device, got {counts.dtype} {list(counts.shape)} on {counts.device} and"
            f" {tokens.dtype} {list(tokens.shape)} on {tokens.device}"
        )
    packed = torch.cat((counts.to(torch.int64)[:, None], tokens.to(torch.int64)), dim=1)
    with permitted_reads("speculative verify: accepted tokens and counts"):
        host = packed.to("cpu").numpy()  # NOTE: the one read; it waits for the forward
    return Verified(frozen(host[:, 0].copy()), frozen(host[:, 1:].copy()))
