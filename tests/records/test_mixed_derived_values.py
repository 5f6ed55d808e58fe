"""The host values mix derives for its rows, and decode_sampled's use of the tokens it is given."""

from __future__ import annotations

import torch

from batchstate import Sampled, decode_sampled, filter_batch, mix
from tests.builders import make_reqs, make_test_pools
from tests.transitions.test_mixed import _chunked, _running


def test_sums_and_longest_row_count_chunks_prefixes_and_decode_rows() -> None:
    running, pools = _running(make_test_pools())
    chunk, pools = _chunked(pools)
    mixed, _ = mix(running, [chunk, *make_reqs([30], 50)], 40, pools, [11, 12]).unwrap()
    lengths = mixed.rows.seq_lens.host.tolist()
    assert lengths == [40, 8, 6, 10]
    assert mixed.rows.seq_lens_sum == sum(lengths) == 64
    assert mixed.rows.max_seq_len == 40


def test_decode_sampled_of_no_rows_is_an_empty_forward() -> None:
    running, pools = _running(make_test_pools())
    empty = filter_batch(running, [])
    tokens = Sampled.of(empty.rows, torch.zeros(0, dtype=torch.int64))
    mixed, _ = decode_sampled(empty, tokens, pools).unwrap()
    assert len(mixed.rows) == 0 and mixed.num_tokens == 0
    assert mixed.rows.max_seq_len == 0 and mixed.rows.seq_lens_sum == 0


def test_decode_sampled_feeds_the_sampled_tokens_themselves() -> None:
    """No copy on the way: the forward reads the tensor the sampler wrote."""
    running, pools = _running(make_test_pools())
    tokens = Sampled.of(running.rows, torch.tensor([7, 8]))
    mixed, _ = decode_sampled(running, tokens, pools).unwrap()
    assert mixed.input_ids.device.data_ptr() == tokens.tokens.device.data_ptr()
    assert mixed.input_ids.device.tolist() == [7, 8]
