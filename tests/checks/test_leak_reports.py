"""find_leaks counts what leaked from every kind of holder, and Leaks says it in one line."""

from __future__ import annotations

import re

import pytest

from batchstate import (
    Departed,
    InvariantViolation,
    Leaks,
    check_leaks,
    decode,
    find_leaks,
    finish_mixed,
    idle,
    mix,
    split,
    verify,
)
from batchstate.base.mirrored import host_int64
from tests.builders import make_extended, make_reqs, make_test_pools


def test_no_leaks_is_falsy_and_says_so() -> None:
    assert not Leaks() and str(Leaks()) == "no leaks"


@pytest.mark.parametrize(
    ("leaks", "text"),
    [
        (
            Leaks(unheld=(3, 4), unheld_tokens=40, unheld_pages=3),
            "slots [3, 4] are owned but held by no record (40 KV tokens, 3 pages)",
        ),
        (Leaks(held_twice=(1,)), "slots [1] are held twice"),
        (Leaks(wrong_length=(2, 5)), "slots [2, 5] are held at another length"),
        (
            Leaks((3,), 16, 1, (1,), (2,)),
            "slots [3] are owned but held by no record (16 KV tokens, 1 pages);"
            " slots [1] are held twice; slots [2] are held at another length",
        ),
    ],
)
def test_each_kind_of_leak_is_truthy_and_named(leaks: Leaks, text: str) -> None:
    assert leaks and str(leaks) == text


def test_check_leaks_raises_with_the_report_and_passes_when_all_is_held() -> None:
    extended, pools = make_extended(make_test_pools(), [3, 5])
    check_leaks(pools, [extended])
    with pytest.raises(
        InvariantViolation,
        match=f"^{re.escape('leak check: slots [1, 2] are owned but held by no record')}",
    ):
        check_leaks(pools, [idle("cpu")])


@pytest.mark.parametrize(("page_size", "pages"), [(1, 40), (16, 3), (40, 1)])
def test_unheld_pages_round_each_slot_up(page_size: int, pages: int) -> None:
    """A dropped chunk of 40 tokens: its pages, the last one partly used, never come back."""
    pools = make_test_pools(page_size, max_context_len=512, num_kv_tokens=640)
    mixed, pools = mix(idle("cpu"), make_reqs([3, 100]), 43, pools).unwrap()
    running, (chunk,) = finish_mixed(mixed)
    assert chunk.cached == 40
    leaks = find_leaks(pools, [running])
    assert leaks == Leaks((chunk.slot,), 40, pages)


def test_a_departed_not_yet_released_holds_its_slots() -> None:
    extended, pools = make_extended(make_test_pools(), [3, 5, 7])
    kept, left = split(extended, [1])
    assert not find_leaks(pools, [kept, left])
    assert find_leaks(pools, [kept]).unheld == (1, 3)


def test_a_verify_window_holds_its_slots_at_any_length() -> None:
    """Only the device knows a verifying row's length: its slots count as held, never stale."""
    extended, pools = make_extended(make_test_pools(), [3, 5])
    decoding, pools = decode(extended, pools).unwrap()
    verifying, reserved = verify(decoding, [2, 1], pools).unwrap()
    assert not find_leaks(reserved, [verifying])
    assert find_leaks(reserved, [verifying, verifying]).held_twice == (1, 2)


def test_a_slot_past_the_pools_table_is_held_at_a_wrong_length() -> None:
    """A record from larger pools: its top slot is outside these pools; theirs is inside."""
    big, _ = make_extended(make_test_pools(max_reqs=3), [3, 5, 7])
    small, pools = make_extended(make_test_pools(max_reqs=2), [3, 5])
    assert find_leaks(pools, [small]) == Leaks()
    assert find_leaks(pools, [big]).wrong_length == (3,)


def test_something_that_holds_no_slots_is_a_type_error() -> None:
    _, pools = make_extended(make_test_pools(), [3])
    with pytest.raises(TypeError, match=r"^find_leaks: str holds no request slots$"):
        find_leaks(pools, ["batch"])  # type: ignore[list-item]  # on purpose


def test_a_departed_built_by_hand_at_length_zero_is_stale() -> None:
    """Zero tokens is a length like any other: the pools own three there."""
    extended, pools = make_extended(make_test_pools(), [3])
    empty = Departed(extended.rows.reqs, host_int64([1]), host_int64([0]), gens=extended.rows.gens)
    assert find_leaks(pools, [empty]).wrong_length == (1,)


def test_a_departed_built_by_hand_with_a_length_missing_is_refused_not_half_read() -> None:
    extended, pools = make_extended(make_test_pools(), [3, 5])
    ragged = Departed(
        extended.rows.reqs, host_int64([1, 2]), host_int64([3]), gens=extended.rows.gens
    )
    with pytest.raises(ValueError, match="zip"):
        find_leaks(pools, [ragged])
