"""A device tensor whose host value is known only as an upper bound, as a type of its own.

Under overlap scheduling the host may plan a step before the device has
decided the last one (how many drafts a verify forward accepted). Peers
keep such a host value in the mirror's place, as `None` or as a field
named `..._upper_bound`, and every reader must remember which it holds.
Here it is `UpperBound`: its host side is `bound`, not `host`, and it is
no `Mirrored`, so mypy refuses it wherever an exact host value is needed
(a sum for launch bounds, FlashInfer's `plan()` offsets, `sync`).
What a bound serves: reserving KV, sizing a page table or a graph bucket.
"""

from __future__ import annotations

from typing import Generic, final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate.base.errors import RecordShapeError
from batchstate.base.mirrored import Scalar, describe, torch_dtype
from batchstate.base.read_only import read_only_copies

__all__ = ["UpperBound"]


@read_only_copies
@final
@attrs.frozen(eq=False, repr=False)
class UpperBound(Generic[Scalar]):
    """A device tensor and a read-only host array that bounds it from above, element by element.

    `device[i] <= bound[i]`: the device holds the exact values, the host
    only what they cannot exceed. There is no `host`: code that needs an
    exact host value cannot take one (a mypy error), and code that can
    plan with a bound names it.

    Args:
        bound: read-only numpy array `[n]`, each element's upper bound.
        device: the exact values, `[n]`, same dtype.

    Raises:
        RecordShapeError: shapes or dtypes differ, or `bound` is writable.
    """

    bound: npt.NDArray[Scalar]
    device: torch.Tensor

    def __attrs_post_init__(self) -> None:
        bound, device = self.bound, self.device
        given: tuple[object, object] = (bound, device)  # callers without mypy may pass anything
        if (
            not isinstance(given[0], np.ndarray)
            or not isinstance(given[1], torch.Tensor)
            or self.bound.ndim != 1
            or self.bound.flags.writeable
            or tuple(self.device.shape) != self.bound.shape
            or self.device.dtype != torch_dtype(self.bound.dtype)
        ):
            raise RecordShapeError(
                "UpperBound: expected a read-only 1-D numpy bound and a device tensor of its"
                f" shape and dtype, got {type(given[0]).__name__} and {type(given[1]).__name__}"
            )

    def __len__(self) -> int:
        return int(self.bound.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """The device side's dtype."""
        return self.device.dtype

    @property
    def max_bound(self) -> int:
        """The largest bound, 0 when empty: a static width that holds every row."""
        return int(self.bound.max()) if self.bound.shape[0] else 0

    def __repr__(self) -> str:
        return describe("UpperBound", self.device)
