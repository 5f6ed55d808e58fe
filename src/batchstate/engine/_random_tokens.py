"""Tokens drawn from a seeded host RNG: the `meta` run's token source, with no model."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import final

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
    Sampled,
    Sampling,
    Verified,
    Verifying,
    transfer_targets,
)
from batchstate.engine._feeder import Feeder
from batchstate.engine._verify import Acceptance, UnreadAcceptance

__all__ = ["RandomTokens"]


@final
class RandomTokens:
    """Tokens drawn from a seeded host RNG: no model, no device work (the `meta` run)."""

    def __init__(self, vocab_size: int, seed: int, feeder: Feeder | None = None) -> None:
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        # With one, each forward's inputs are built (and padded) as a model's would be.
        self.feeder = feeder

    def after_extend(self, batch: Extended[Sampling], pools: Pools) -> list[int]:
        """One random token per row (sampling parameters play no part)."""
        self._inputs(batch, pools)
        return self._draw(len(batch.rows))

    def after_decode(
        self, batch: Decoding[Sampling], pools: Pools, last_tokens: Sequence[int]
    ) -> list[int]:
        """One random token per row."""
        self._inputs(batch, pools)
        return self._draw(len(batch.rows))

    def after_mixed(
        self, batch: Mixed[Sampling], pools: Pools, sampling: Sampling | None
    ) -> Sampled:
        """Placeholder device tokens (meta holds no data); `read` draws the real ones."""
        self._inputs(batch, pools)
        return Sampled.of(
            batch.rows, torch.empty(len(batch.rows), dtype=torch.int64, device=batch.device)
        )

    def read(self, sampled: Sampled) -> list[int]:
        """One random token per row, drawn on the host: nothing is read from the device."""
        return self._draw(len(sampled))

    def after_idle(self, batch: Idle[Sampling] | Filtered[Sampling]) -> None:
        """Nothing to draw."""

    def transfer(
        self, batch: Filtered[Sampling], pools: Pools, prompts: Sequence[Sequence[int]]
    ) -> list[int]:
        """One random first token per row: meta holds no KV to fill.

        The targets are named all the same (`transfer_targets`), as a real
        transfer names them: on meta, proof that naming them reads nothing.
        """
        transfer_targets(batch, pools)
        return self._draw(len(batch.rows))

    def draft(self, histories: Sequence[Sequence[int]], counts: Sequence[int]) -> list[list[int]]:
        """Random drafts: `counts[row]` tokens per row."""
        return [self._draw(count) for count in counts]

    def after_verify(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> Acceptance:
        """A random count of accepted drafts per row, and the target's tokens to match them."""
        return self.after_verify_tokens(tokens)

    def after_verify_tokens(self, tokens: Sequence[Sequence[int]]) -> Acceptance:
        """`after_verify`'s draw for windows holding `tokens` (a decode token, then drafts)."""
        accepted = np.array(
            [self.rng.randrange(len(row)) for row in tokens], dtype=np.int64
        )  # in [0, drafts]
        targets = [
            [*row[1 : 1 + count], *self._draw(len(row) - count)]
            for row, count in zip(tokens, accepted.tolist(), strict=True)
        ]
        return Acceptance(accepted, targets)

    def verify_unread(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> UnreadAcceptance:
        """Placeholder device counts and tokens (meta holds no data); the read draws them."""
        num_reqs, width = len(tokens), max((len(row) for row in tokens), default=1)
        device = window.device
        counts = torch.empty(num_reqs, dtype=torch.int64, device=device)
        targets = torch.empty((num_reqs, width), dtype=torch.int64, device=device)
        return UnreadAcceptance(counts, targets, [list(row) for row in tokens])

    def read_acceptance(self, unread: UnreadAcceptance) -> Verified:
        """Counts and tokens drawn on the host as `after_verify` draws them: nothing is read."""
        drawn = self.after_verify_tokens(unread.proposed)
        width = unread.targets.shape[1]
        targets = np.zeros((len(drawn.targets), width), dtype=np.int64)
        for row, outs in enumerate(drawn.targets):
            targets[row, : len(outs)] = outs
        counts = drawn.accepted.copy()
        counts.setflags(write=False)  # as read_verified's: read-only
        return Verified(counts, targets)

    def _inputs(
        self,
        batch: Extended[Sampling] | Decoding[Sampling] | Mixed[Sampling],
        pools: Pools,
    ) -> None:
        if self.feeder is not None:
            self.feeder.inputs(batch, pools)

    def _draw(self, num_rows: int) -> list[int]:
        randrange, vocab_size = self.rng.randrange, self.vocab_size
        return [randrange(vocab_size) for _ in range(num_rows)]
