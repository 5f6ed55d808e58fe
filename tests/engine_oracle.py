"""What the engine tests share: the tiny model, each workload's oracle, a pass-through source."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import attrs
import numpy as np
import numpy.typing as npt

from batchstate import (
    Decoding,
    Extended,
    Filtered,
    Idle,
    Mixed,
    Pools,
    Sampled,
    Sampling,
    Verified,
    Verifying,
)
from batchstate.engine import (
    END_TOKEN,
    Acceptance,
    ModelConfig,
    TinyModel,
    TokenSource,
    UnreadAcceptance,
    WorkloadConfig,
    generate_alone,
    make_model,
    make_workload,
)


@cache
def tiny_model() -> TinyModel:
    """The default tiny model, built once."""
    return make_model(ModelConfig())


@cache
def alone_outputs(workload: WorkloadConfig) -> dict[int, tuple[int, ...]]:
    """Each request of `workload` run alone. It depends on the workload and the model only,
    not on the pools: computed once per workload."""
    return {
        spec.rid: generate_alone(
            tiny_model(), spec.prompt, spec.max_new_tokens, END_TOKEN, spec.sampling
        )
        for spec in make_workload(workload)
    }


@attrs.define
class PassThrough:
    """A token source that hands every call to `inner`; a test overrides the call it changes."""

    inner: TokenSource

    def after_extend(self, batch: Extended[Sampling], pools: Pools) -> list[int]:
        return self.inner.after_extend(batch, pools)

    def after_decode(
        self, batch: Decoding[Sampling], pools: Pools, last_tokens: Sequence[int]
    ) -> list[int]:
        return self.inner.after_decode(batch, pools, last_tokens)

    def after_mixed(
        self, batch: Mixed[Sampling], pools: Pools, sampling: Sampling | None
    ) -> Sampled:
        return self.inner.after_mixed(batch, pools, sampling)

    def read(self, sampled: Sampled) -> list[int]:
        return self.inner.read(sampled)

    def transfer(
        self, batch: Filtered[Sampling], pools: Pools, prompts: Sequence[Sequence[int]]
    ) -> list[int]:
        return self.inner.transfer(batch, pools, prompts)

    def after_idle(self, batch: Idle[Sampling] | Filtered[Sampling]) -> None:
        self.inner.after_idle(batch)

    def draft(self, histories: Sequence[Sequence[int]], counts: Sequence[int]) -> list[list[int]]:
        return self.inner.draft(histories, counts)

    def after_verify(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> Acceptance:
        return self.inner.after_verify(window, pools, committed, tokens)

    def verify_unread(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> UnreadAcceptance:
        return self.inner.verify_unread(window, pools, committed, tokens)

    def read_acceptance(self, unread: UnreadAcceptance) -> Verified:
        return self.inner.read_acceptance(unread)
