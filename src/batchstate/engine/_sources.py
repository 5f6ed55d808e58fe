"""Where sampled tokens come from: the tiny model on a real device, or a seeded host RNG."""

from __future__ import annotations

import random
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
    Verifying,
    read_sampled,
)
from batchstate.engine._alone import prefill_alone
from batchstate.engine._feeder import Feeder
from batchstate.engine._model import FeedForward, TinyModel
from batchstate.engine._paged import (
    KVCache,
    forward_idle,
    sample_decode,
    sample_extend,
    sample_mixed,
    write_prefilled,
)
from batchstate.engine._verify import Verified, draft_model, propose, sample_verify

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
        """Fill a `prebuilt` batch's KV from a prefill server; each row's first token.

        `prompts[row]`: the row's input ids, whose K/V go to
        `pools.table.device[slot, :seq_len]`. No forward runs on the batch.
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
    ) -> Verified:
        """Run the verify forward over each row's decode token and drafts (`tokens[row]`).

        `committed[row]`: the row's length before its drafts. Returns the drafts
        each row accepted and the target's token after each window position.
        """
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
        model: TinyModel,
        cache: KVCache,
        feed_forward: FeedForward | None = None,
        drafter: TinyModel | None = None,
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
        """Prefill each prompt alone (the prefill server), then copy its K/V into the cache.

        Each row's first token is sampled with the row's own parameters at
        position `len(prompt)`, as the oracle samples it. The K/V land at the
        rows' table locations, gathered on the device.
        """
        columns = batch.rows.columns
        firsts: list[int] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for row, prompt in enumerate(prompts):
            token, k, v = prefill_alone(self.model, prompt, _params(columns, row))
            firsts.append(token)
            keys.append(k)
            values.append(v)
        write_prefilled(self.cache, batch, pools, torch.cat(keys, 1), torch.cat(values, 1))
        return firsts

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
    ) -> Verified:
        """Run the target over the windows (writes the cache); accept the matching drafts."""
        columns = window.columns
        sampling = None
        if columns.temperature.host.any():
            # Every window token samples with its row's parameters.
            spans = (window.draft_lens + 1).tolist()
            params = [_params(columns, row) for row, span in enumerate(spans) for _ in range(span)]
            sampling = Sampling.of(params, window.device)
        return sample_verify(
            self.model,
            self.cache,
            window,
            pools,
            committed,
            tokens,
            sampling,
            feed_forward=self.feed_forward,
        )


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
        """One random first token per row: meta holds no KV to fill."""
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
    ) -> Verified:
        """A random count of accepted drafts per row, and the target's tokens to match them."""
        accepted = np.array(
            [self.rng.randrange(len(row)) for row in tokens], dtype=np.int64
        )  # in [0, drafts]
        targets = [
            [*row[1 : 1 + count], *self._draw(len(row) - count)]
            for row, count in zip(tokens, accepted.tolist(), strict=True)
        ]
        return Verified(accepted, targets)

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


def _params(columns: Sampling, row: int) -> SamplingParams:
    # A row's parameters, from the host sides of its columns (the request's own, as admitted).
    return SamplingParams(
        temperature=float(columns.temperature.host[row]),
        top_p=float(columns.top_p.host[row]),
        top_k=int(columns.top_k.host[row]),
        min_p=float(columns.min_p.host[row]),
        seed=int(columns.seed.host[row]),
    )
