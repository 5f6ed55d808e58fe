"""Window pages and state slots, read as a forward reads them, give exactly what a row alone gives.

A toy hybrid model with exact (integer-valued float64) arithmetic: each token's
"KV" is one number, `token * 131 + position`. A full-attention layer sums the KV
of every position up to the query's; a window layer sums the last `WINDOW`
positions' only, read from its own window cache through `hybrid_inputs`' window
pages; a recurrent layer folds `state = state / 2 + kv` in a state slot. Each
forward writes its new tokens' KV at `out_cache_loc` (both caches), then reads.
The oracle computes the same sums from each request's token list alone. A
window page given back too early, handed to another row while still read, or a
state slot shared or lost, makes a sum differ. The schedule mixes chunked
prefills with decode rows, plain decodes, finishing requests and new ones
taking the freed pages and states.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import torch
from returns.result import Success

from batchstate import (
    Chunked,
    Filtered,
    ForwardInputs,
    HybridInputs,
    Idle,
    MemoryKinds,
    Mixed,
    Pools,
    RecurrentState,
    Req,
    SlidingWindow,
    StateCopies,
    accepted_states,
    check_leaks,
    check_pools,
    decode,
    filter_batch,
    finish_mixed,
    forward_inputs,
    hybrid_inputs,
    idle,
    make_pools,
    mix,
    release,
    split,
    sync,
    unwrap,
    verify,
)

CPU = torch.device("cpu")


def _kv(tokens: np.ndarray, positions: np.ndarray) -> npt.NDArray[np.float64]:
    return np.asarray(tokens * 131 + positions, dtype=np.float64)


class _Forward:
    """The caches a toy hybrid model keeps, and one forward over them, checked row by row."""

    def __init__(self, kv_cache_size: int, window_tokens: int, num_states: int, window: int):
        self.full = torch.zeros(kv_cache_size, dtype=torch.float64)
        self.windowed = torch.zeros(window_tokens, dtype=torch.float64)
        self.states = torch.full((num_states + 1,), float("nan"), dtype=torch.float64)
        self.checkpoints = torch.full((4096,), float("nan"), dtype=torch.float64)
        self.window = window
        self.rows_checked = 0

    def run(  # one forward: its inputs, its tokens, how it keeps states
        self,
        inputs: ForwardInputs,
        hybrid: HybridInputs,
        ids: np.ndarray,
        alone: list[list[int]],
        checkpoint: bool = False,
    ) -> None:
        """Write the new tokens' KV, then check every query token against its row alone.

        A verify forward (`checkpoint`) leaves each row's state slot as it was and writes
        the state after each query token into `checkpoints`, at the token's place.
        """
        window, state = hybrid.windows[0], hybrid.states[0]
        page = inputs.page_size
        positions = inputs.positions.host
        kv = torch.from_numpy(_kv(ids, positions))
        checkpoints: dict[int, int] = {}  # forward token -> the anchor state slot it fills
        for copies in hybrid.cached:  # resumed rows copy the anchors' tails and states first
            source = _locs(copies.window_from.host, page)
            self.windowed[_locs(copies.window_to.host, page)] = self.windowed[source].clone()
            self.states[copies.state_to.device] = self.states[copies.state_from.device].clone()
            at, targets = copies.checkpoint_tokens.host, copies.checkpoint_states.host
            checkpoints = dict(zip(at.tolist(), targets.tolist(), strict=True))
        self.full[inputs.out_cache_loc.device] = kv
        self.windowed[window.out_cache_loc.device] = kv
        for copies in hybrid.cached:  # then published anchors take the rows' window tails
            source = _locs(copies.publish_from.host, page)
            self.windowed[_locs(copies.publish_to.host, page)] = self.windowed[source].clone()
        qo, kv_indptr = inputs.qo_indptr.host, inputs.kv_indptr.host
        pages = inputs.kv_indices.device.numpy()
        w_indptr, w_pages = window.kv_indptr.host, window.kv_indices.host
        for row, tokens in enumerate(alone):
            held = _kv(np.array(tokens), np.arange(len(tokens)))
            # Full attention: every position of the row, through the token table's pages.
            full_locs = _locs(pages[kv_indptr[row] : kv_indptr[row + 1]], page)
            full = self.full[full_locs[: int(inputs.seq_lens.host[row])]].numpy()
            # Window layers: the row's window pages, from its window start on.
            start = int(window.kv_starts.host[row])
            window_locs = _locs(w_pages[w_indptr[row] : w_indptr[row + 1]], page)
            seen = self.windowed[window_locs].numpy()
            prefix = int(inputs.prefix_lens.host[row])
            slot = int(state.state_indices.host[row])
            carried = 0.0 if prefix == 0 else float(self.states[slot])  # a new row starts at 0
            for token, position in enumerate(positions[qo[row] : qo[row + 1]].tolist()):
                assert full[: position + 1].sum() == held[: position + 1].sum()
                first = max(position - self.window + 1, 0)
                assert start <= first, f"row {row}: window start {start} past {first}"
                got = seen[first - start : position + 1 - start].sum()
                assert got == held[first : position + 1].sum(), f"row {row} at {position}"
                carried = carried / 2 + held[position]
                self.checkpoints[int(qo[row]) + token] = carried
                if int(qo[row]) + token in checkpoints:  # an anchor's state after this token
                    self.states[checkpoints[int(qo[row]) + token]] = carried
            expected = 0.0
            for value in held[: int(inputs.seq_lens.host[row])].tolist():
                expected = expected / 2 + value
            assert carried == expected
            if not checkpoint:
                self.states[slot] = carried
            self.rows_checked += 1

    def keep_accepted(self, copies: StateCopies) -> None:
        """After a verify forward: each row's state slot takes its accepted checkpoint."""
        self.states[copies.targets.device] = self.checkpoints[copies.sources.device]

    def state_of(self, slot: int) -> float:
        return float(self.states[slot])


def _mix_what_fits(
    running: Filtered | Idle, held: list[Chunked], waiting: list[Req], pools: Pools, last: list[int]
) -> tuple[Mixed, Pools]:
    # Fewer states than slots: admit fewer new requests until the step fits.
    for count in (2, 1):
        result = mix(running, [*held, *waiting[:count]], 24, pools, last)
        if isinstance(result, Success):
            mixed, after = unwrap(result)
            return mixed, after
    mixed, after = unwrap(mix(running, held, 24, pools, last))
    return mixed, after


def _prompts(rng: np.random.Generator, lengths: list[int], header_len: int) -> list[Req]:
    # Prompts of about `lengths` tokens; with a header length, each starts with one of
    # three shared headers, and each third one continues an earlier prompt of its
    # header (a conversation's next turn), a few tokens longer.
    headers = [rng.integers(0, 90, header_len).tolist() for _ in range(3)]
    prompts: list[list[int]] = []
    for rid, n in enumerate(lengths):
        turn = header_len and rid >= 3 and rid % 2 and len(prompts[rid - 3]) < 50
        base = prompts[rid - 3] if turn else headers[rid % 3]
        suffix = rng.integers(0, 90, int(rng.integers(2, 8)) if turn else max(n - len(base), 2))
        prompts.append(base + suffix.tolist())
    return [Req(rid, tuple(prompt)) for rid, prompt in enumerate(prompts)]


def _new_rows_past_zero(mixed: Mixed, waiting: list[Req]) -> int:
    # Rows of a mixed step admitted from `waiting` whose forward starts past position 0.
    new = {req.rid for req in waiting}
    pairs = zip(mixed.rows.reqs, mixed.prefix_lens.tolist(), strict=True)
    return sum(1 for req, prefix in pairs if prefix and req.rid in new)


def _check_cached(
    pools: Pools, cache: bool, prefix_hits: int, shared_reads: int, num_states: int
) -> None:
    # With the cache on, new rows resumed from anchors; at the end every window page and
    # state is free or held by an anchor.
    assert (prefix_hits > 5) == cache, prefix_hits
    assert (shared_reads > 50) == cache, shared_reads
    assert (pools.cache.num_pages > 0) == cache  # finished rows' whole pages stay cached
    anchors = pools.memory.cached
    assert (len(anchors.anchors) > 0) == cache
    windows, states = pools.memory.windows[0], pools.memory.states[0]
    assert len(windows.page_list) + anchors.num_window_pages == windows.num_pages
    assert states.num_free + anchors.num_states == num_states


def _locs(pages: np.ndarray, page: int) -> torch.Tensor:
    return torch.tensor((pages[:, None] * page + np.arange(page)).ravel(), dtype=torch.int64)


def _pools_and_model(
    page: int, window: int, num_states: int, *, cache: bool
) -> tuple[Pools, _Forward]:
    kinds = MemoryKinds(
        (SlidingWindow(window, 48 * page + 8 * window), RecurrentState(1, num_states))
    )
    pools = make_pools(8, 96, 8 * 96, CPU, page, prefix_cache=cache, memory=kinds)
    window_slots = (kinds.windows[0].num_tokens // page + 1) * page
    return pools, _Forward(pools.kv_cache_size, window_slots, num_states, window)


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize(("page", "window"), [(1, 5), (4, 6), (4, 13), (16, 20)])
def test_window_and_state_reads_match_each_request_alone(
    page: int, window: int, cache: bool
) -> None:
    # With the cache on, prompts share a few long prefixes: rows publish their pages and
    # an anchor (window tail and state) at their last page boundary, so later rows read
    # full-attention pages the cache holds and resume from anchors, copying their tails
    # and states: a tail read whole where it is not, or a wrong state, fails a sum.
    rng = np.random.default_rng(page * 100 + window)
    num_states = 12 if cache else 6  # with the cache, room for anchors' states too
    pools, model = _pools_and_model(page, window, num_states, cache=cache)
    tokens: dict[int, list[int]] = {}  # rid -> every token known (prompt and generated)
    budget: dict[int, int] = {}  # rid -> tokens still to generate
    waiting = _prompts(rng, rng.integers(3, 40, 24).tolist(), page + 5 if cache else 0)
    # Rows whose table points at pages the cache holds; new rows that read a cached
    # prefix instead of computing it; verify steps.
    shared_reads = prefix_hits = verified = 0
    for req in waiting:
        tokens[req.rid], budget[req.rid] = list(req.input_ids), int(rng.integers(3, 30))
    running: Filtered | Idle = idle(CPU)
    held: list[Chunked] = []
    for step in range(400):
        if not waiting and not held and not len(running.rows.reqs):
            break
        rows = running.rows
        last = [tokens[req.rid][-1] for req in rows.reqs]
        after: Filtered
        if (waiting or held) and step % 3 != 2:
            mixed, pools = _mix_what_fits(running, held, waiting, pools, last)
            taken = {req.rid for req in mixed.rows.reqs}
            prefix_hits += _new_rows_past_zero(mixed, waiting)
            waiting = [req for req in waiting if req.rid not in taken]
            ids = mixed.input_ids.device.numpy()
            inputs = forward_inputs(mixed, pools.table, pools.page_size)
            alone = [tokens[req.rid] for req in mixed.rows.reqs]
            model.run(inputs, hybrid_inputs(inputs, pools), ids, alone)
            after, chunks = finish_mixed(mixed)
            held = list(chunks)
        elif isinstance(running, Filtered) and len(rows.reqs) and step % 3 == 2 and step % 2:
            after, pools = _verify_and_sync(model, running, pools, tokens, rng)
            verified += 1
        elif isinstance(running, Filtered) and len(rows.reqs):
            decoding, pools = unwrap(decode(running, pools))
            inputs = forward_inputs(decoding, pools.table, pools.page_size)
            alone = [tokens[req.rid] for req in rows.reqs]
            model.run(inputs, hybrid_inputs(inputs, pools), np.array(last), alone)
            after = filter_batch(decoding, list(range(len(rows.reqs))))
        else:
            continue
        for req in after.rows.reqs:  # each running row samples its next token
            tokens[req.rid].append(int(rng.integers(0, 90)))
            budget[req.rid] -= 1
        keep = [i for i, req in enumerate(after.rows.reqs) if budget[req.rid] > 0]
        running, left = split(after, keep)
        pools = unwrap(release(left, running, pools))
        check_pools(pools, [running])
        check_leaks(pools, [running, *held])
        shared_reads += len(pools.prefixes)
    assert not waiting and not held and not len(running.rows.reqs), "the schedule did not finish"
    assert model.rows_checked > 200
    _check_cached(pools, cache, prefix_hits, shared_reads, num_states)
    assert verified >= 8


def _verify_and_sync(
    model: _Forward,
    running: Filtered,
    pools: Pools,
    tokens: dict[int, list[int]],
    rng: np.random.Generator,
) -> tuple[Filtered, Pools]:
    # Decode, then verify drafts: the window forward checkpoints states, the accepted ones
    # are copied into the slots, sync gives the rest of the window pages back.
    decoding, pools = unwrap(decode(running, pools))
    reqs = decoding.rows.reqs
    drafts = [rng.integers(0, 90, int(rng.integers(0, 4))).tolist() for _ in reqs]
    window, pools = unwrap(verify(decoding, [len(d) for d in drafts], pools))
    inputs = forward_inputs(window, pools.table, pools.page_size, slot_tokens=pools.slot_tokens)
    hybrid = hybrid_inputs(inputs, pools)
    ids = np.array(
        [t for req, d in zip(reqs, drafts, strict=True) for t in [tokens[req.rid][-1], *d]]
    )
    alone = [tokens[req.rid] + d for req, d in zip(reqs, drafts, strict=True)]
    model.run(inputs, hybrid, ids, alone, checkpoint=True)
    accepted = np.array([int(rng.integers(0, len(d) + 1)) for d in drafts], dtype=np.int64)
    model.keep_accepted(accepted_states(inputs, hybrid, torch.from_numpy(accepted.copy())))
    synced, pools = sync(window, accepted, pools)
    for req, d, count in zip(reqs, drafts, accepted.tolist(), strict=True):
        tokens[req.rid] += d[:count]
    slots = synced.rows.req_pool_indices.host.tolist()
    for slot, req in zip(slots, synced.rows.reqs, strict=True):  # the state at the last kept token
        expected = 0.0
        row = tokens[req.rid]
        for value in _kv(np.array(row), np.arange(len(row))).tolist():
            expected = expected / 2 + value
        assert model.state_of(int(pools.memory.states[0].of_slot[slot])) == expected
    return synced, pools
