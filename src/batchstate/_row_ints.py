"""The layout of `Rows.ints`: a batch's four int64 host columns, one row each."""

from __future__ import annotations

from typing import Final

import numpy as np

from batchstate._mirrored import HostArray, frozen

__all__ = ["GENS", "NUM_INTS", "RIDS", "SEQ_LENS", "SLOTS", "pack_ints"]

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
