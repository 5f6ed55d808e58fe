"""One simulated run: workload, pools, token source, engine, oracle, all wired from a config."""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import final

import attrs
import torch

from batchstate import Pools, make_pools
from batchstate.engine._build_model import build_model
from batchstate.engine._config import EngineConfig
from batchstate.engine._engine import Engine
from batchstate.engine._feeder import Feeder
from batchstate.engine._kv_cache import make_kv_cache
from batchstate.engine._language_model import LanguageModel
from batchstate.engine._oracle import OracleResult, check_oracle
from batchstate.engine._reads import read_counter
from batchstate.engine._simulation_config import DEVICES, SimulationConfig
from batchstate.engine._sources import ModelTokens, RandomTokens, TokenSource
from batchstate.engine._trace import Trace
from batchstate.engine._workload import END_TOKEN, RequestSpec, WorkloadConfig, make_workload

__all__ = [
    "DEVICES",
    "ProgressCallback",
    "Simulation",
    "SimulationConfig",
    "describe_pools",
    "pools_conserved",
    "simulate",
    "warm_up",
]


@final
@attrs.frozen(eq=False)
class Simulation:
    """What a run produced: outputs, the step trace, final pools and the oracle's verdict."""

    config: SimulationConfig
    specs: tuple[RequestSpec, ...]
    outputs: dict[int, tuple[int, ...]]
    trace: Trace
    wall_s: float
    pools: Pools  # after the run: everything free again (or cached)
    prompts: dict[int, tuple[int, ...]]  # rid -> the prompt it ran with (follow-ups' history)
    oracle: OracleResult | None  # None: not run (meta, or switched off)
    oracle_s: float | None  # None: the oracle did not run
    reads_measured: bool  # False when no step was audited
    feeder: Feeder | None = None  # each forward's inputs and padding, counted; None: not built

    @property
    def pools_conserved(self) -> bool:
        return pools_conserved(self.pools)


def pools_conserved(pools: Pools) -> bool:
    """Every slot, KV token, window token and state free or cached (evictable): no leak."""
    free = pools.num_available_tokens
    hybrid = pools.memory
    pages, states = hybrid.cached.evictable()  # the prefix cache's anchors, none locked
    return (
        pools.num_free_slots == pools.max_reqs
        and free == pools.num_pages * pools.page_size
        and all(len(w.page_list) + pages == w.num_pages for w in hybrid.windows)
        and all(state.num_free + states == state.kind.num_states for state in hybrid.states)
    )


def describe_pools(pools: Pools) -> str:
    """What is free in `pools`, in one line (cached tokens counted apart)."""
    line = (
        f"{pools.num_free_slots}/{pools.max_reqs} slots,"
        f" {pools.num_free_tokens}/{pools.num_pages * pools.page_size} KV tokens free"
    )
    if pools.cache.enabled:
        line += f" + {pools.cache.num_tokens} cached (evictable)"
    cached = pools.memory.cached  # the prefix cache's anchors: window tails and states
    for window in pools.memory.windows:  # a hybrid model's other memory kinds
        line += f", {window.num_free_tokens}/{window.num_pages * window.page_size} window tokens"
        if cached.anchors:
            line += f" + {cached.num_window_pages * window.page_size} cached"
    for state in pools.memory.states:
        line += f", {state.num_free}/{state.kind.num_states} states"
        if cached.anchors:
            line += f" + {cached.num_states} cached"
    return line


ProgressCallback = Callable[[str, int, int], None]
"""`(phase, done, total)`: requests done so far in phase `"engine"`, then `"oracle"`."""


def simulate(config: SimulationConfig, progress: ProgressCallback | None = None) -> Simulation:
    """Run `config`'s workload to the end, then (on a model device) check the oracle.

    `progress`, if given, hears `done=0` right before each phase's work and
    then after each engine step or oracle request.

    Raises:
        ValueError: `config` is impossible (see `SimulationConfig.validate`).
        EngineError, InvariantViolation: the run broke; the message says where.
    """
    config.validate()
    device = torch.device(config.device)
    specs = make_workload(config.workload)
    pools = config.make_pools(device)
    source: TokenSource
    model = None
    feeder = Feeder(config.cuda_graph_sizes)
    if device.type == "meta":
        # Without padding, meta builds no forward inputs: it runs no model to feed.
        fed = feeder if config.cuda_graph_sizes else None
        source = RandomTokens(config.workload.vocab_size, config.workload.seed, fed)
    else:
        model = build_model(config.model, device)
        source = ModelTokens(model, make_kv_cache(model, pools), feeder=feeder)
    warm_up(device, model)
    counter = read_counter()
    engine = Engine(config.engine_config, specs, pools, source, counter)
    total = len(specs)
    report = progress or _quiet
    report("engine", 0, total)
    start = perf_counter()
    engine.run(lambda done: report("engine", done, total))
    wall_s = perf_counter() - start
    oracle, oracle_s = None, None
    if model is not None and config.oracle:
        requests = {spec.rid: (engine.prompts[spec.rid], spec.max_new_tokens) for spec in specs}
        report("oracle", 0, total)
        oracle_start = perf_counter()
        oracle = check_oracle(
            model,
            requests,
            engine.outputs,
            END_TOKEN,
            lambda done: report("oracle", done, total),
            sampling={spec.rid: spec.sampling for spec in specs},
        )
        oracle_s = perf_counter() - oracle_start
    return Simulation(
        config,
        specs,
        engine.outputs,
        engine.trace,
        wall_s,
        engine.pools,
        engine.prompts,
        oracle,
        oracle_s,
        engine.trace.num_audited > 0,
        feeder if feeder.forwards else None,
    )


def _quiet(phase: str, done: int, total: int) -> None:
    """The progress of a caller that asked for none."""


def warm_up(device: torch.device, model: LanguageModel | None) -> None:
    """Pay for a device's first-use costs before a timed run, on throwaway pools."""
    # The first ops on a device load lazy machinery (on meta, torch's fake
    # tensors and sympy: about a second; on cpu, the model's first forward):
    # pay for it outside the timed run, on throwaway pools.
    specs = make_workload(
        WorkloadConfig(num_requests=2, arrival="all", prompt_len=(2, 2), output_len=(3, 3))
    )
    pools = make_pools(2, 8, 16, device)
    if model is not None and model.config.is_hybrid:  # pools that hold its layers' memory
        context = max(8, model.config.window)
        pools = SimulationConfig(
            model=model.config, max_reqs=2, num_kv_tokens=-(-context // 16) * 16,
            max_context_len=context, prefix_cache=False,
        ).make_pools(device)  # fmt: skip
    source: TokenSource = RandomTokens(96, 0)
    if model is not None:
        source = ModelTokens(model, make_kv_cache(model, pools))
    Engine(EngineConfig(audit_every=0), specs, pools, source).run()
