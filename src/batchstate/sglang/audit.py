"""`audit(batch)`: a live SGLang `ScheduleBatch` checked against batchstate's invariants.

It reads the device (each mirror is compared with its device tensor, the
`req_to_token` rows and the allocator's free list are copied to the host), so it is
a debug tool, not a per-step production check: docs/sglang.md gives its measured
cost per step. It never writes to SGLang's objects.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from batchstate.sglang._fields import require_batch
from batchstate.sglang._free_group import free_tokens
from batchstate.sglang.hybrid import (
    components,
    full_allocator,
    full_counts,
    is_swa,
    mamba_free_slots,
    mamba_slot,
    swa_free_slots,
    window_peers,
)


@attrs.frozen
class Violation:
    """One broken invariant: which check, which field, the value it should hold and the
    value it holds, and the request it concerns ('' when batch- or pool-wide)."""

    check: str
    field: str
    expected: str
    actual: str
    request: str = ""

    def __str__(self) -> str:
        who = f" (request {self.request})" if self.request else ""
        return f"{self.check}: {self.field}{who} should be {self.expected}, is {self.actual}"


@attrs.frozen
class AuditReport:
    """Every violation `audit` found, in the order it checks them."""

    violations: tuple[Violation, ...]

    @property
    def ok(self) -> bool:
        """True when no invariant is broken."""
        return not self.violations

    def __str__(self) -> str:
        return "ok" if self.ok else "\n".join(map(str, self.violations))


def _host(values: torch.Tensor) -> list[int]:
    return [int(v) for v in values.detach().to("cpu").reshape(-1).tolist()]


def _mirrors(batch: Any, rows: int) -> Iterable[Violation]:
    # SGLang leaves seq_lens_cpu unset only inside a speculative draft window.
    may_be_none = {"req_pool_indices_cpu": False, "seq_lens_cpu": batch.spec_info is not None}
    for mirror, device in (
        ("req_pool_indices_cpu", "req_pool_indices"),
        ("seq_lens_cpu", "seq_lens"),
    ):
        host, dev = getattr(batch, mirror), getattr(batch, device)
        if host is None:
            if not may_be_none[mirror]:
                yield Violation("cpu mirror", mirror, f"{device} on the host", "None")
            continue
        for name, tensor in ((mirror, host), (device, dev)):
            if tensor is None or len(tensor) != rows:
                size = "None" if tensor is None else str(len(tensor))
                yield Violation("row count", name, f"{rows} rows (len(reqs))", f"{size} rows")
        if dev is not None and len(host) == len(dev) and _host(host) != _host(dev):
            yield Violation("cpu mirror", mirror, f"{device} = {_host(dev)}", str(_host(host)))


def _rows(batch: Any) -> Iterable[Violation]:
    seq_lens = None if batch.seq_lens_cpu is None else _host(batch.seq_lens_cpu)
    if (
        batch.seq_lens_sum is not None
        and seq_lens is not None
        and batch.seq_lens_sum != sum(seq_lens)
    ):
        yield Violation(
            "seq_lens_sum",
            "seq_lens_sum",
            f"sum(seq_lens_cpu) = {sum(seq_lens)}",
            str(batch.seq_lens_sum),
        )
    indices = None if batch.req_pool_indices_cpu is None else _host(batch.req_pool_indices_cpu)
    table = batch.req_to_token_pool.req_to_token
    # A unified cache's tree is not walked: its prefix rows are not checked.
    walk = not components(batch.tree_cache)
    for i, req in enumerate(batch.reqs):
        row = req.kv.req_pool_idx
        if row is None and req.finished():
            continue  # released by result processing; the next filter_batch drops it
        if indices is not None and i < len(indices) and indices[i] != row:
            yield Violation(
                "row order",
                f"req_pool_indices_cpu[{i}]",
                f"req.kv.req_pool_idx = {row}",
                str(indices[i]),
                req.rid,
            )
        if row is None:
            yield Violation("slot", "req.kv.req_pool_idx", "a req_to_token row", "None", req.rid)
            continue
        if row == 0:
            yield Violation(
                "slot 0", "req.kv.req_pool_idx", "a row other than the padding row 0", "0", req.rid
            )
        if not walk:
            continue
        prefix = _prefix_locations(req)
        held = _host(table[row, : len(prefix)])
        if held != prefix:
            yield Violation(
                "prefix row",
                f"req_to_token[{row}][:{len(prefix)}]",
                f"the tree path's KV {prefix}",
                str(held),
                req.rid,
            )


def _prefix_locations(req: Any) -> list[int]:
    """The KV locations on the tree path from the root to the request's matched node."""
    parts: list[list[int]] = []
    node = req.last_node
    while node is not None and node.value is not None and node.parent is not None:
        parts.append(_host(node.value))
        node = node.parent
    return [loc for part in reversed(parts) for loc in part]


def locked_tokens(live: Sequence[Any]) -> int:
    """Tokens on the tree paths the `live` requests (SGLang `Req`s) hold locked: each node
    from a request's matched node up to the root, counted once however many share it."""
    seen: set[int] = set()
    tokens = 0
    for req in live:
        node = req.last_node if req.kv.req_pool_idx is not None else None
        while node is not None and node.parent is not None and id(node) not in seen:
            seen.add(id(node))
            tokens += 0 if node.value is None else len(node.value)
            node = node.parent
    return tokens


def _free_mask(allocator: Any) -> torch.Tensor:
    """A host mask over KV token locations: True where the allocator would hand it out."""
    page = int(allocator.page_size)
    pieces = [allocator.free_pages, *getattr(allocator, "staged_pages", [])]
    release = getattr(allocator, "release_pages", None)
    if release is not None:
        pieces.append(release)
    pages = torch.cat([p.detach().to("cpu").reshape(-1) for p in pieces])
    tokens = (pages[:, None] * page + torch.arange(page)).reshape(-1)
    mask = torch.zeros(int(allocator.size) + 2 * page, dtype=torch.bool)
    mask[tokens] = True
    return mask


def _request_rows(pool: Any, live: Sequence[Any]) -> Iterable[Violation]:
    """Each row of `req_to_token_pool` is held by one live request or on the free list once."""
    free = Counter(int(r) for r in pool.free_slots)
    for row, times in sorted(free.items()):
        if times > 1:
            yield Violation(
                "row given back twice",
                "req_to_token_pool.free_slots",
                f"row {row} once",
                f"row {row} {times} times",
            )
    holders: dict[int, str] = {}
    for req in live:
        row = req.kv.req_pool_idx
        if row is None:
            continue
        if row in holders:
            yield Violation(
                "row shared",
                "req.kv.req_pool_idx",
                f"row {row} held by {holders[row]} alone",
                f"row {row} held by {holders[row]}, {req.rid}",
                f"{holders[row]}, {req.rid}",
            )
        holders.setdefault(row, req.rid)
        if row in free:
            yield Violation(
                "row freed while held",
                "req_to_token_pool.free_slots",
                f"row {row} held by {req.rid}",
                f"row {row} on the free list",
                req.rid,
            )


def _pool(batch: Any, live: Sequence[Any]) -> Iterable[Violation]:
    tree = batch.tree_cache
    unified = bool(components(tree))
    # Full KV: an SWA allocator's full sub-allocator, or the allocator itself.
    allocator = full_allocator(batch.token_to_kv_pool_allocator)
    table = batch.req_to_token_pool.req_to_token
    free = _free_mask(allocator)
    page = int(allocator.page_size)
    owned: dict[int, str] = {}
    uncached = 0
    yield from _request_rows(batch.req_to_token_pool, live)
    for req in live:
        if req.kv.req_pool_idx is None:
            continue
        start, end = req.kv.cache_protected_len, req.kv.kv_allocated_len
        # A paged allocator hands out whole pages; the tree keys whole pages only.
        uncached += -(-end // page) * page - start
        row = table[req.kv.req_pool_idx, :end].detach().to("cpu").long()
        locations = [int(v) for v in row.tolist()]
        if 0 in locations:
            yield Violation(
                "slot 0",
                f"req_to_token[{req.kv.req_pool_idx}]",
                "no padding slot 0",
                f"slot 0 at {locations.index(0)}",
                req.rid,
            )
        stale = sorted({int(v) for v in row[free[row]].tolist()})
        if stale:
            yield Violation(
                "freed while held",
                "token_to_kv_pool_allocator.free_pages",
                "none of the row's KV",
                f"holds {stale[:8]}",
                req.rid,
            )
        for loc in locations[start:]:
            if loc in owned and loc != 0:
                yield Violation(
                    "owned twice",
                    f"KV location {loc}",
                    f"owned by {owned[loc]} alone",
                    "owned by both",
                    req.rid,
                )
                break
            owned[loc] = req.rid
    if unified:
        yield from _unified_pool(tree, live, uncached)
        return
    locked = locked_tokens(live)
    if int(tree.protected_size()) != locked:
        yield Violation(
            "lock leaked",
            "tree_cache.protected_size()",
            f"{locked}, the live rows' tree paths",
            str(tree.protected_size()),
        )
    available, evictable, protected = (
        free_tokens(allocator),
        int(tree.evictable_size()),
        int(tree.protected_size()),
    )
    total = available + evictable + protected + uncached
    if total != int(allocator.size):
        yield Violation(
            "conservation",
            "available + evictable + protected + rows' own KV",
            f"allocator.size = {allocator.size}",
            f"{available} + {evictable} + {protected} + {uncached} = {total}",
        )


def _unified_pool(tree: Any, live: Sequence[Any], uncached: int) -> Iterable[Violation]:
    """A unified cache's pools, from its per-component counters (its tree is not walked:
    no lock check), and what each live request holds of the window and Mamba pools."""
    available, evictable, protected, size = full_counts(tree)
    total = available + evictable + protected + uncached
    if total != size:
        yield Violation(
            "conservation",
            "full available + full evictable + full protected + rows' own KV",
            f"full allocator size = {size}",
            f"{available} + {evictable} + {protected} + {uncached} = {total}",
        )
    allocator, pool = tree.token_to_kv_pool_allocator, tree.req_to_token_pool
    if is_swa(allocator):
        free = swa_free_slots(allocator)
        for req in live:
            stale = sorted(window_peers(req, pool.req_to_token, allocator) & free)
            if stale:
                yield Violation(
                    "window slot freed while held",
                    "swa_attn_allocator.free_pages",
                    "none of the row's window slots",
                    f"holds {stale[:8]}",
                    req.rid,
                )
    if hasattr(pool, "mamba_allocator"):
        free = mamba_free_slots(pool)
        holders: dict[int, str] = {}
        for req in live:
            slot = mamba_slot(req)
            if slot is None:
                continue
            if slot in free:
                yield Violation(
                    "mamba slot freed while held",
                    "mamba_allocator.free_slots",
                    f"slot {slot} held by {req.rid}",
                    f"slot {slot} on the free list",
                    req.rid,
                )
            if slot in holders:
                yield Violation(
                    "mamba slot shared",
                    "req.kv.mamba_pool_idx",
                    f"slot {slot} held by {holders[slot]} alone",
                    f"slot {slot} held by {holders[slot]}, {req.rid}",
                    f"{holders[slot]}, {req.rid}",
                )
            holders.setdefault(slot, req.rid)


def verify_window(batch: object) -> AuditReport:
    """Check that each row of a speculative decode batch holds KV for its next verify
    window; it holds from `prepare_for_decode` to the verify (`Watch` checks it there).

    SGLang's `prepare_for_decode` (`eagle_prepare_for_decode`) reserves KV ahead of each
    row's committed length, and the verify writes `speculative_num_draft_tokens`
    tokens from the row's length on into the row's `req_to_token` slots: a slot past
    the reserve is not the row's. Reads host values only; a batch that does not
    speculate passes.
    """
    require_batch(batch)
    return AuditReport(tuple(_verify_window(batch)))


def _verify_window(batch: Any) -> Iterable[Violation]:
    if batch.spec_algorithm.is_none() or not batch.reqs or batch.seq_lens_cpu is None:
        return
    from sglang.srt.runtime_context import max_speculative_num_draft_tokens

    draft = int(max_speculative_num_draft_tokens() or 0)
    for req, length in zip(batch.reqs, _host(batch.seq_lens_cpu), strict=False):
        end = length + draft
        if req.kv.req_pool_idx is not None and req.kv.kv_allocated_len < end:
            yield Violation(
                "verify window",
                "req.kv.kv_allocated_len",
                f">= {end}, seq_len {length} + {draft} draft tokens",
                str(req.kv.kv_allocated_len),
                req.rid,
            )


def audit(batch: object, *, also_live: Sequence[object] = ()) -> AuditReport:
    """Check `batch` (and its pools and prefix cache) against batchstate's invariants.

    `also_live` names requests outside `batch` that hold KV too (the running batch
    while a prefill batch is audited): pool conservation counts their rows. Over SGLang's
    hybrid stacks (a `UnifiedRadixCache`) the tree is not walked: full KV is read from
    the full sub-allocator and counters, window and Mamba slots per live request
    (`batchstate.sglang.hybrid`). Raises `UnsupportedSGLang` when a field it reads has
    moved; changes nothing.
    """
    require_batch(batch)
    live_batch: Any = batch
    violations: list[Violation] = []
    # An empty batch is SGLang's "is_empty()" sentinel: its tensors are never read,
    # unless it is an idle batch, which data-parallel attention runs through the forward.
    if live_batch.reqs or live_batch.forward_mode.is_idle():
        violations += _mirrors(live_batch, len(live_batch.reqs))
        violations += _rows(live_batch)
    live = list({id(r): r for r in (*live_batch.reqs, *also_live)}.values())
    violations += _pool(live_batch, live)
    return AuditReport(tuple(violations))
