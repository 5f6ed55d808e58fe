"""The engine's scheduling knobs, and the error it raises when a transition fails against them."""

from __future__ import annotations

from typing import final

import attrs

from batchstate.errors import Error

__all__ = ["EngineConfig", "EngineError"]


class EngineError(Error, RuntimeError):
    """The engine cannot go on: a transition failed in a way its policy rules out (a bug)."""


@final
@attrs.frozen
class EngineConfig:
    """Scheduling knobs; the pools' sizes live in the `Pools` handed to the engine."""

    max_running: int = 32
    max_prefill_tokens: int = 1024
    new_token_ratio: float = 0.3  # share of remaining output reserved at admission
    headroom_pages: int = 1  # pages reserved per request at admission
    check_every: int = 0  # check_batch/check_pools every N steps; 0 = only at the end
    audit_every: int = 16  # count device reads on every Nth step's decode path
    chunk_size: int = 0  # prompt tokens per step, cut into chunks; 0: whole prompts
    mixed: bool = False  # admissions run in the same forward as the decode rows
    overlap: bool = False  # sampled tokens stay on the device; finish checks one step late
    speculative: int = 0  # draft tokens verified per decode step; 0: no speculation

    @property
    def uses_mix(self) -> bool:
        """Whether admissions go through `mix` (chunks, mixed steps or overlap)."""
        return bool(self.chunk_size) or self.mixed or self.overlap
