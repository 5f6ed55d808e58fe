"""extend refuses two requests with one rid, naming the rid, on each of its admission paths.

A few fresh requests take the row-slice path; many requests, or any
chunked one, take the general path. Each checks rids on its own.
"""

from __future__ import annotations

import pytest
import torch

from batchstate import BatchConflict, Chunked, Req, extend, idle, make_pools
from batchstate.transitions.admission import _MAX_ROW_WRITES

CPU = torch.device("cpu")
MESSAGE = r"^the same rid appears twice among the requests: \[7\]$"


def test_a_few_fresh_requests_with_one_rid() -> None:
    pools = make_pools(4, 32, 64, CPU)
    with pytest.raises(BatchConflict, match=MESSAGE):
        extend(idle(CPU), [Req(7, (1,)), Req(7, (2,))], pools)


def test_many_fresh_requests_with_one_rid() -> None:
    count = _MAX_ROW_WRITES + 1
    pools = make_pools(count, 32, 4 * count, CPU)
    reqs = [Req(rid, (1,)) for rid in range(count - 1)] + [Req(7, (2,))]
    with pytest.raises(BatchConflict, match=MESSAGE):
        extend(idle(CPU), reqs, pools)


def test_a_chunked_request_and_a_fresh_one_with_its_rid() -> None:
    pools = make_pools(4, 32, 64, CPU)
    first, pools = extend(idle(CPU), [Req(7, (1, 2))], pools).unwrap()
    slot = int(first.rows.req_pool_indices.host[0])
    with pytest.raises(BatchConflict, match=MESSAGE):
        extend(
            idle(CPU),
            [Chunked(Req(7, (1, 2, 3)), slot, 2, gen=int(first.rows.gens[0])), Req(7, (4,))],
            pools,
        )
