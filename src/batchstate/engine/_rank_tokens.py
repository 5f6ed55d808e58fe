"""A data-parallel rank's token source: exchange the step's shape, then run the shared forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from batchstate import (
    Decoding,
    Extended,
    Filtered,
    Idle,
    Mixed,
    Pools,
    Rows,
    Sampled,
    Sampling,
    Verified,
    Verifying,
)
from batchstate.engine._feeder import Feeder
from batchstate.engine._kv_cache import KVCache
from batchstate.engine._language_model import LanguageModel
from batchstate.engine._paged import forward_idle
from batchstate.engine._ranks import Fault, Phase, RankGroup, StepShape
from batchstate.engine._sources import ModelTokens
from batchstate.engine._verify import Acceptance, UnreadAcceptance

__all__ = ["RankStatus", "RankTokens"]


@final
@attrs.frozen
class RankStatus:
    """What the rank's engine held when its step began, sent with the step's shape."""

    busy: bool  # it had work: the step runs its rows, not just its empty record
    load: int  # requests it held
    finished: int  # requests it had finished


@final
class RankTokens:
    """`ModelTokens` on one rank: every forward first exchanges shapes, then shares the MLPs.

    The shape is built from the batch's host mirrors before anything runs on
    the device. A rank with no rows still exchanges its (empty) shape and runs
    the layers over no tokens, so it joins every collective of the step;
    when no rank brings a token, nobody runs the layers.
    """

    def __init__(  # the rank's model, cache and group, and what it may do
        self,
        model: LanguageModel,
        cache: KVCache,
        group: RankGroup,
        fault: Fault | None = None,
        feeder: Feeder | None = None,
    ) -> None:
        self.model, self.group, self.fault = model, group, fault
        self.steps = 0  # exchanges so far
        self.status = RankStatus(busy=False, load=0, finished=0)  # set before each step
        # With captured sizes, every rank pads each forward to the largest rank's bucket.
        self.feeder = Feeder() if feeder is None else feeder
        self.local = ModelTokens(model, cache, self._shared_mlp, feeder=self.feeder)

    def after_extend(self, batch: Extended[Sampling], pools: Pools) -> list[int]:
        """Exchange the extend's shape, then run it with the shared MLPs."""
        self._exchange(Phase.EXTEND, batch.rows, batch.extend_num_tokens)
        return self.local.after_extend(batch, pools)

    def after_decode(
        self, batch: Decoding[Sampling], pools: Pools, last_tokens: Sequence[int]
    ) -> list[int]:
        """Exchange the decode's shape (one token per row), then run it."""
        self._exchange(Phase.DECODE, batch.rows, len(batch.rows))
        return self.local.after_decode(batch, pools, last_tokens)

    def after_mixed(
        self, batch: Mixed[Sampling], pools: Pools, sampling: Sampling | None
    ) -> Sampled:
        """Exchange the mixed batch's shape, then run it; the tokens stay on the device."""
        self._exchange(Phase.MIXED, batch.rows, batch.num_tokens)
        return self.local.after_mixed(batch, pools, sampling)

    def read(self, sampled: Sampled) -> list[int]:
        """The step's one named read, as on one process."""
        return self.local.read(sampled)

    def after_idle(self, batch: Idle[Sampling] | Filtered[Sampling]) -> None:
        """Exchange an empty shape and, when any rank has tokens, join its shared layers."""
        self._exchange(Phase.IDLE, batch.rows, 0)
        self._join_empty(batch)

    def transfer(
        self, batch: Filtered[Sampling], pools: Pools, prompts: Sequence[Sequence[int]]
    ) -> list[int]:
        """Exchange the prebuilt batch's shape, take its KV from the prefill server, then join
        the shared layers with no tokens: the batch runs no forward of its own this step."""
        self._exchange(Phase.PREBUILT, batch.rows, 0)
        firsts = self.local.transfer(batch, pools, prompts)
        self._join_empty(batch)
        return firsts

    def draft(self, histories: Sequence[Sequence[int]], counts: Sequence[int]) -> list[list[int]]:
        """The draft model runs on this rank alone: nothing is shared, nothing exchanged."""
        return self.local.draft(histories, counts)

    def after_verify(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> Acceptance:
        """Exchange the window's shape (each row's decode token and drafts), then verify."""
        self._exchange_window(window, committed, tokens)
        return self.local.after_verify(window, pools, committed, tokens)

    def verify_unread(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> UnreadAcceptance:
        """Exchange the window's shape, then verify, the acceptance left on the device."""
        self._exchange_window(window, committed, tokens)
        return self.local.verify_unread(window, pools, committed, tokens)

    def _exchange_window(
        self,
        window: Verifying[Sampling],
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> None:
        # A verify window's shape: its rows, its tokens, and the KV its rows reserve.
        num_tokens = sum(len(row) for row in tokens)
        reserved = int(committed.sum() + window.draft_lens.sum())
        self._exchange_shape(Phase.VERIFY, len(window.reqs), num_tokens, reserved)

    def read_acceptance(self, unread: UnreadAcceptance) -> Verified:
        """This rank's own read: nothing is exchanged."""
        return self.local.read_acceptance(unread)

    def _exchange(self, phase: Phase, rows: Rows[Sampling], tokens: int) -> None:
        self._exchange_shape(phase, len(rows), tokens, rows.seq_lens_sum)

    def _exchange_shape(self, phase: Phase, num_rows: int, tokens: int, seq_lens_sum: int) -> None:
        status = self.status
        shape = StepShape(
            phase, num_rows, tokens, seq_lens_sum, status.busy, status.load, status.finished
        )
        self.group.exchange(shape)
        self.feeder.floor = self.group.pad_to(self.feeder.sizes)
        if self.fault is not None and self.fault.step == self.steps:
            self.fault.strike()
        self.steps += 1

    def _join_empty(self, batch: Idle[Sampling] | Filtered[Sampling]) -> None:
        # This rank brings no tokens (or, padding, a captured size of padding tokens); when
        # another rank brings some, join its shared layers.
        if any(self.group.tokens):
            forward_idle(self.model, batch, self._shared_mlp, self.group.padded_to)

    def _shared_mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.group.shared_mlp(self.model, layer, x)
