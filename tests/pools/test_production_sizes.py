"""Every transition at production size, on meta: 1,024 requests, a million KV tokens, 128k context.

The table's device side lives on `meta` (no memory); its host mirror is
real: 1,025 x 131,072 int32, 537 MB, which the first admission touches
whole (the one slow part here, page faults). See docs/performance.md.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from benchmarks.production_sizes import CONTEXT, ROWS, run

from batchstate import check_pools
from batchstate.audit import device_reads

META = torch.device("meta")


@pytest.fixture(scope="module")
def production() -> dict[str, Any]:
    with device_reads(forbid=True) as log:
        result = run(META)
    result["reads"] = log.report().count
    return result


def test_a_million_tokens_over_1024_requests_at_128k_context(production: dict[str, Any]) -> None:
    """The pass ends with 1,024 rows holding over a million KV tokens, the longest near the
    context, the pools consistent with the batch, and no device read on the way."""
    assert production["rows"] == ROWS == 1_024
    assert production["kv_tokens_held"] >= 1_000_000
    assert 131_000 < production["longest"] <= CONTEXT == 131_072
    assert production["reads"] == 0
    check_pools(production["pools"], [production["running"]])
    assert set(production["times"]) >= {
        "decode",
        "split",
        "release",
        "merge",
        "decode_sampled",
        "verify",
        "verify_ahead",
        "exact_window",
        "sync",
        "forward_inputs (decode)",
        "fill_buffers (decode bucket)",
        "fill_buffers (verify bucket)",
        "pad",
    }


def test_widths_and_memory_are_what_the_sizes_say(production: dict[str, Any]) -> None:
    """The forward's page table is as wide as its longest row, the bucket's as the context;
    filling allocates nothing; the host mirror of the table is 537 MB and the process stays
    under 2.5 GB."""
    assert 131_000 // 1 < production["inputs_width"] < CONTEXT == production["bucket_width"]
    assert production["fill_allocations"] == []
    memory = production["memory"]
    assert memory["table host (per token)"] == (ROWS + 3) * CONTEXT * 4  # rows + padding + spare
    assert memory["table device"] == memory["table host (per token)"]
    assert memory["peak RSS"] < 2_500_000_000
