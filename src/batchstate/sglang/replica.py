"""batchstate's side of a shadow: SGLang's lifecycle calls replayed as batchstate transitions.

A `Replica` owns one `Pools` (prefix cache on) and one batchstate record per
SGLang batch it has seen. Each method is one SGLang call, in SGLang's words
(requests are named by SGLang's rid strings, batches by a label), applied with
batchstate's public transitions: `mix` + `finish_mixed` for `prepare_for_extend`
(chunked prefill included), `decode`, `filter_batch`, `merge`, `split` +
`release`. `state(label)` is what the replica holds, in the terms
`sglang_state` records SGLang's (see `compare`). It needs no SGLang: `replay`
runs it from a trace alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from returns.result import Failure

from batchstate import (
    Chunked,
    Decoding,
    Departed,
    Filtered,
    Idle,
    Mixed,
    Pools,
    Req,
    decode,
    filter_batch,
    finish_mixed,
    idle,
    make_pools,
    merge,
    mix,
    release,
    split,
)
from batchstate.errors import Error
from batchstate.pools.eviction import evict_leaves, unlocked_leaves

Record = Idle | Filtered | Decoding
"""What the replica holds for one SGLang batch between calls."""


@attrs.frozen
class ExtendItem:
    """One request of a `prepare_for_extend`: its tokens (prompt and any output before a
    retraction), the tokens SGLang computes for it in this forward, and the tokens it
    already holds (its cache hit, or a chunked request's earlier chunks)."""

    rid: str
    tokens: tuple[int, ...]
    extend_len: int
    prefix_len: int


@attrs.frozen
class Eviction:
    """A cached leaf (its tokens from the root) evicted down to its first `keep` tokens."""

    tokens: tuple[int, ...]
    keep: int


@attrs.frozen
class State:
    """What one side holds after a call: the batch's rows (rid, tokens in the KV cache,
    tokens read from the prefix cache at its extend) and the pools' counts, in tokens."""

    rids: tuple[str, ...]
    seq_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    held: tuple[tuple[str, int], ...]  # requests between chunks: rid, tokens in the KV cache
    free_slots: int
    free_tokens: int
    evictable_tokens: int
    protected_tokens: int


class ReplicaError(Error, RuntimeError):
    """batchstate refused a call SGLang made: names the operation and batchstate's reason."""


class Replica:
    """batchstate pools and records mirroring one SGLang scheduler (page size, KV tokens,
    request rows and context as SGLang's pools were made, on `device`)."""

    def __init__(
        self,
        *,
        page_size: int,
        kv_tokens: int,
        rows: int,
        context: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.page_size = page_size
        self.pools: Pools = make_pools(
            rows, context, kv_tokens, self.device, page_size, prefix_cache=True
        )
        self.records: dict[str, Record] = {}
        self.held: dict[str, Chunked] = {}  # chunked requests between chunks, by rid
        self.left: dict[str, Departed] = {}  # rows filtered out, not released yet, by rid
        self.prefix: dict[str, int] = {}  # each row's cache hit at its last extend
        self._ids: dict[str, int] = {}  # SGLang's rid -> batchstate's, and back
        self._names: list[str] = []
        self._names_of: dict[str, tuple[list[int], tuple[str, ...]]] = {}  # see `_row_names`
        # Requests extended whose pages SGLang has not published yet (its checkpoint comes
        # with result processing): pool counts differ by policy until it does.
        self.unpublished: set[str] = set()
        self.capped = 0  # new requests admitted while a prefill was in flight (see `_caps`)
        self._idle = idle(self.device)  # records are frozen: one empty batch serves every call

    @property
    def empty(self) -> Idle:
        """The one empty record (records are frozen: every empty batch shares it)."""
        return self._idle

    def record(self, label: str) -> Record:
        """The record of batch `label` (an empty one when unseen)."""
        return self.records.get(label, self._idle)

    def _id(self, rid: str) -> int:
        number = self._ids.get(rid)
        if number is None:
            number = self._ids[rid] = len(self._names)
            self._names.append(rid)
        return number

    def extend(self, label: str, items: Sequence[ExtendItem], *, exact_hits: bool = False) -> Mixed:
        """`prepare_for_extend`: a new batch of these requests; the last may stop part way.
        Returns the forward's record (every row, the chunked one included).

        `exact_hits`: each new request reads at most its `prefix_len` from the cache, as
        the engine matched it at admission (drive mode, whose admission matched against
        these very pools); by default only while a prefill is unpublished (a shadow's).
        """
        held = self.held
        admit: list[Req | Chunked] = [
            held.pop(i.rid) if i.rid in held else Req(self._id(i.rid), i.tokens) for i in items
        ]
        budget = sum(i.extend_len for i in items)
        if exact_hits:
            caps = {self._id(i.rid): i.prefix_len for i in items if i.rid not in self.held}
        else:
            caps = self._caps(items) if self.unpublished else {}
        step = mix(self._idle, admit, max(budget, 1), self.pools, read_at_most=caps)
        if isinstance(step, Failure):
            for item, request in zip(items, admit, strict=True):  # nothing changes on failure
                if isinstance(request, Chunked):
                    held[item.rid] = request
            raise ReplicaError(f"prepare_for_extend: batchstate refused: {step.failure()}")
        mixed, self.pools = step.unwrap()
        self.unpublished.update(i.rid for i in items)
        for item, cached, computed in zip(
            items, mixed.prefix_lens, mixed.extend_lens, strict=False
        ):
            del computed
            self.prefix[item.rid] = int(cached)
        running, chunks = finish_mixed(mixed)
        for chunk in chunks:
            held[self._rid(chunk.req.rid)] = chunk
        self.records[label] = running
        return mixed

    def _caps(self, items: Sequence[ExtendItem]) -> dict[int, int]:
        # A prefill in flight: batchstate published its pages at its extend, SGLang publishes
        # them when it checkpoints (a turn later under overlap), so a request admitted now
        # reads less from SGLang's cache (policy). Each new request reads what SGLang's did.
        caps = {self._id(i.rid): i.prefix_len for i in items if i.rid not in self.held}
        self.capped += sum(1 for i in items if i.rid not in self.held)
        return caps

    def checkpoint(self, rid: str) -> None:
        """`checkpoint_kv_cache`: SGLang published what `rid` computed, as batchstate did
        at its extend."""
        self.unpublished.discard(rid)

    def _rid(self, rid: int) -> str:
        return self._names[rid]

    def decode(self, label: str) -> None:
        """`prepare_for_decode`: one KV location per row."""
        record = self.record(label)
        if isinstance(record, Idle):
            return
        step = decode(record, self.pools)
        if isinstance(step, Failure):
            raise ReplicaError(f"prepare_for_decode: batchstate refused: {step.failure()}")
        self.records[label], self.pools = step.unwrap()

    def filter(self, label: str, kept: Sequence[str]) -> None:
        """`filter_batch`: keep the rows of these rids, in their order (rows already
        released are gone)."""
        record = self.record(label)
        if isinstance(record, Idle):
            return
        if tuple(kept) == self._row_names(label, record):
            return  # every row stays, in order: the record is already what a filter would give
        wanted = {self._ids.get(rid, -1) for rid in kept}
        for number in record.rows.rids.tolist():
            if number in wanted:
                continue
            # A row SGLang dropped before releasing it (overlap: a request whose last token
            # is still in flight): it keeps its memory until its release, as in SGLang.
            rows = record.rows.rids.tolist()
            record, self.left[self._rid(number)] = split(
                record, [i for i, other in enumerate(rows) if other != number]
            )
        record = filter_batch(record, list(range(len(record.rows.rids))))
        numbers = record.rows.rids.tolist()
        order = [numbers.index(self._ids[rid]) for rid in kept if self._ids.get(rid) in numbers]
        if order != sorted(order):
            # SGLang's retraction keeps its rows in the order it prefers to keep them: one
            # single-row filter per row, merged back in that order (no row changes owner).
            pieces = [filter_batch(record, [i]) for i in order]
            record = pieces[0]
            for piece in pieces[1:]:
                record = merge(record, piece)
        self.records[label] = record

    def merge(self, label: str, other: str) -> None:
        """`merge_batch`: `other`'s rows after `label`'s (`other`'s record is consumed)."""
        incoming = self.records.pop(other, self._idle)
        self._names_of.pop(other, None)
        if isinstance(incoming, Idle):
            return
        if isinstance(incoming, Decoding):
            incoming = filter_batch(incoming, list(range(len(incoming.rows.rids))))
        self.records[label] = merge(self.record(label), incoming)

    def release(self, rid: str, tokens: Sequence[int]) -> None:
        """`release_kv_cache`: the request's slot goes back; the whole pages of `tokens`
        stay cached (what SGLang keeps in its tree for it), the rest is freed."""
        self.unpublished.discard(rid)
        if rid in self.held:
            chunk = self.held.pop(rid)
            tokens = _covering(tokens, chunk.req)
            result = release(chunk, self._idle, self.pools, [tokens])
        elif rid in self.left:
            left = self.left.pop(rid)
            tokens = _covering(tokens, left.reqs[0])
            result = release(left, self._idle, self.pools, [tokens])
        else:
            label, record, row = self._find(rid)
            keep = [i for i in range(len(record.rows.rids)) if i != row]
            kept, left = split(record, keep)
            tokens = _covering(tokens, left.reqs[0])
            result = release(left, kept, self.pools, [tokens])
            self.records[label] = kept
        if isinstance(result, Failure):
            raise ReplicaError(f"release_kv_cache({rid}): batchstate refused: {result.failure()}")
        self.pools = result.unwrap()

    def tokens(self, rid: str) -> tuple[int, ...]:
        """The tokens batchstate holds request `rid` to compute (prompt, and any output
        before a retraction), whether it runs, waits between chunks or left a batch."""
        if rid in self.held:
            return tuple(self.held[rid].req.input_ids)
        if rid in self.left:
            return tuple(self.left[rid].reqs[0].input_ids)
        _, record, row = self._find(rid)
        return tuple(record.rows.reqs[row].input_ids)

    def _find(self, rid: str) -> tuple[str, Filtered | Decoding, int]:
        number = self._ids.get(rid)
        for label, record in self.records.items():
            if isinstance(record, Idle) or number is None:
                continue
            rids = record.rows.rids.tolist()
            if number in rids:
                return label, record, rids.index(number)
        raise ReplicaError(f"release_kv_cache({rid}): batchstate holds no row for it")

    def cached_leaves(self) -> list[tuple[tuple[int, ...], int]]:
        """The unlocked cached leaves (what eviction may take): each one's token prefix
        from the root and where its own tokens start."""
        return unlocked_leaves(self.pools)

    def evict(self, evictions: Sequence[Eviction]) -> None:
        """Evict these unlocked cached leaves, in order (one that is not a leaf by its turn
        is skipped), each down to the tokens SGLang keeps of it: what SGLang's eviction
        took, where it chose other leaves (its clock, its node boundaries) than batchstate's
        least-recently-used order would (policy, not bookkeeping)."""
        if evictions:
            self.pools = evict_leaves(self.pools, [(e.tokens, e.keep) for e in evictions])

    def state(self, label: str) -> State:
        """What batchstate holds for batch `label` and its pools."""
        record = self.record(label)
        numbers = () if isinstance(record, Idle) else tuple(record.rows.rids.tolist())
        rids = tuple(self._rid(n) for n in numbers)
        lens = () if isinstance(record, Idle) else tuple(record.rows.seq_lens.host.tolist())
        return attrs.evolve(
            self.pools_state(),
            rids=rids,
            seq_lens=lens,
            prefix_lens=tuple(self.prefix.get(rid, 0) for rid in rids),
        )

    def pools_state(self) -> State:
        """The pools' counts and the held chunks, with no rows (`state` without a batch)."""
        pools = self.pools
        return State(
            rids=(),
            seq_lens=(),
            prefix_lens=(),
            held=tuple((rid, chunk.cached) for rid, chunk in sorted(self.held.items())),
            free_slots=pools.num_free_slots,
            free_tokens=pools.num_free_tokens,
            evictable_tokens=pools.cache.num_evictable * pools.page_size,
            protected_tokens=pools.cache.num_locked * pools.page_size,
        )

    def num_rows(self, label: str) -> int:
        """How many rows batchstate holds for batch `label`."""
        record = self.record(label)
        return 0 if isinstance(record, Idle) else len(record.rows.rids)

    def seq_lens_sum(self, label: str) -> int:
        """The tokens in the KV cache over batch `label`'s rows."""
        record = self.record(label)
        return 0 if isinstance(record, Idle) else record.rows.seq_lens_sum

    def same_rows(self, label: str, rids: Sequence[str], seq_lens: Sequence[int]) -> bool:
        """Whether batch `label` holds exactly these requests, in this order, with these
        tokens in the KV cache: one list comparison each, the common case's whole check."""
        record = self.record(label)
        if isinstance(record, Idle):
            return not rids and not seq_lens
        if tuple(rids) != self._row_names(label, record):
            return False
        same: bool = record.rows.seq_lens.host.tolist() == list(seq_lens)
        return same

    def _row_names(self, label: str, record: Filtered | Decoding) -> tuple[str, ...]:
        # SGLang's rids of the record's rows, in order. Decode and a filter that keeps every
        # row leave the rids as they were: the names are looked up again only when they moved.
        numbers = record.rows.rids.tolist()
        known = self._names_of.get(label)
        if known is not None and known[0] == numbers:
            return known[1]
        names = self._names
        row_names = tuple([names[n] for n in numbers])
        self._names_of[label] = (numbers, row_names)
        return row_names


def _covering(tokens: Sequence[int], req: Req) -> Sequence[int]:
    # SGLang keeps in its tree what the row published at its extend, at least: batchstate
    # published its prompt's whole pages there already, and `release` wants them named.
    return tokens if len(tokens) >= len(req.input_ids) else req.input_ids
