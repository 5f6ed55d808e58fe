"""Each Failure record's line, word for word: it is what `unwrap` raises and a log shows."""

from __future__ import annotations

import pytest

from batchstate import (
    ContextTooLong,
    EmptyExtend,
    EmptyPrompt,
    NoChunkBudget,
    NotHeld,
    NotOwned,
    OutOfKVTokens,
    OutOfReqSlots,
    StillRunning,
)

LINES = [
    (
        OutOfReqSlots(3, 1),
        "out of request slots: 3 requested, 1 free; 0 of the requests offered fit",
    ),
    (
        OutOfKVTokens(4, 2, 16),
        "out of KV tokens: 4 pages of 16 requested, 2 free; 0 of the requests offered fit",
    ),
    (ContextTooLong(7, 80, 64), "request 7 needs 80 tokens of context, the table holds 64"),
    (EmptyExtend(), "extend needs at least one request"),
    (EmptyPrompt(7, 3, 3), "request 7 has nothing to extend: 3 input ids, 3 already cached"),
    (
        NotOwned((1, 2)),
        "request slots [1, 2] are not owned: already released or never allocated",
    ),
    (StillRunning((4,)), "request slots [4] are still in the running batch"),
    (
        NotHeld(70, 3, 4, 0),
        "request 70 is not held in slot 3: the chunk says 4 cached tokens, the pools hold 0",
    ),
    (NoChunkBudget(0), "the chunk budget must be at least 1 token per step, got 0"),
]


@pytest.mark.parametrize(("record", "line"), LINES, ids=lambda value: type(value).__name__)
def test_the_line_of_each_failure(record: object, line: str) -> None:
    assert str(record) == line
