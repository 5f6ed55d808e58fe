"""What a seed fixes across devices: the workload always; the schedule only on one device."""

from __future__ import annotations

from typing import Final

from batchstate.engine import SimulationConfig, WorkloadConfig, make_workload, simulate

WORKLOAD: Final = WorkloadConfig(num_requests=40, seed=7)


def _schedule(device: str) -> tuple[dict[int, tuple[int, ...]], tuple[bool, ...]]:
    run = simulate(SimulationConfig(workload=WORKLOAD, num_kv_tokens=512, device=device))
    return run.outputs, tuple(run.trace.is_extend)


def test_a_seed_replays_the_same_schedule_on_the_same_device() -> None:
    """Two runs with one seed on one device: the same tokens and the same steps."""
    for device in ("meta", "cpu"):
        assert _schedule(device) == _schedule(device)


def test_meta_and_cpu_share_the_workload_but_not_the_tokens() -> None:
    """As docs/engine.md says: one workload, but meta's tokens come from a seeded RNG,
    the cpu's from the model, so requests stop at the end token at other steps."""
    assert make_workload(WORKLOAD) == make_workload(WORKLOAD)
    meta_outputs, meta_steps = _schedule("meta")
    cpu_outputs, cpu_steps = _schedule("cpu")
    assert meta_outputs.keys() == cpu_outputs.keys()
    assert meta_outputs != cpu_outputs
    assert meta_steps != cpu_steps
