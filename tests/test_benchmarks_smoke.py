"""The benchmark runs at tiny sizes, and its three implementations reach the same state.

No timing is asserted: benchmarks are not tests. Agreement is what keeps the
mutable baseline and the floor honest: each must do the work batchstate does.
"""

from __future__ import annotations

import pytest
from benchmarks.measure import count_blocks, count_ops, final_outcomes
from benchmarks.scenario import Config
from benchmarks.step import run


@pytest.mark.parametrize(
    "config",
    [
        Config(1, 1),  # the last row finishes and a new one joins every step
        Config(8, 1),
        Config(8, 16),  # paged: new pages only where a row crosses a page boundary
        Config(33, 4),  # a batch that is not a multiple of anything
    ],
)
def test_implementations_agree(config: Config) -> None:
    """All three end with the same rows, lengths, slots, KV locations and free memory."""
    batchstate, mutable, floor = final_outcomes(config, num_steps=12)
    assert mutable == batchstate
    assert floor == batchstate
    assert batchstate.slots_device == batchstate.slots
    assert batchstate.seq_lens_device == batchstate.seq_lens
    assert batchstate.seq_lens_sum == sum(batchstate.seq_lens)


def test_run_reports_every_point() -> None:
    """A tiny full run yields one summary per point, with ratios and the side counts."""
    points, extras = run([1, 4], [1, 16], repeats=4, warmup=1, quiet=True)
    assert [(p["page_size"], p["batch_size"]) for p in points] == [(1, 1), (1, 4), (16, 1), (16, 4)]
    for point in points:
        assert set(point["stats"]) == {"batchstate", "mutable", "floor"}
        step = {name: stats["step"]["median_us"] for name, stats in point["stats"].items()}
        assert point["a_over_b"] == pytest.approx(step["batchstate"] / step["mutable"])
        assert point["a_over_c"] == pytest.approx(step["batchstate"] / step["floor"])
    assert set(extras["ops"]) == {"batchstate", "mutable", "floor"}


def test_counters_run() -> None:
    """Op and allocation counters return a positive count per implementation."""
    assert all(count > 0 for count in count_ops(Config(4, 1), steps=3).values())
    blocks = count_blocks(Config(4, 1), steps=3)
    assert set(blocks) == {"batchstate", "mutable", "floor"}
    # Every step builds new frozen records: batchstate allocates Python blocks.
    assert blocks["batchstate"] > 0
