"""Fill tables: the values padded rows and tokens carry, and their checks.

`pad` and `fill` add rows and tokens to a forward; each needs a slot, a
length, a position, a KV location and a page that every kernel can run on
without touching real data. A fill table names them; SGLang's and vLLM's
are below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from batchstate._captured_sizes import PaddingError, is_int

if TYPE_CHECKING:
    from batchstate._forward_inputs import ForwardInputs
    from batchstate._padded_layout import TableShape

__all__ = ["FILL_FIELDS", "SGLANG_FILLS", "VLLM_FILLS", "check_fill_ranges", "check_fills"]

# What a fill table sets, for padded rows and tokens (every other field follows from these).
FILL_FIELDS: Final = (
    "req_pool_indices",  # a padded row's slot: 0, the table's padding row
    "seq_lens",  # KV tokens a padded row attends over
    "extend_lens",  # query tokens of a padded row: 1 or 0
    "positions",  # a padded token's position
    "out_cache_loc",  # where a padded token's KV is written
    "kv_indices",  # the page a padded row's KV lies in
)

# SGLang's CUDA-graph runner: every padded row reads and writes the padding location 0
# (slot 0, page 0), one KV token and one query token, position 0. What FlashInfer's and
# FA3's kernels need: no row of zero length, and every location inside the cache.
SGLANG_FILLS: Final[Mapping[str, int]] = {
    "req_pool_indices": 0,
    "seq_lens": 1,
    "extend_lens": 1,
    "positions": 0,
    "out_cache_loc": 0,
    "kv_indices": 0,
}
# vLLM's: padded rows have no query and no KV (`query_start_loc` repeats its last value)
# and a slot mapping of -1, which its KV-write kernel skips. Only for kernels that take
# empty rows and skip negative locations.
VLLM_FILLS: Final[Mapping[str, int]] = {
    "req_pool_indices": 0,
    "seq_lens": 0,
    "extend_lens": 0,
    "positions": 0,
    "out_cache_loc": -1,
    "kv_indices": 0,
}


def check_fill_ranges(inputs: ForwardInputs | TableShape, fills: Mapping[str, int]) -> None:
    """Raise `PaddingError` if a fill points outside the table or the KV cache `inputs` read.

    Such a fill would make a padded row read or write memory no pools hand
    out (or past the cache's end).
    """
    context = inputs.table_pages * inputs.page_size
    pages = inputs.kv_cache_size // inputs.page_size
    limits = {
        "req_pool_indices": (0, inputs.table_rows - 1),
        "seq_lens": (0, context),
        "positions": (0, context - 1),
        "out_cache_loc": (-1, inputs.kv_cache_size - 1),  # -1: a location kernels skip
        "kv_indices": (0, pages - 1),
    }
    for name, (low, high) in limits.items():
        if not low <= fills[name] <= high:
            raise PaddingError(
                f"fills: {name}={fills[name]} points outside the table or the KV cache:"
                f" expected {low}..{high}"
            )


def check_fills(fills: Mapping[str, int]) -> None:
    """Raise `PaddingError` unless `fills` sets every name in `FILL_FIELDS` to a usable int."""
    if not isinstance(fills, Mapping):
        raise PaddingError(f"fills must map each of {', '.join(FILL_FIELDS)} to an int")
    missing = [name for name in FILL_FIELDS if name not in fills]
    unknown = sorted(str(name) for name in fills if name not in FILL_FIELDS)
    if missing or unknown:
        raise PaddingError(f"fills: missing {missing}, unknown {unknown}")
    bad = [name for name in FILL_FIELDS if not is_int(fills[name])]
    if bad:
        raise PaddingError(f"fills must be ints: {bad}")
    if fills["extend_lens"] not in (0, 1) or fills["seq_lens"] < fills["extend_lens"]:
        raise PaddingError(
            "fills: extend_lens must be 0 or 1 and seq_lens at least extend_lens, got"
            f" {fills['extend_lens']} and {fills['seq_lens']}"
        )
