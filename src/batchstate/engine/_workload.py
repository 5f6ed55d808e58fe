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
    # A follow-up turn: the engine admits it after request `follows` finished, with
    # that request's prompt and answer in front of `prompt`.
    follows: int | None = None


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
    shared_prefixes: int = 0  # distinct prefixes (system prompts) requests may start with
    shared_prefix_len: int = 32
    shared_fraction: float = 0.0  # share of requests that start with one of them
    follow_ups: float = 0.0  # share of requests that continue an earlier conversation

    @property
    def longest_prompt(self) -> int:
        """The longest prompt a request can be admitted with (a follow-up's history included)."""
        first = self.prompt_len[1] + (self.shared_prefix_len if self.shared_prefixes else 0)
        if not self.follow_ups:
            return first
        return first + self.output_len[1] + self.prompt_len[1]

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
        if self.shared_prefixes < 0 or self.shared_prefix_len < 1:
            raise ValueError(
                f"--shared-prefix needs COUNT >= 0 and LEN >= 1, got {self.shared_prefixes}"
                f" {self.shared_prefix_len}"
            )
        for name, share in (("--shared-prefix FRACTION", self.shared_fraction),
                            ("--follow-ups", self.follow_ups)):  # fmt: skip
            if not 0 <= share <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {share}")
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
    # A separate stream for the sharing options: without them, the same requests as ever.
    sharing = random.Random(config.seed + 1)
    prefixes = [
        tuple(sharing.randrange(1, config.vocab_size) for _ in range(config.shared_prefix_len))
        for _ in range(config.shared_prefixes)
    ]
    specs: list[RequestSpec] = []
    clock = 0.0
    for rid in range(config.num_requests):
        prompt_len = rng.randint(*config.prompt_len)
        prompt = tuple(rng.randrange(1, config.vocab_size) for _ in range(prompt_len))
        follows = None
        if config.follow_ups and rid and sharing.random() < config.follow_ups:
            # Continue a recent first turn (conversations are two turns deep).
            earlier = [s.rid for s in specs[-8:] if s.follows is None]
            follows = sharing.choice(earlier) if earlier else None
        if follows is None and prefixes and sharing.random() < config.shared_fraction:
            prompt = sharing.choice(prefixes) + prompt
        specs.append(
            RequestSpec(
                rid, _arrival(config, rid, clock), prompt, rng.randint(*config.output_len), follows
            )
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
