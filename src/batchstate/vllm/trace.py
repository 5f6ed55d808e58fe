"""A vLLM shadow's trace: one JSON line per scheduler step, enough to replay it.

The first line names the block pool (`{"op": "pools", "engine": "vllm", ...}`);
each later line is a `Step`: what vLLM's scheduler did to its KV cache manager
during one call (`schedule`, `update_from_output`, `finish_requests`), as
`Allocation` and `Free` events in vLLM's order, and the `State` it held after.
`apply` replays a step on a `Replica`; `compare` names the first difference.
The live `Shadow` and `batchstate replay` use both, so a trace replays exactly
as it was checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from batchstate.errors import Error
from batchstate.vllm.replica import (
    Allocation,
    Event,
    Evict,
    Free,
    Replica,
    ReplicaError,
    Row,
    State,
)

INPUT_BATCH_OPS = ("input_batch CPU tensor", "input_batch device copy")
"""A model runner's `InputBatch` after it applied a schedule: its block table's CPU tensor,
then its device copy, each compared with batchstate's rows (its events are empty)."""


@attrs.frozen
class PoolsConfig:
    """How vLLM's block pool was made (`num_blocks` counts its null block 0)."""

    num_blocks: int
    block_size: int
    max_reqs: int
    context: int


@attrs.frozen
class Step:
    """One scheduler call: its number, its name, the KV cache manager's events during
    it in order, and vLLM's state after it."""

    step: int
    op: str
    events: tuple[Event, ...]
    state: State


@attrs.frozen
class Mismatch:
    """The first field where vLLM and batchstate differ after a step."""

    step: int
    op: str
    field: str
    vllm: str
    batchstate: str
    request: str = ""

    def __str__(self) -> str:
        who = f", request {self.request}" if self.request else ""
        return (
            f"step {self.step}, after {self.op}{who}: {self.field} is {self.vllm} in vLLM, "
            f"{self.batchstate} in batchstate"
        )


def make_replica(config: PoolsConfig) -> Replica:
    """A fresh replica made as `config` says."""
    return Replica(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        max_reqs=config.max_reqs,
        context=config.context,
    )


def apply(replica: Replica, step: Step) -> None:
    """Replay `step`'s events on `replica`, in vLLM's order."""
    for event in step.events:
        if isinstance(event, Allocation):
            replica.allocate(event)
        elif isinstance(event, Free):
            replica.free(event)
        else:
            replica.evict(event)


def check(
    replica: Replica, step: Step, scheduled: frozenset[str]
) -> tuple[Mismatch | None, frozenset[str]]:
    """Replay `step` on `replica` and compare: the first mismatch (a refusal is one), and
    the requests the last `schedule` step allocated for (`scheduled`, updated), which an
    `InputBatch` step's rows must be."""
    try:
        apply(replica, step)
    except Error as error:  # batchstate refused what vLLM did: that is the divergence
        rid = error.rid if isinstance(error, ReplicaError) else ""
        return Mismatch(step.step, step.op, "refused", "done", str(error), rid), scheduled
    if step.op == "schedule":
        scheduled = frozenset(e.rid for e in step.events if isinstance(e, Allocation))
    return compare(step, replica.state(), scheduled), scheduled


def compare(step: Step, mine: State, scheduled: frozenset[str] = frozenset()) -> Mismatch | None:
    """The first difference between vLLM's recorded state and batchstate's, or None.

    Per request holding blocks: tokens computed (vLLM's `num_computed_tokens`,
    advanced when a step is scheduled), its prefix hit, its block count, and that
    its blocks and batchstate's pages correspond one to one across all requests
    (vLLM's block ids and batchstate's page numbers are each allocator's policy:
    the correspondence is what is checked); then the blocks an allocation may take.
    An `InputBatch` step (`INPUT_BATCH_OPS`) holds the rows `scheduled`, each compared
    the same way (its computed tokens: the row's before the step plus those scheduled).
    """
    theirs = step.state
    ours = {row.rid: row for row in mine.rows}
    owners: dict[tuple[str, int], tuple[int, str]] = {}  # ("block"|"page", id) -> other, rid
    if step.op in INPUT_BATCH_OPS:
        rows = {row.rid for row in theirs.rows}
        if rows != scheduled:
            odd = sorted(rows ^ scheduled)[0]
            return _differ(step, "rows", sorted(rows), sorted(scheduled), odd)
        ours = {rid: ours[rid] for rid in rows if rid in ours}
    for row in theirs.rows:
        other = ours.pop(row.rid, None)
        found = (
            _differ(step, "holds KV", "yes", "no", row.rid)
            if other is None
            else _row(step, row, other, owners)
        )
        if found is not None:
            return found
    if ours:
        return _differ(step, "holds KV", "no", "yes", sorted(ours)[0])
    if step.op in INPUT_BATCH_OPS:
        return None
    if theirs.free_blocks != mine.free_blocks:
        return _differ(step, "free blocks", theirs.free_blocks, mine.free_blocks)
    return None


def _row(
    step: Step, row: Row, other: Row, owners: dict[tuple[str, int], tuple[int, str]]
) -> Mismatch | None:
    for name in ("computed", "hit"):
        if getattr(row, name) != getattr(other, name):
            return _differ(step, name, getattr(row, name), getattr(other, name), row.rid)
    if len(row.blocks) != len(other.blocks):
        return _differ(step, "blocks", len(row.blocks), len(other.blocks), row.rid)
    for block, page in zip(row.blocks, other.blocks, strict=True):
        page_seen, rid = owners.setdefault(("block", block), (page, row.rid))
        if page_seen != page:
            what = f"block {block} (request {rid}'s too)"
            return _differ(step, what, "one block", f"pages {page_seen} and {page}", row.rid)
        block_seen, rid = owners.setdefault(("page", page), (block, row.rid))
        if block_seen != block:
            what = f"page {page} (request {rid}'s too)"
            return _differ(step, what, f"blocks {block_seen} and {block}", "one page", row.rid)
    return None


def _differ(step: Step, field: str, vllm: object, ours: object, rid: str = "") -> Mismatch:
    return Mismatch(step.step, step.op, field, str(vllm), str(ours), rid)


def dumps(entry: PoolsConfig | Step) -> str:
    """One trace line."""
    if isinstance(entry, PoolsConfig):
        return json.dumps({"op": "pools", "engine": "vllm", **attrs.asdict(entry)}) + "\n"
    kinds = {Allocation: "allocate", Free: "free", Evict: "evict"}
    events = [{kinds[type(e)]: attrs.asdict(e)} for e in entry.events]
    raw = {"step": entry.step, "op": entry.op, "events": events, "state": attrs.asdict(entry.state)}
    return json.dumps(raw, separators=(",", ":")) + "\n"


class TraceError(Error, ValueError):
    """A trace line is not one this version writes: names the line and what is wrong."""


def is_vllm_trace(head: object) -> bool:
    """Whether a trace's parsed first line is a vLLM shadow's pools line."""
    return isinstance(head, dict) and head.get("op") == "pools" and head.get("engine") == "vllm"


def read(path: Path) -> tuple[PoolsConfig, Iterator[Step]]:
    """The pools line and the steps of a trace file."""
    lines = path.read_text().splitlines()
    if not lines:
        raise TraceError(f"{path}: empty trace")
    try:
        head = json.loads(lines[0])
        if not is_vllm_trace(head):
            raise KeyError("the first line must be a vLLM pools line")
        config = PoolsConfig(
            int(head["num_blocks"]),
            int(head["block_size"]),
            int(head["max_reqs"]),
            int(head["context"]),
        )
    except (ValueError, TypeError, KeyError) as error:
        raise TraceError(f"{path}:1: {error!r}") from None

    def steps() -> Iterator[Step]:
        for number, line in enumerate(lines[1:], start=2):
            try:
                yield _step(json.loads(line))
            except (ValueError, TypeError, KeyError) as error:
                raise TraceError(f"{path}:{number}: {error!r}") from None

    return config, steps()


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _event(raw: dict[str, Any]) -> Event:
    if "evict" in raw:
        return Evict(_ints(raw["evict"]["tokens"]))
    if "free" in raw:
        free = raw["free"]
        return Free(str(free["rid"]), _ints(free["cached"]))
    alloc = raw["allocate"]
    return Allocation(
        str(alloc["rid"]), _ints(alloc["tokens"]), int(alloc["computed"]), int(alloc["hit"])
    )


def _step(raw: dict[str, Any]) -> Step:
    state = raw["state"]
    rows = tuple(
        Row(str(r["rid"]), int(r["computed"]), _ints(r["blocks"]), int(r["hit"]))
        for r in state["rows"]
    )
    return Step(
        step=int(raw["step"]),
        op=str(raw["op"]),
        events=tuple(_event(e) for e in raw["events"]),
        state=State(rows, int(state["free_blocks"])),
    )
