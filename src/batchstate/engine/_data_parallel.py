"""One data-parallel rank's run: its own pools and records, stepping with every other rank.

Every rank draws the same workload and routes it with the same rule, then
steps in lockstep with the others: each step, a rank with work steps its
engine (whose token source exchanges the batch's shape and shares the
MLPs), and a rank without work runs its empty record through the same
exchange and layers. When the exchange shows no rank with work, the ranks
skip ahead to the next arrival, or stop when nothing is left to route.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import final

import attrs

from batchstate.engine._build_model import build_model
from batchstate.engine._dp_config import DataParallelConfig
from batchstate.engine._engine import Engine
from batchstate.engine._feeder import Feeder
from batchstate.engine._kv_cache import make_kv_cache
from batchstate.engine._language_model import LanguageModel
from batchstate.engine._oracle import OracleResult, check_oracle
from batchstate.engine._rank_tokens import RankStatus, RankTokens
from batchstate.engine._ranks import RankGroup, StepShape
from batchstate.engine._reads import read_counter
from batchstate.engine._router import Router
from batchstate.engine._simulate import SimulationConfig, describe_pools, pools_conserved, warm_up
from batchstate.engine._workload import END_TOKEN, RequestSpec, make_workload

__all__ = [
    "DataParallelConfig",
    "DataParallelRun",
    "RankRun",
    "run_rank",
]


@final
@attrs.frozen(eq=False)
class RankRun:
    """What one rank did: its requests' tokens and its own step counts and checks."""

    rank: int
    outputs: dict[int, tuple[int, ...]]
    prompts: dict[int, tuple[int, ...]]  # rid -> the prompt it ran with
    busy_steps: int  # steps this rank ran rows in
    idle_steps: int  # steps it joined with no rows while another rank had some
    retractions: int
    device_reads: int | None  # on audited steps' decode path; None: none audited
    audited_steps: int
    invariant_checks: int
    pools_conserved: bool
    pools: str
    bookkeeping_us_per_step: float
    padded_forwards: int = 0  # forwards padded to the step's captured size (--cuda-graph-sizes)
    padded_tokens: int = 0  # tokens (rows, for decode) padding added


@final
@attrs.frozen(eq=False)
class DataParallelRun:
    """The whole run, assembled on rank 0: every rank's part, the step log and the oracle."""

    config: SimulationConfig
    dp: DataParallelConfig
    specs: tuple[RequestSpec, ...]
    ranks: tuple[RankRun, ...]
    steps: int  # steps in which some rank had work
    waits: int  # exchanges in which no rank had work (waiting for arrivals, or the last)
    phase_mixes: dict[str, int]  # "decode+extend+idle" -> steps whose ranks did just those
    wall_s: float
    oracle: OracleResult | None
    oracle_s: float | None

    @property
    def outputs(self) -> dict[int, tuple[int, ...]]:
        """Every request's tokens, whichever rank ran it."""
        return {rid: tokens for rank in self.ranks for rid, tokens in rank.outputs.items()}


Progress = Callable[[str, int, int], None]
"""`(phase, done, total)`, as for `simulate`: heard on rank 0 only."""


def run_rank(
    group: RankGroup, config: SimulationConfig, dp: DataParallelConfig, progress: Progress
) -> DataParallelRun | None:
    """Run this rank's share of `config`'s workload in lockstep with the others.

    Every rank must call this with the same arguments. Rank 0 returns the
    assembled run (with the oracle, unless switched off); the others None.

    Raises:
        InjectedFault: this rank is `dp.fault`'s, in its step.
        PeerLost: another rank stopped.
        EngineError, InvariantViolation: this rank's run broke.
    """
    specs = make_workload(config.workload)
    device = group.device
    pools = config.make_pools(device)
    model = build_model(config.model, device)
    warm_up(device, model)
    fault = dp.fault if dp.fault is not None and dp.fault.rank == group.rank else None
    feeder = Feeder(config.cuda_graph_sizes)
    tokens = RankTokens(model, make_kv_cache(model, pools), group, fault, feeder)
    engine = Engine(config.engine_config, (), pools, tokens, read_counter())
    router = Router(specs, group.world)
    loads: tuple[int, ...] = (0,) * group.world
    log = _StepLog(group.rank)
    report = progress if group.rank == 0 else _quiet
    report("engine", 0, len(specs))
    start = perf_counter()
    while True:
        for rank, spec in router.route(engine.clock, loads):
            if rank == group.rank:
                engine.submit(spec)
        engine.arrive()
        tokens.status = RankStatus(engine.busy, engine.load, len(engine.outputs))
        if engine.busy:
            engine.step()
        else:
            engine.idle_step()
        shapes = group.shapes
        loads = tuple(shape.load for shape in shapes)
        log.record(shapes)
        report("engine", sum(shape.finished for shape in shapes), len(specs))
        if not any(shape.busy for shape in shapes):
            if router.done:
                break
            engine.clock = max(engine.clock, router.next_arrival)  # everyone waits: skip ahead
    wall_s = perf_counter() - start
    engine.check()
    mine = _rank_run(group.rank, engine, log, feeder)
    gathered = group.gather_results(mine)
    group.leave()  # the ranks' work is done; rank 0's oracle needs no collective
    if gathered is None:
        return None
    ranks = tuple(run for run in gathered if isinstance(run, RankRun))
    oracle, oracle_s = _oracle(config, specs, ranks, model, report)
    return DataParallelRun(
        config, dp, tuple(specs), ranks, log.steps, log.waits, dict(log.phase_mixes), wall_s,
        oracle, oracle_s,
    )  # fmt: skip


@final
class _StepLog:
    """Counts, from each step's exchanged shapes, what this rank and all ranks did."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.waits = self.busy = self.idle = 0
        self.phase_mixes: Counter[str] = Counter()

    @property
    def steps(self) -> int:
        """Steps in which some rank had work: this rank was busy or idle in each."""
        return self.busy + self.idle

    def record(self, shapes: tuple[StepShape, ...]) -> None:
        if not any(shape.busy for shape in shapes):
            self.waits += 1
            return
        if shapes[self.rank].busy:
            self.busy += 1
        else:
            self.idle += 1
        self.phase_mixes["+".join(sorted({shape.phase.name.lower() for shape in shapes}))] += 1


def _rank_run(rank: int, engine: Engine, log: _StepLog, feeder: Feeder) -> RankRun:
    trace, pools = engine.trace, engine.pools
    return RankRun(
        rank,
        dict(engine.outputs),
        dict(engine.prompts),
        log.busy,
        log.idle,
        trace.num_retractions,
        trace.device_reads if trace.num_audited else None,
        trace.num_audited,
        trace.num_checks,
        pools_conserved(pools),
        describe_pools(pools),
        trace.bookkeeping_us_per_step()[0],
        feeder.padded_forwards,
        feeder.padded_tokens,
    )


def _oracle(
    config: SimulationConfig,
    specs: Sequence[RequestSpec],
    ranks: tuple[RankRun, ...],
    model: LanguageModel,
    report: Progress,
) -> tuple[OracleResult | None, float | None]:
    if not config.oracle:
        return None, None
    prompts = {rid: prompt for rank in ranks for rid, prompt in rank.prompts.items()}
    outputs = {rid: tokens for rank in ranks for rid, tokens in rank.outputs.items()}
    requests = {
        spec.rid: (prompts.get(spec.rid, spec.prompt), spec.max_new_tokens) for spec in specs
    }
    report("oracle", 0, len(specs))
    start = perf_counter()
    result = check_oracle(
        model,
        requests,
        outputs,
        END_TOKEN,
        lambda done: report("oracle", done, len(specs)),
        sampling={spec.rid: spec.sampling for spec in specs},
    )
    return result, perf_counter() - start


def _quiet(phase: str, done: int, total: int) -> None:
    """The progress of a rank that reports none."""
