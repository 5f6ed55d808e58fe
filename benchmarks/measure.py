"""Timing, allocation and op counts for the three implementations, interleaved."""

from __future__ import annotations

import functools
import gc
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Final, Literal, TypeVar

import attrs
import torch

from benchmarks.counting import Work, count_device_work
from benchmarks.impl_batchstate import BatchstateStep
from benchmarks.impl_floor import FloorStep
from benchmarks.impl_mutable import MutableStep
from benchmarks.scenario import PHASES, Config, Implementation, Join, Outcome, Plan, make_plan

__all__ = [
    "IMPLEMENTATIONS",
    "BaselineColumns",
    "Timings",
    "by_role",
    "count_blocks",
    "count_work",
    "final_outcomes",
    "implementations_carrying",
    "state_bytes",
    "time_config",
]

# (a), (b), (c), in report order.
IMPLEMENTATIONS: Final[tuple[Callable[[Plan], Implementation], ...]] = (
    BatchstateStep,
    MutableStep,
    FloorStep,
)

# implementation name -> phase name ("step" included) -> one duration per step, in ns.
Timings = dict[str, dict[str, list[int]]]

# The column set all three carry: none, or each request's sampling parameters
# (batchstate's `Sampling` columns, the baseline's `SamplingBatchInfo`, the floor's packed rows).
BaselineColumns = Literal["none", "sampling"]
_T = TypeVar("_T")


def implementations_carrying(
    columns: BaselineColumns = "none",
) -> tuple[Callable[[Plan], Implementation], ...]:
    """(a), (b), (c), each carrying `columns` with the same values."""
    if columns == "none":
        return IMPLEMENTATIONS
    return (
        functools.partial(BatchstateStep, columns="sampling"),
        functools.partial(MutableStep, sampling=True),
        functools.partial(FloorStep, sampling=True),
    )


def by_role(results: Mapping[str, _T]) -> dict[str, _T]:
    """Results keyed by role (batchstate, mutable, floor), a column set's suffix dropped."""
    return {name.partition("+")[0]: value for name, value in results.items()}


def run_step(impl: Implementation, join: Join) -> None:
    """One whole step, untimed."""
    impl.decode()
    impl.filter(join)
    impl.release()
    impl.extend(join)
    impl.merge()


def timed_step(impl: Implementation, join: Join, out: dict[str, list[int]]) -> None:
    """One whole step, appending each phase's duration and the step's to `out`."""
    clock = time.perf_counter_ns
    t0 = clock()
    impl.decode()
    t1 = clock()
    impl.filter(join)
    t2 = clock()
    impl.release()
    t3 = clock()
    impl.extend(join)
    t4 = clock()
    impl.merge()
    t5 = clock()
    for phase, start, end in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
        out[phase].append(end - start)
    out["step"].append(t5 - t0)


def time_config(
    config: Config,
    repeats: int,
    warmup: int,
    implementations: Sequence[Callable[[Plan], Implementation]] = IMPLEMENTATIONS,
    *,
    interleave: bool = True,
) -> Timings:
    """Time `repeats` steps of each implementation, interleaved step by step.

    Each step runs all three implementations, in an order that rotates, so
    that noise from other processes and cache effects fall on all alike.
    Without `interleave`, each implementation runs all its steps alone, one
    after another: each keeps the CPU's caches to itself, as a scheduler
    between forwards does not.
    """
    plan = make_plan(config, warmup + repeats)
    impls = [make(plan) for make in implementations]
    timings: Timings = {impl.name: {phase: [] for phase in (*PHASES, "step")} for impl in impls}
    for index, join in enumerate(plan.steps if interleave else ()):
        turn = index % len(impls)
        order = impls[turn:] + impls[:turn]
        for impl in order:
            if index < warmup:
                run_step(impl, join)
            else:
                timed_step(impl, join, timings[impl.name])
    for impl in () if interleave else impls:
        for index, join in enumerate(plan.steps):
            if index < warmup:
                run_step(impl, join)
            else:
                timed_step(impl, join, timings[impl.name])
    del impls
    gc.collect()
    return timings


def final_outcomes(
    config: Config, num_steps: int, columns: BaselineColumns = "none"
) -> list[Outcome]:
    """Each implementation's state after `num_steps` steps and one more decode."""
    plan = make_plan(config, num_steps)
    outcomes = []
    for make in implementations_carrying(columns):
        impl = make(plan)
        for join in plan.steps:
            run_step(impl, join)
        impl.decode()
        outcomes.append(impl.outcome())
    return outcomes


def count_work(
    config: Config,
    steps: int = 8,
    implementations: Sequence[Callable[[Plan], Implementation]] = IMPLEMENTATIONS,
) -> dict[str, dict[str, dict[str, float]]]:
    """Per implementation and phase ("step" included): work per step, counted on `meta`.

    Host torch ops, numpy calls, device kernels and host-to-device copies, as
    `benchmarks.counting` defines them. The device tensors live on the meta
    device, where ops reach the dispatcher and no data exists, so a read of
    the device would raise here too.
    """
    plan = make_plan(config, steps, device=torch.device("meta"))
    counts: dict[str, dict[str, dict[str, float]]] = {}
    for make in implementations:
        impl = make(plan)
        run_step(impl, plan.steps[0])
        totals = {phase: Work() for phase in PHASES}
        for join in plan.steps[1:]:
            for phase in PHASES:
                with count_device_work() as work:
                    _run_phase(impl, phase, join)
                totals[phase] = totals[phase] + work
        step = sum(totals.values(), Work())
        counts[impl.name] = {
            phase: {key: value / (steps - 1) for key, value in attrs.asdict(work).items()}
            for phase, work in (*totals.items(), ("step", step))
        }
    return counts


def _run_phase(impl: Implementation, phase: str, join: Join) -> None:
    if phase in ("filter", "extend"):
        getattr(impl, phase)(join)
    else:
        getattr(impl, phase)()


def count_blocks(
    config: Config, steps: int = 8, columns: BaselineColumns = "none"
) -> dict[str, float]:
    """Python heap blocks allocated per step, per implementation (a lower bound).

    `sys.getallocatedblocks` is sampled at every Python and C call boundary
    and the increases are summed: an allocation freed inside one C call is
    missed, everything else is counted. The hook's own churn is measured on
    an empty function and subtracted.
    """
    plan = make_plan(config, steps)
    counts = {}
    for make in implementations_carrying(columns):
        impl = make(plan)
        run_step(impl, plan.steps[0])

        def run(impl: Implementation = impl) -> None:
            for join in plan.steps[1:]:
                run_step(impl, join)

        counts[impl.name] = (_blocks_allocated(run) - _blocks_allocated(_noop)) / (steps - 1)
    return counts


def _noop() -> None:
    pass


def _blocks_allocated(function: Callable[[], None]) -> int:
    state = [sys.getallocatedblocks(), 0]

    def hook(frame: FrameType, event: str, arg: object) -> None:
        now = sys.getallocatedblocks()
        if now > state[0]:
            state[1] += now - state[0]
        state[0] = now

    gc.disable()
    sys.setprofile(hook)
    try:
        function()
    finally:
        sys.setprofile(None)
        gc.enable()
    return state[1]


def state_bytes(impl: Implementation) -> tuple[int, int]:
    """Bytes of per-row batch state (host, device): tensors plus the request list and objects.

    The request-to-token table and the KV free lists are sized by capacity,
    not by the batch, and are the same in all three: they are left out.
    """
    host = device = 0
    for tensor, on_device in impl.row_tensors():
        if on_device:
            device += tensor.nbytes
        else:
            host += tensor.nbytes
    reqs = impl.row_objects()
    host += sys.getsizeof(reqs) + sum(sys.getsizeof(req) for req in reqs)
    return host, device
