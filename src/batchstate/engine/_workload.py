"""Workloads: seeded requests with prompts, output budgets and arrival steps."""

from __future__ import annotations

import math
import random
from typing import Final, Literal, assert_never, final

import attrs

from batchstate.columns.sampling_params import GREEDY, SamplingParams

__all__ = [
    "ARRIVALS",
    "END_TOKEN",
    "SAMPLING_MIXES",
    "Arrival",
    "RequestSpec",
    "SamplingMix",
    "WorkloadConfig",
    "check_sampling",
    "make_workload",
]

# Generation stops after this token; prompts never contain it.
END_TOKEN: Final = 0

Arrival = Literal["all", "uniform", "poisson", "burst"]
ARRIVALS: Final[tuple[Arrival, ...]] = ("all", "uniform", "poisson", "burst")

SamplingMix = Literal["greedy", "mixed", "fixed"]
SAMPLING_MIXES: Final[tuple[SamplingMix, ...]] = ("greedy", "mixed", "fixed")
# The `mixed` draw: a quarter of the requests greedy, the rest from these (each its own pick).
_TEMPERATURES: Final = (0.6, 0.8, 1.0, 1.2)
_TOP_KS: Final = (0, 0, 8, 32)
_TOP_PS: Final = (1.0, 1.0, 0.9, 0.7)
_MIN_PS: Final = (0.0, 0.0, 0.05, 0.1)
_FIXED: Final = SamplingParams(temperature=1.0)  # `fixed` without other settings: plain sampling


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
    sampling: SamplingParams = GREEDY  # how the request samples, with its own seed
    # Prefilled elsewhere (disaggregated prefill): it arrives with its prompt's KV and
    # first token, and the engine only decodes it.
    prebuilt: bool = False


@final
@attrs.frozen
class WorkloadConfig:
    """How to draw a workload; lengths are inclusive ranges.

    Arrivals, in engine steps: `all` at step 0; `uniform` one every
    `1 / arrival_rate` steps; `poisson` with exponential gaps of mean
    `1 / arrival_rate`; `burst` groups of `burst_size` every
    `burst_size / arrival_rate` steps.

    Sampling: `greedy` for every request; `mixed` draws each request's
    parameters (a quarter greedy, the rest a temperature with or without
    top-k, top-p and min-p); `fixed` gives every request `fixed_sampling`.
    Each sampled request gets its own seed.

    `prebuilt`: the share of first turns (not follow-ups) that a prefill
    server already ran: they arrive with their prompt's KV and first token.
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
    prebuilt: float = 0.0  # share of first turns that arrive prefilled elsewhere
    sampling: SamplingMix = "greedy"
    fixed_sampling: SamplingParams = _FIXED  # for sampling="fixed" (its seed is ignored)

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
                            ("--follow-ups", self.follow_ups),
                            ("--prebuilt", self.prebuilt)):  # fmt: skip
            if not 0 <= share <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {share}")
        if self.sampling not in SAMPLING_MIXES:
            raise ValueError(
                f"--sampling must be one of {', '.join(SAMPLING_MIXES)}, got {self.sampling}"
            )
        check_sampling(self.fixed_sampling)
        if self.vocab_size < 2:
            raise ValueError(f"the vocabulary needs >= 2 tokens, got {self.vocab_size}")


def check_sampling(params: SamplingParams) -> None:
    """Raise `ValueError`, naming the option, for parameters no sampler can use.

    >>> check_sampling(SamplingParams(temperature=-1.0))
    Traceback (most recent call last):
    ...
    ValueError: --temperature must be a number >= 0, got -1.0
    """
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise ValueError(f"--temperature must be a number >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 keeps every token), got {params.top_k}")
    if not 0 <= params.min_p <= 1:
        raise ValueError(f"--min-p must be in [0, 1], got {params.min_p}")


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
    sampling = random.Random(config.seed + 2)  # likewise for sampling parameters and seeds
    prefilled = random.Random(config.seed + 3)  # and for which requests arrive prefilled
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
                rid,
                _arrival(config, rid, clock),
                prompt,
                rng.randint(*config.output_len),
                follows,
                _sampling(config, sampling),
                follows is None and bool(config.prebuilt) and prefilled.random() < config.prebuilt,
            )
        )
        if config.arrival == "poisson":
            clock += rng.expovariate(config.arrival_rate)
    return tuple(specs)


def _sampling(config: WorkloadConfig, rng: random.Random) -> SamplingParams:
    seed = rng.randrange(1 << 31)
    match config.sampling:
        case "greedy":
            return GREEDY  # as before sampling existed: the seed plays no part
        case "fixed":
            return attrs.evolve(config.fixed_sampling, seed=seed)
        case "mixed":
            if rng.random() < 0.25:
                return attrs.evolve(GREEDY, seed=seed)
            return SamplingParams(
                temperature=rng.choice(_TEMPERATURES),
                top_p=rng.choice(_TOP_PS),
                top_k=rng.choice(_TOP_KS),
                min_p=rng.choice(_MIN_PS),
                seed=seed,
            )
        case _:
            assert_never(config.sampling)


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
