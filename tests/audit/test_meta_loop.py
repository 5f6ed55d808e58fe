"""The proof that the decode path reads nothing from the device: a long loop on `meta`.

Every device tensor lives on PyTorch's `meta` device, which holds no data,
so any read raises; the audit in forbid mode raises first and names it. The
same script on `cpu` must agree on every host-side value after every step.
"""

from __future__ import annotations

import pytest
import torch
from tools.decode_loop import LoopConfig, Snapshot, run_loop, scripted_accept

from batchstate import Batch, Pools, check_batch, check_pools
from batchstate.audit import DeviceReadError, device_reads

META = torch.device("meta")
CPU = torch.device("cpu")


def _check_host(batch: Batch, pools: Pools) -> None:
    check_batch(batch)
    check_pools(pools, [batch])


def _check_both_sides(batch: Batch, pools: Pools) -> None:
    check_batch(batch, compare_device=True)
    check_pools(pools, [batch], compare_device=True)


def _events(snapshots: tuple[Snapshot, ...]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for snapshot in snapshots:
        counts[snapshot.event] = counts.get(snapshot.event, 0) + 1
    return counts


@pytest.mark.parametrize("page_size", [1, 16])
def test_meta_loop_makes_no_device_read(page_size: int) -> None:
    """The whole loop, verify steps included, runs on meta under a forbidding audit."""
    config = LoopConfig(page_size=page_size, draft_every=4)
    with device_reads(forbid=True) as log:
        snapshots = run_loop(META, config, check=_check_host)
    assert log.report().count == 0
    events = _events(snapshots)
    # The script exercises every decode-path transition many times.
    assert events["decode"] >= 100
    assert events["filter"] >= 20
    assert events["release"] == events["filter"]
    assert events["extend+merge"] >= 20
    assert events["verify"] >= 25
    assert max(len(snapshot.rids) for snapshot in snapshots) >= 8


@pytest.mark.parametrize("page_size", [1, 16])
def test_cpu_loop_agrees_with_meta_step_by_step(page_size: int) -> None:
    """Mirrors, sums and slot and page ownership match the meta run after every transition."""
    config = LoopConfig(page_size=page_size, draft_every=4)
    on_meta = run_loop(META, config)
    on_cpu = run_loop(CPU, config, check=_check_both_sides)
    assert len(on_meta) == len(on_cpu)
    for meta_step, cpu_step in zip(on_meta, on_cpu, strict=True):
        assert meta_step == cpu_step


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_loop_on_cpu_keeps_every_invariant(page_size: int) -> None:
    """With sync after each verify, the loop keeps both sides and the pools consistent."""
    config = LoopConfig(page_size=page_size, draft_every=3)
    snapshots = run_loop(CPU, config, scripted_accept, check=_check_both_sides)
    events = _events(snapshots)
    assert events["sync"] == events["verify"] >= 30
    after_sync = [s for s in snapshots if s.event == "sync"]
    assert any(s.seq_lens_sum for s in after_sync)


def test_meta_catches_a_read_the_proof_would_miss_otherwise() -> None:
    """A check that compares device tensors inside the loop is named by the audit, not hidden."""
    with device_reads(forbid=True), pytest.raises(DeviceReadError) as caught:
        run_loop(META, LoopConfig(num_steps=2), check=_check_both_sides)
    read = caught.value.read
    assert read.op == "aten._to_copy.default"
    assert read.location.startswith("batchstate/checks/invariants.py:")
    assert read.location.endswith(" in check_batch")
