"""One simulated run: workload, pools, token source, engine, oracle, all wired from a config."""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import final

import attrs
import torch

from batchstate import CachedPools, Pools, cached_pools, make_pools
from batchstate.engine._engine import Engine, EngineConfig
from batchstate.engine._model import ModelConfig, TinyModel, make_model
from batchstate.engine._oracle import OracleResult, check_oracle
from batchstate.engine._paged import make_kv_cache
from batchstate.engine._reads import read_counter
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

DEVICES = ("cpu", "meta", "cuda")


@final
@attrs.frozen
class SimulationConfig:
    """Everything a run needs. `None` sizes follow the workload (see `validate`)."""

    workload: WorkloadConfig = attrs.field(factory=WorkloadConfig)
    engine: EngineConfig = attrs.field(factory=EngineConfig)
    model: ModelConfig = attrs.field(factory=ModelConfig)
    max_reqs: int | None = None  # request slots; default: engine.max_running
    num_kv_tokens: int = 2048
    page_size: int = 16
    max_context_len: int | None = None  # default: longest prompt + longest output
    device: str = "cpu"
    oracle: bool = True  # ignored on meta, which runs no model
    prefix_cache: bool = True  # share KV of common prefixes, when the workload has any

    @property
    def uses_prefix_cache(self) -> bool:
        """The cache runs when the workload shares prefixes (and it is not switched off).

        The cached path admits whole prompts with `extend_cached` and decodes
        with `decode_cached`: prompt chunks and mixed steps are not modelled
        over a prefix cache, so such a run ignores `--chunk-size` and runs no mixed steps.
        """
        workload = self.workload
        return self.prefix_cache and bool(workload.shared_prefixes or workload.follow_ups)

    @property
    def engine_config(self) -> EngineConfig:
        """The engine's settings for this run (whole prompts when the cache runs)."""
        if self.uses_prefix_cache:
            return attrs.evolve(self.engine, chunk_size=0, mixed=False)
        return self.engine

    @property
    def num_slots(self) -> int:
        return self.engine.max_running if self.max_reqs is None else self.max_reqs

    @property
    def context_len(self) -> int:
        longest = self.workload.longest_prompt + self.workload.output_len[1]
        return longest if self.max_context_len is None else self.max_context_len

    def make_pools(self, device: torch.device) -> Pools | CachedPools:
        """Empty pools of this run's sizes on `device` (with a prefix cache when it runs)."""
        plain = make_pools(
            self.num_slots, self.context_len, self.num_kv_tokens, device, self.page_size
        )
        return cached_pools(plain) if self.uses_prefix_cache else plain

    def validate(self) -> None:
        """Raise `ValueError` with a one-line message for a run that cannot work.

        >>> SimulationConfig(num_kv_tokens=64).validate()
        Traceback (most recent call last):
        ...
        ValueError: the KV pool is too small for one request: ...
        """
        self.workload.validate()
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}: choose one of {', '.join(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda: no CUDA device is available here")
        engine = self.engine
        for name, value in (
            ("--max-running", engine.max_running),
            ("--max-reqs", self.num_slots),
            ("--page-size", self.page_size),
            ("--max-prefill-tokens", engine.max_prefill_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_slots < engine.max_running:
            raise ValueError(
                f"--max-reqs {self.num_slots} is below --max-running {engine.max_running}:"
                " every running request holds a request slot"
            )
        if engine.new_token_ratio < 0:
            raise ValueError(f"--new-token-ratio must be >= 0, got {engine.new_token_ratio}")
        for name, value in (
            ("--headroom-pages", engine.headroom_pages),
            ("--check-every", engine.check_every),
            ("--audit-every", engine.audit_every),
            ("--chunk-size", engine.chunk_size),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        _check_modes(engine, cached=self.uses_prefix_cache, prebuilt=bool(self.workload.prebuilt))
        if self.num_kv_tokens < 0 or self.num_kv_tokens % self.page_size:
            raise ValueError(
                f"--kv-tokens must be a non-negative multiple of --page-size={self.page_size},"
                f" got {self.num_kv_tokens}"
            )
        # A request needs its whole prompt and output in KV at once (whole pages).
        longest = self.workload.longest_prompt + self.workload.output_len[1]
        pages = -(-longest // self.page_size)
        if pages * self.page_size > self.num_kv_tokens:
            raise ValueError(
                f"the KV pool is too small for one request: the longest needs {longest} tokens"
                f" ({pages} pages of {self.page_size}), --kv-tokens is {self.num_kv_tokens}"
            )
        if longest > self.context_len:
            raise ValueError(
                f"--max-context-len {self.context_len} is shorter than the longest request"
                f" ({longest} tokens)"
            )
        if self.workload.vocab_size != self.model.vocab_size:
            raise ValueError("the workload and the model must share a vocabulary size")


@final
@attrs.frozen(eq=False)
class Simulation:
    """What a run produced: outputs, the step trace, final pools and the oracle's verdict."""

    config: SimulationConfig
    specs: tuple[RequestSpec, ...]
    outputs: dict[int, tuple[int, ...]]
    trace: Trace
    wall_s: float
    pools: Pools | CachedPools  # after the run: everything free again (or cached)
    prompts: dict[int, tuple[int, ...]]  # rid -> the prompt it ran with (follow-ups' history)
    oracle: OracleResult | None  # None: not run (meta, or switched off)
    oracle_s: float | None  # None: the oracle did not run
    reads_measured: bool  # False when no step was audited

    @property
    def pools_conserved(self) -> bool:
        return pools_conserved(self.pools)


def pools_conserved(pools: Pools | CachedPools) -> bool:
    """Every slot free and every KV token free (or cached, so evictable): nothing leaked."""
    free = pools.num_available_tokens if isinstance(pools, CachedPools) else pools.num_free_tokens
    return pools.num_free_slots == pools.max_reqs and free == pools.num_pages * pools.page_size


def describe_pools(pools: Pools | CachedPools) -> str:
    """What is free in `pools`, in one line (cached tokens counted apart)."""
    line = (
        f"{pools.num_free_slots}/{pools.max_reqs} slots,"
        f" {pools.num_free_tokens}/{pools.num_pages * pools.page_size} KV tokens free"
    )
    if isinstance(pools, CachedPools):
        line += f" + {pools.cache.num_tokens} cached (evictable)"
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
    if device.type == "meta":
        source = RandomTokens(config.workload.vocab_size, config.workload.seed)
    else:
        model = make_model(config.model, device)
        source = ModelTokens(model, make_kv_cache(model, pools))
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
    )


def _check_modes(engine: EngineConfig, *, cached: bool, prebuilt: bool) -> None:
    # Overlap feeds every running row the device's token: every forward must hold them all.
    if engine.overlap and not engine.mixed:
        raise ValueError(
            "--overlap does not run with --no-mixed: the decode rows ride in every forward"
        )
    if engine.overlap and cached:
        raise ValueError(
            "--overlap needs mixed steps, which do not run over a prefix cache:"
            " add --no-prefix-cache"
        )
    # `prebuilt` allocates from plain pools, and its rows have no device token to follow.
    if prebuilt and engine.overlap:
        raise ValueError("--prebuilt does not run with --overlap: leave one of them out")
    if prebuilt and cached:
        raise ValueError(
            "--prebuilt admits into plain pools, not a prefix cache: add --no-prefix-cache"
        )


def _quiet(phase: str, done: int, total: int) -> None:
    """The progress of a caller that asked for none."""


def warm_up(device: torch.device, model: TinyModel | None) -> None:
    """Pay for a device's first-use costs before a timed run, on throwaway pools."""
    # The first ops on a device load lazy machinery (on meta, torch's fake
    # tensors and sympy: about a second; on cpu, the model's first forward):
    # pay for it outside the timed run, on throwaway pools.
    specs = make_workload(
        WorkloadConfig(num_requests=2, arrival="all", prompt_len=(2, 2), output_len=(3, 3))
    )
    pools = make_pools(2, 8, 16, device)
    source: TokenSource = RandomTokens(96, 0)
    if model is not None:
        source = ModelTokens(model, make_kv_cache(model, pools))
    Engine(EngineConfig(audit_every=0), specs, pools, source).run()
