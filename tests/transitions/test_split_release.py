"""Split, release of a `Departed`, and sync: refusals that used to slip through."""

from __future__ import annotations

import attrs
import pytest
import torch
from returns.result import Failure

from batchstate import (
    Decoding,
    Departed,
    KeepIndicesError,
    PhaseError,
    StillRunning,
    check_pools,
    decode,
    filter_batch,
    release,
    split,
    sync,
    verify,
)
from tests.builders import make_extended, make_phase, make_test_pools
from tests.strategies import assert_unchanged, snapshot


def test_a_departed_edited_to_name_running_rows_is_refused() -> None:
    """`attrs.evolve` of a split's `Departed` cannot keep the split's shortcut: StillRunning."""
    extended, pools = make_extended(make_test_pools(page_size=4), [3, 9, 5])
    kept, left = split(extended, [0, 2])
    assert left.stayed is kept.rows  # split's own value: release may skip the comparison
    edited = attrs.evolve(
        left,
        reqs=kept.rows.reqs,
        slots=kept.rows.req_pool_indices.host,
        seq_lens=kept.rows.seq_lens.host,
    )
    assert edited.stayed is None
    state = snapshot(pools)
    assert release(edited, kept, pools) == Failure(StillRunning((1, 3)))
    assert_unchanged(state, pools, "pools after the refusal")


def test_departed_stayed_is_not_an_argument() -> None:
    """Only `split` vouches that the rows that stayed are disjoint from those that left."""
    extended, _ = make_extended(make_test_pools(), [3, 5])
    kept, left = split(extended, [0])
    with pytest.raises(TypeError):
        Departed(left.reqs, left.slots, left.seq_lens, kept.rows)  # type: ignore[call-arg, arg-type]  # on purpose
    built = Departed(
        kept.rows.reqs,
        kept.rows.req_pool_indices.host,
        kept.rows.seq_lens.host,
        gens=kept.rows.gens,
    )
    assert built.stayed is None


def test_a_departed_from_another_split_of_the_same_batch_is_refused() -> None:
    """The complement's `Departed` names exactly the rows `kept` runs: StillRunning, in order."""
    batch, pools = make_phase(Decoding, make_test_pools(16), [3, 17, 5])
    kept, _ = split(batch, [0, 2])  # type: ignore[arg-type]  # a Decoding
    _, other = split(batch, [1])  # type: ignore[arg-type]  # a Decoding
    slots = kept.rows.req_pool_indices.host.tolist()
    assert release(other, kept, pools) == Failure(StillRunning(tuple(slots)))
    check_pools(pools, [batch], compare_device=True)


def test_sync_of_a_record_that_is_not_a_verify_window_is_a_phase_error() -> None:
    """sync(Decoding, ...) names the phase instead of failing on a missing field."""
    extended, pools = make_extended(make_test_pools(), [3, 5])
    decoding, pools = decode(extended, pools).unwrap()
    for wrong in (extended, decoding, filter_batch(decoding, [0])):
        with pytest.raises(PhaseError, match=f"sync takes Verifying, got {type(wrong).__name__}"):
            sync(wrong, torch.zeros(2, dtype=torch.int64), pools)  # type: ignore[arg-type]  # on purpose
    window, pools = verify(decoding, [1, 0], pools).unwrap()
    synced, _ = sync(window, torch.tensor([1, 0]), pools)
    assert synced.rows.seq_lens.host.tolist() == [5, 6]


@pytest.mark.parametrize("num_rows", [3, 200])
@pytest.mark.parametrize("at", [0, 1, 2, -1])
def test_a_bool_keep_index_is_refused_anywhere(num_rows: int, at: int) -> None:
    """A bool is an int to `array`: refused by type at any position, short or long list."""
    extended, _ = make_extended(make_test_pools(max_reqs=256, num_kv_tokens=1024), [1] * num_rows)
    keep: list[int] = list(range(num_rows))
    keep[at] = bool(keep[at] % 2) if at in (0, 1) else True
    for transition in (split, filter_batch):
        with pytest.raises(KeepIndicesError, match="got a bool"):
            transition(extended, keep)
