"""A forward's row tokens laid out as a `[rows, max_q]` grid for batched attention, and back."""

from __future__ import annotations

from typing import final

import attrs
import torch

__all__ = ["RowGrid"]


@final
@attrs.frozen
class RowGrid:
    """Where each of a forward's first `row_tokens` tokens sits: row `row[t]`, column `col[t]`.

    Tokens padded past `row_tokens` (a captured size's) belong to no row: `flat` gives
    them zeros.
    """

    row: torch.Tensor
    col: torch.Tensor
    num_rows: int
    max_q: int
    row_tokens: int

    def grid(self, x: torch.Tensor) -> torch.Tensor:
        """`[tokens, ...]` -> `[rows, max_q, ...]`, zeros where a row has fewer tokens."""
        out = x.new_zeros(self.num_rows, self.max_q, *x.shape[1:])
        out[self.row, self.col] = x[: self.row_tokens]
        return out

    def flat(self, out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """`[rows, max_q, ...]` -> `[num_tokens, ...]`, zeros for the padded tokens."""
        kept = out[self.row, self.col]
        rowless = num_tokens - self.row_tokens
        return torch.cat((kept, kept.new_zeros(rowless, *kept.shape[1:]))) if rowless else kept
