"""Workloads: seeded requests with prompts, output budgets and arrival steps."""

from __future__ import annotations

import random
from typing import Final, Literal, assert_never, final

import attrs

__all__ = ["ARRIVALS", "END_TOKEN", "Arrival", "RequestSpec", "WorkloadConfig", "make_workload"]

# Generation stops after this token; prompts never contain it.
END_TOKEN: Final = 0

Arrival = Literal["all", "uniform", "poisson", "burst"]
ARRIVALS: Final[tuple[Arrival, ...]] = ("all", "uniform", "poisson", "burst")


@final
@attrs.frozen
class RequestSpec:
    """One request of a workload: it joins the waiting queue at engine step `arrival_step`."""

    rid: int
    arrival_step: int
    prompt: tuple[int, ...]
    max_new_tokens: int


@final
@attrs.frozen
class WorkloadConfig:
    """How to draw a workload; lengths are inclusive ranges.

    Arrivals, in engine steps: `all` at step 0; `uniform` one every
    `1 / arrival_rate` steps; `poisson` with exponential gaps of mean
    `1 / arrival_rate`; `burst` groups of `burst_size` every
    `burst_size / arrival_rate` steps.
    """

    num_requests: int = 256
    arrival: Arrival = "poisson"
    arrival_rate: float = 2.0  # requests per engine step
    burst_size: int = 32
    prompt_len: tuple[int, int] = (8, 48)
    output_len: tuple[int, int] = (4, 48)
    vocab_size: int = 96
    seed: int = 0

    def validate(self) -> None:
        """Raise `ValueError` with a one-line message for an impossible configuration."""
        if self.num_requests < 0:
            raise ValueError(f"--requests must be >= 0, got {self.num_requests}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"--arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival}")
        if not self.arrival_rate > 0:
            raise ValueError(f"--arrival-rate must be > 0, got {self.arrival_rate}")
        if self.burst_size < 1:
            raise ValueError(f"--burst-size must be >= 1, got {self.burst_size}")
        for name, (low, high) in (
            ("--prompt-len", self.prompt_len),
            ("--output-len", self.output_len),
        ):
            if not 1 <= low <= high:
                raise ValueError(f"{name} needs 1 <= MIN <= MAX, got {low} {high}")
        if self.vocab_size < 2:
            raise ValueError(f"the vocabulary needs >= 2 tokens, got {self.vocab_size}")


def make_workload(config: WorkloadConfig) -> tuple[RequestSpec, ...]:
    """The requests of `config`, the same for the same seed, in arrival order.

    >>> specs = make_workload(WorkloadConfig(num_requests=3, arrival="all"))
    >>> [spec.arrival_step for spec in specs], all(END_TOKEN not in s.prompt for s in specs)
    ([0, 0, 0], True)
    """
    config.validate()
    rng = random.Random(config.seed)
    specs = []
    clock = 0.0
    for rid in range(config.num_requests):
        prompt_len = rng.randint(*config.prompt_len)
        prompt = tuple(rng.randrange(1, config.vocab_size) for _ in range(prompt_len))
        specs.append(
            RequestSpec(rid, _arrival(config, rid, clock), prompt, rng.randint(*config.output_len))
        )
        if config.arrival == "poisson":
            clock += rng.expovariate(config.arrival_rate)
    return tuple(specs)


def _arrival(config: WorkloadConfig, index: int, clock: float) -> int:
    match config.arrival:
        case "all":
            return 0
        case "uniform":
            return int(index / config.arrival_rate)
        case "poisson":
            return int(clock)
        case "burst":
            return int((index // config.burst_size) * config.burst_size / config.arrival_rate)
        case _:
            assert_never(config.arrival)
