"""Where sampled tokens come from: the tiny model on a real device, or a seeded host RNG."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, final

import torch

from batchstate import (
    CachedPools,
    Decoding,
    Extended,
    Filtered,
    Idle,
    Mixed,
    Pools,
    Sampled,
    Sampling,
    SamplingParams,
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

__all__ = ["ModelTokens", "RandomTokens", "TokenSource"]


class TokenSource(Protocol):
    """Runs a forward for a batch and returns each row's next token, on the host.

    Each row samples with its own parameters, the batch's `Sampling` columns
    (on the mixed path passed as `sampling`, None when every row is greedy).
    """

    def after_extend(self, batch: Extended[Sampling], pools: Pools | CachedPools) -> list[int]:
        """The token after each row's last input id, in row order."""
        ...

    def after_decode(
        self, batch: Decoding[Sampling], pools: Pools | CachedPools, last_tokens: Sequence[int]
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
        feeder: Feeder | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.feed_forward = feed_forward  # runs each layer's MLP; None: the model's own
        self.feeder = Feeder() if feeder is None else feeder  # each forward's inputs, padded

    def after_extend(self, batch: Extended[Sampling], pools: Pools | CachedPools) -> list[int]:
        """Run the extend forward (writes the cache) and read the sampled tokens."""
        tokens: list[int] = sample_extend(
            self.model, self.cache, batch, pools, feed_forward=self.feed_forward, feeder=self.feeder
        ).tolist()
        return tokens

    def after_decode(
        self, batch: Decoding[Sampling], pools: Pools | CachedPools, last_tokens: Sequence[int]
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


@final
class RandomTokens:
    """Tokens drawn from a seeded host RNG: no model, no device work (the `meta` run)."""

    def __init__(self, vocab_size: int, seed: int, feeder: Feeder | None = None) -> None:
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        # With one, each forward's inputs are built (and padded) as a model's would be.
        self.feeder = feeder

    def after_extend(self, batch: Extended[Sampling], pools: Pools | CachedPools) -> list[int]:
        """One random token per row (sampling parameters play no part)."""
        self._inputs(batch, pools)
        return self._draw(len(batch.rows))

    def after_decode(
        self, batch: Decoding[Sampling], pools: Pools | CachedPools, last_tokens: Sequence[int]
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

    def _inputs(
        self,
        batch: Extended[Sampling] | Decoding[Sampling] | Mixed[Sampling],
        pools: Pools | CachedPools,
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
