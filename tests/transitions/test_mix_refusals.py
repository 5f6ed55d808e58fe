"""mix's and decode_sampled's refusals, exactly: each Failure's fields, each whole message."""

from __future__ import annotations

import copy
import re
from typing import Final

import pytest
import torch
from returns.result import Failure

from batchstate import (
    BatchConflict,
    Chunked,
    ContextTooLong,
    DeviceOnly,
    EmptyExtend,
    EmptyPrompt,
    NoChunkBudget,
    NotHeld,
    PhaseError,
    Req,
    Sampled,
    decode,
    decode_sampled,
    idle,
    mix,
)
from tests.builders import make_reqs, make_test_pools
from tests.transitions.test_mixed import _chunked, _running

META: Final = torch.device("meta")


def _exactly(kind: type[Exception], message: str) -> pytest.RaisesExc[Exception]:
    return pytest.raises(kind, match=f"^{re.escape(message)}$")


def test_only_a_filtered_or_idle_batch_is_mixed() -> None:
    running, pools = _running(make_test_pools())
    decoding, pools = decode(running, pools).unwrap()
    with _exactly(PhaseError, "mix takes Filtered or Idle, got Decoding"):
        mix(decoding, [], 8, pools, [1, 1])  # type: ignore[call-overload]  # on purpose


def test_a_budget_of_one_token_runs_and_zero_does_not() -> None:
    running, pools = _running(make_test_pools())
    assert mix(running, make_reqs([5], 20), 0, pools, [1, 1]) == Failure(NoChunkBudget(0))
    mixed, _ = mix(running, make_reqs([5], 20), 1, pools, [1, 1]).unwrap()
    assert mixed.extend_lens.tolist() == [1, 1, 1] and mixed.partial == (0,)


def test_nothing_to_run_only_when_both_sides_are_empty() -> None:
    running, pools = _running(make_test_pools())
    assert mix(idle("cpu"), [], 8, pools) == Failure(EmptyExtend())
    decoded, _ = mix(running, [], 8, pools, [1, 1]).unwrap()
    assert decoded.num_extend_rows == 0 and len(decoded.rows) == 2


def test_chunks_the_pools_do_not_hold_name_what_they_hold() -> None:
    """The chunk in the pools' top slot at another length; a free slot; a slot past the table."""
    running, pools = _running(make_test_pools(max_reqs=3))
    chunk, held = _chunked(copy.deepcopy(pools))  # pools are linear: slot 3 stays free here
    assert (chunk.slot, chunk.cached) == (3, 8)
    stale = Chunked(chunk.req, chunk.slot, 7, gen=chunk.gen)
    assert mix(running, [stale], 8, held, [1, 1]) == Failure(NotHeld(90, 3, 7, 8))
    free = Chunked(Req(70, (1,) * 9), 3, 4, gen=chunk.gen)
    assert mix(running, [free], 8, pools, [1, 1]) == Failure(NotHeld(70, 3, 4, 0))
    outside = Chunked(Req(71, (1,) * 9), 4, 4, gen=chunk.gen)
    assert mix(running, [outside], 8, held, [1, 1]) == Failure(NotHeld(71, 4, 4, 0))


def test_prompts_with_nothing_left_or_too_long_are_named() -> None:
    running, pools = _running(make_test_pools(max_context_len=64))
    chunk, pools = _chunked(pools, length=50, budget=40)
    assert mix(running, [Req(20, ())], 8, pools, [1, 1]) == Failure(EmptyPrompt(20, 0, 0))
    done = Chunked(
        Req(chunk.req.rid, chunk.req.input_ids[:40]), chunk.slot, chunk.cached, gen=chunk.gen
    )
    assert mix(running, [done], 8, pools, [1, 1]) == Failure(EmptyPrompt(90, 40, 40))
    too_long = Req(21, (1,) * 65)
    assert mix(running, [too_long], 8, pools, [1, 1]) == Failure(ContextTooLong(21, 65, 64))
    at_limit, _ = mix(running, [Req(22, (1,) * 64)], 8, pools, [1, 1]).unwrap()
    assert at_limit.num_extend_rows == 1


def test_a_rid_or_slot_twice_is_named() -> None:
    running, pools = _running(make_test_pools())
    with _exactly(
        BatchConflict, "the same rid appears twice among the chunks and running rows: [0]"
    ):
        mix(running, make_reqs([4], 0), 8, pools, [1, 1])
    on_a_running_slot = Chunked(Req(71, (1,) * 9), 1, 5, gen=0)
    with _exactly(
        BatchConflict, "the same slot appears twice among the chunks and running rows: [1]"
    ):
        mix(running, [on_a_running_slot], 8, pools, [1, 1])


def test_input_tokens_must_be_the_running_rows() -> None:
    running, pools = _running(make_test_pools())
    with _exactly(BatchConflict, "1 input tokens for 2 running rows"):
        mix(running, [], 8, pools, [1])
    other, pools = _running(pools, (4, 6), first_rid=10)
    wrong_rows = Sampled.of(other.rows, torch.tensor([1, 2]))
    with _exactly(
        BatchConflict,
        "sampled tokens are for requests [10, 11], the running rows are [0, 1]:"
        " gather_sampled() them to the running batch first",
    ):
        mix(running, [], 8, pools, wrong_rows)
    on_meta = Sampled(running.rows.rids, DeviceOnly(torch.zeros(2, dtype=torch.int64, device=META)))
    with _exactly(BatchConflict, "sampled tokens on meta, the batch on cpu"):
        mix(running, [], 8, pools, on_meta)


def test_decode_sampled_takes_only_a_filtered_batch() -> None:
    running, pools = _running(make_test_pools())
    decoding, pools = decode(running, pools).unwrap()
    tokens = Sampled.of(decoding.rows, torch.tensor([1, 2]))
    with _exactly(PhaseError, "decode_sampled takes Filtered, got Decoding"):
        decode_sampled(decoding, tokens, pools)  # type: ignore[arg-type]  # on purpose


def test_decode_sampled_at_the_context_limit_is_too_long() -> None:
    """A row holding the whole context has no room for the sampled token."""
    running, pools = _running(make_test_pools(max_context_len=9), (5, 9))
    tokens = Sampled.of(running.rows, torch.tensor([1, 2]))
    assert decode_sampled(running, tokens, pools) == Failure(ContextTooLong(1, 10, 9))
    fits, pools = _running(make_test_pools(max_context_len=9), (5, 8))
    mixed, _ = decode_sampled(fits, Sampled.of(fits.rows, torch.tensor([1, 2])), pools).unwrap()
    assert mixed.rows.seq_lens.host.tolist() == [6, 9]


def test_a_running_row_at_the_context_limit_is_too_long_for_mix() -> None:
    running, pools = _running(make_test_pools(max_context_len=9), (5, 9))
    assert mix(running, [], 8, pools, [1, 2]) == Failure(ContextTooLong(1, 10, 9))
    fits, pools = _running(make_test_pools(max_context_len=9), (5, 8))
    mixed, _ = mix(fits, [], 8, pools, [1, 2]).unwrap()
    assert mixed.rows.seq_lens.host.tolist() == [6, 9]
