"""What a `Shadow` reads from SGLang after a call: host mirrors, pool counters and the
radix tree's token keys. Nothing here writes to SGLang's objects or reads the device
(each `*_cpu` mirror is a host tensor), and nothing touches the tree's clock.
"""

from __future__ import annotations

from typing import Any

from batchstate.sglang._free_group import free_tokens
from batchstate.sglang.replica import Eviction, Replica, State


def mirror_rows(batch: Any, live: list[Any]) -> int:
    # Rows of the host mirror that belong to live requests (-1: no mirror at all).
    if not batch.reqs and not batch.forward_mode.is_idle():
        return len(live)  # SGLang's "nothing to run" sentinel: its tensors are not read
    mirror = batch.req_pool_indices_cpu
    if mirror is None:
        return -1
    if hasattr(batch, "batchstate_binding"):
        # A driven batch's mirror is its record's rows: a released request's row left
        # with its release, before SGLang filters the request out of `reqs`.
        holding = sum(1 for r in batch.reqs if r.kv.req_pool_idx is not None)
        return int(mirror.shape[0]) - (holding - len(live))
    # `shape[0]`, not `len`: a tensor's `len` goes through a Python-level wrapper.
    return int(mirror.shape[0]) - (len(batch.reqs) - len(live))


def mirror_order(batch: Any, live: list[Any], slots: list[int]) -> tuple[str, ...]:
    """For each of `live` (whose request rows are `slots`), in the batch's order: whose row
    `req_pool_indices_cpu` lists at its position (the rid, or `row N` when no live request
    holds row N). () when the mirror lists each live request's own row, and when it is
    missing or has another length (`mirror_rows` names that)."""
    mirror = batch.req_pool_indices_cpu
    position = _positions(batch)
    if not batch.reqs or mirror is None or mirror.shape[0] != len(position):
        return ()
    rows = mirror.tolist()
    # The common case, in one pass: every row where it belongs.
    if len(live) == len(rows) and rows == slots:
        return ()
    if all(rows[position[id(r)]] == r.kv.req_pool_idx for r in live):
        return ()
    owner = {r.kv.req_pool_idx: r.rid for r in live}
    listed = (int(rows[position[id(r)]]) for r in live)
    return tuple(owner.get(row, f"row {row}") for row in listed)


def _positions(batch: Any) -> dict[int, int]:
    # Each request's row in the batch's tensors: its place in `reqs`, or in a driven
    # batch (whose rows are its record's) its place among the requests holding a row.
    reqs = batch.reqs
    if hasattr(batch, "batchstate_binding"):
        reqs = [r for r in reqs if r.kv.req_pool_idx is not None]
    return {id(r): i for i, r in enumerate(reqs)}


def sglang_state(
    batch: Any, live: list[Any], extend: bool, chunks: list[Any], rids: tuple[str, ...]
) -> State:
    """What SGLang holds for `batch` (its `live` requests, whose rids are `rids`, and its
    `chunks`, requests between chunks) and its pools: host values only."""
    reqs = batch.reqs
    lens = batch.seq_lens_cpu.tolist() if reqs and batch.seq_lens_cpu is not None else []
    if len(live) == len(reqs) == len(lens):  # every row live: the mirror is the lengths
        seq_lens = tuple(lens)
    else:
        index = _positions(batch)
        seq_lens = tuple(int(lens[index[id(r)]]) if index[id(r)] < len(lens) else -1 for r in live)
    prefix = tuple(int(r.prefix_len) for r in live) if extend else (0,) * len(live)
    held = tuple(sorted((r.rid, int(r.extend_end)) for r in chunks))
    return pool_state(batch.tree_cache, rids, seq_lens, prefix, held)


def pool_state(
    tree: Any,
    rids: tuple[str, ...],
    seq_lens: tuple[int, ...],
    prefix: tuple[int, ...],
    held: tuple[tuple[str, int], ...],
) -> State:
    """`State` with SGLang's pool counters read from its tree cache."""
    return State(
        rids=rids,
        seq_lens=seq_lens,
        prefix_lens=prefix,
        held=held,
        free_slots=int(tree.req_to_token_pool.available_size()),
        free_tokens=free_tokens(tree.token_to_kv_pool_allocator),
        evictable_tokens=int(tree.evictable_size()),
        protected_tokens=int(tree.protected_size()),
    )


def evicted_by_sglang(replica: Replica, tree: Any) -> tuple[Eviction, ...]:
    # The unlocked cached leaves batchstate holds and SGLang's tree holds only part of,
    # down to that part, then the parents that became such leaves: what SGLang evicted.
    gone: list[Eviction] = []
    while True:
        found = []
        for leaf, start in replica.cached_leaves():
            held = held_tokens(tree, leaf)
            if held < len(leaf):
                found.append(Eviction(leaf, held if held > start else 0))
        if not found:
            return tuple(gone)
        replica.evict(found)
        gone += found


def held_tokens(tree: Any, tokens: tuple[int, ...]) -> int:
    """How many leading `tokens` SGLang's radix tree holds, in whole pages (read only: no
    split, no clock). A driven scheduler's tree is a view that answers it itself."""
    cached_length = getattr(tree, "cached_length", None)
    if cached_length is not None:
        held: int = cached_length(tokens)
        return held
    page, node, length = int(tree.page_size), tree.root_node, 0
    while length + page <= len(tokens):
        first = list(tokens[length : length + page])
        child = next(
            (c for c in node.children.values() if list(c.key.token_ids[:page]) == first), None
        )
        if child is None:
            return length
        key = list(child.key.token_ids)
        common = 0
        for mine, theirs in zip(tokens[length:], key, strict=False):
            if mine != theirs:
                break
            common += 1
        length += common // page * page
        if common < len(key):
            return length
        node = child
    return length
