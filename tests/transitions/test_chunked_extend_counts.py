"""Continuing a chunked prefill, extend counts only the tokens it computes, not the held ones."""

from __future__ import annotations

import torch

from batchstate import Chunked, Req, check_batch, extend, idle, make_pools

CPU = torch.device("cpu")


def test_extend_num_tokens_leaves_out_the_held_prefix() -> None:
    pools = make_pools(4, 32, 64, CPU)
    first, pools = extend(idle(CPU), [Req(7, (1, 2, 3, 4))], pools).unwrap()
    slot = int(first.rows.req_pool_indices.host[0])  # request 7 keeps 4 cached tokens
    batch, _ = extend(
        idle(CPU),
        [
            Chunked(Req(7, (1, 2, 3, 4, 5, 6)), slot, 4, gen=int(first.rows.gens[0])),
            Req(8, (9, 9, 9)),
        ],
        pools,
    ).unwrap()
    assert batch.prefix_lens.tolist() == [4, 0]
    assert batch.extend_lens.tolist() == [2, 3]
    assert batch.rows.seq_lens_sum == 9
    assert batch.extend_num_tokens == 5
    check_batch(batch)
