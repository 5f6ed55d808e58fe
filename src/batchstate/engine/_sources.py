"""Where sampled tokens come from: the tiny model on a real device, or a seeded host RNG.

`RandomTokens`, the seeded RNG (`meta`), lives in `_random_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, final

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
    SamplingParams,
    Verified,
    Verifying,
    read_sampled,
    read_verified,
)
from batchstate.engine._alone import prefill_alone
from batchstate.engine._feeder import Feeder
from batchstate.engine._kv_cache import KVCache
from batchstate.engine._language_model import LanguageModel
from batchstate.engine._model import FeedForward
from batchstate.engine._paged import (
    forward_idle,
    sample_decode,
    sample_extend,
    sample_mixed,
)
from batchstate.engine._random_tokens import RandomTokens
from batchstate.engine._transfer import write_prefilled
from batchstate.engine._verify import (
    Acceptance,
    UnreadAcceptance,
    draft_model,
    propose,
    sample_verify,
    sample_verify_unread,
)

__all__ = ["ModelTokens", "RandomTokens", "TokenSource"]


class TokenSource(Protocol):
    """Runs a forward for a batch and returns each row's next token, on the host.

    Each row samples with its own parameters, the batch's `Sampling` columns
    (on the mixed path passed as `sampling`, None when every row is greedy).
    """

    def after_extend(self, batch: Extended[Sampling], pools: Pools) -> list[int]:
        """The token after each row's last input id, in row order."""
        ...

    def after_decode(
        self, batch: Decoding[Sampling], pools: Pools, last_tokens: Sequence[int]
    ) -> list[int]:
        """The token after each row's `last_tokens[row]`, in row order."""
        ...

    def after_mixed(
        self, batch: Mixed[Sampling], pools: Pools, sampling: Sampling | None
    ) -> Sampled:
        """Run a mixed forward; each row's next token stays on the device.

        `sampling`: the rows' parameters in row order; None samples every row greedily.
        """
        ...

    def read(self, sampled: Sampled) -> list[int]:
        """The host's copy of `sampled`: the one named read of a step."""
        ...

    def after_idle(self, batch: Idle[Sampling] | Filtered[Sampling]) -> None:
        """A step with no rows (`batch` has none): run the forward over no tokens."""
        ...

    def transfer(
        self, batch: Filtered[Sampling], pools: Pools, prompts: Sequence[Sequence[int]]
    ) -> list[int]:
        """Fill an `admit_prefilled` batch's KV from a prefill server; each row's first token.

        `prompts[row]`: the row's input ids, whose memory goes where
        `transfer_targets(batch, pools)` names. No forward runs on the batch.
        """
        ...

    def draft(self, histories: Sequence[Sequence[int]], counts: Sequence[int]) -> list[list[int]]:
        """Speculative decoding: `counts[row]` draft tokens after each row's whole history."""
        ...

    def after_verify(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> Acceptance:
        """Run the verify forward over each row's decode token and drafts (`tokens[row]`).

        `committed[row]`: the row's length before its drafts. Returns the drafts
        each row accepted and the target's token after each window position.
        """
        ...

    def verify_unread(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> UnreadAcceptance:
        """`after_verify` under overlap: the counts and tokens stay on the device, unread."""
        ...

    def read_acceptance(self, unread: UnreadAcceptance) -> Verified:
        """The host's copy of `unread` (`read_verified`): the one named read of a step."""
        ...


@final
class ModelTokens:
    """Tokens from the tiny model over the paged KV cache, each row sampled its own way.

    NOTE: `.tolist()` on the sampled tokens is the one device-to-host read
    per step: an engine streams tokens to users, so it must read them. It
    is outside the batch bookkeeping.
    """

    def __init__(
        self,
        model: LanguageModel,
        cache: KVCache,
        feed_forward: FeedForward | None = None,
        drafter: LanguageModel | None = None,
        feeder: Feeder | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.feed_forward = feed_forward  # runs each layer's MLP; None: the model's own
        # Speculative decoding's draft model: by default the target's first layer.
        self.drafter = draft_model(model) if drafter is None else drafter
        self.feeder = Feeder() if feeder is None else feeder  # each forward's inputs, padded

    def after_extend(self, batch: Extended[Sampling], pools: Pools) -> list[int]:
        """Run the extend forward (writes the cache) and read the sampled tokens."""
        tokens: list[int] = sample_extend(
            self.model, self.cache, batch, pools, feed_forward=self.feed_forward, feeder=self.feeder
        ).tolist()
        return tokens

    def after_decode(
        self, batch: Decoding[Sampling], pools: Pools, last_tokens: Sequence[int]
    ) -> list[int]:
        """Run the decode forward (writes the cache) and read the sampled tokens."""
        input_ids = torch.tensor(last_tokens, dtype=torch.int64).to(self.model.device)
        tokens: list[int] = sample_decode(
            self.model,
            self.cache,
            batch,
            pools,
            input_ids,
            feed_forward=self.feed_forward,
            feeder=self.feeder,
        ).tolist()
        return tokens

    def after_mixed(
        self, batch: Mixed[Sampling], pools: Pools, sampling: Sampling | None
    ) -> Sampled:
        """Run the mixed forward (writes the cache); the sampled tokens stay on the device."""
        tokens = sample_mixed(
            self.model,
            self.cache,
            batch,
            pools,
            sampling,
            feed_forward=self.feed_forward,
            feeder=self.feeder,
        )
        return Sampled.of(batch.rows, tokens)

    def read(self, sampled: Sampled) -> list[int]:
        """`read_sampled`: one permitted read, which waits for the forward."""
        tokens: list[int] = read_sampled(sampled).tolist()
        return tokens

    def after_idle(self, batch: Idle[Sampling] | Filtered[Sampling]) -> None:
        """Run the layers over no tokens: only `feed_forward`'s collectives do anything."""
        forward_idle(self.model, batch, self.feed_forward)

    def transfer(
        self, batch: Filtered[Sampling], pools: Pools, prompts: Sequence[Sequence[int]]
    ) -> list[int]:
        """Prefill each prompt alone (the prefill server), then copy its memory into the cache.

        Each row's first token is sampled with the row's own parameters at
        position `len(prompt)`, as the oracle samples it. The K/V (a window
        layer's tail only) and states land where `transfer_targets` names.
        """
        columns = batch.rows.columns
        prefilled = [
            prefill_alone(self.model, prompt, _params(columns, row))
            for row, prompt in enumerate(prompts)
        ]
        write_prefilled(self.model, self.cache, batch, pools, prefilled)
        return [row.token for row in prefilled]

    def draft(self, histories: Sequence[Sequence[int]], counts: Sequence[int]) -> list[list[int]]:
        """Greedy drafts from the draft model, each request alone over its history."""
        return [
            propose(self.drafter, history, count)
            for history, count in zip(histories, counts, strict=True)
        ]

    def after_verify(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> Acceptance:
        """Run the target over the windows (writes the cache); accept the matching drafts."""
        sampling = _window_sampling(window)
        return sample_verify(
            self.model, self.cache, window, pools, committed, tokens, sampling,
            feed_forward=self.feed_forward,
        )  # fmt: skip

    def verify_unread(
        self,
        window: Verifying[Sampling],
        pools: Pools,
        committed: npt.NDArray[np.int64],
        tokens: Sequence[Sequence[int]],
    ) -> UnreadAcceptance:
        """Run the target over the windows (writes the cache); count acceptance on the device."""
        sampling = _window_sampling(window)
        return sample_verify_unread(
            self.model, self.cache, window, pools, committed, tokens, sampling,
            feed_forward=self.feed_forward,
        )  # fmt: skip

    def read_acceptance(self, unread: UnreadAcceptance) -> Verified:
        """`read_verified`: one permitted read of the counts and tokens, which waits for them."""
        return read_verified(unread.counts, unread.targets)


def _window_sampling(window: Verifying[Sampling]) -> Sampling | None:
    # Every window token samples with its row's parameters; None: every row is greedy.
    columns = window.columns
    if not columns.temperature.host.any():
        return None
    spans = (window.draft_lens + 1).tolist()
    params = [_params(columns, row) for row, span in enumerate(spans) for _ in range(span)]
    return Sampling.of(params, window.device)


def _params(columns: Sampling, row: int) -> SamplingParams:
    # A row's parameters, from the host sides of its columns (the request's own, as admitted).
    return SamplingParams(
        temperature=float(columns.temperature.host[row]),
        top_p=float(columns.top_p.host[row]),
        top_k=int(columns.top_k.host[row]),
        min_p=float(columns.min_p.host[row]),
        seed=int(columns.seed.host[row]),
    )
