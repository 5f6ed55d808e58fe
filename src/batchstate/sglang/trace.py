"""A shadow's trace: one JSON line per SGLang call, enough to replay it through batchstate.

The first line names the pools (`{"op": "pools", ...}`); each later line is an
`Operation`: the call, the batch it concerns, what batchstate needs to replay
it (rids, token ids, tokens computed) and the SGLang `State` recorded after it.
`apply` replays one operation on a `Replica`; `check` (and `compare`, which it
falls back to) names the first field where the recorded state and batchstate's
differ. Both the live `Shadow` and `batchstate replay` use them, so a trace
replays exactly as it was checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from batchstate.errors import Error
from batchstate.sglang.replica import Eviction, ExtendItem, Replica, State

ROW_OPS = (
    "prepare_for_extend",
    "prepare_for_decode",
    "filter_batch",
    "merge_batch",
    "retract_decode",
    "mix_with_running",
    "prepare_for_idle",
)
"""The `ScheduleBatch` calls after which rows are compared."""


@attrs.frozen
class PoolsConfig:
    """How SGLang's pools were made: the replica's pools are made the same."""

    page_size: int
    kv_tokens: int
    rows: int
    context: int


@attrs.frozen
class Operation:
    """One SGLang call and the state it left.

    `batch` / `other` label the batches (`other`: `merge_batch`'s argument);
    `items` the requests of an extend; `kept` the rids a filter or retraction
    kept; `rid` and `tokens` a released request and the tokens whose whole pages
    SGLang's tree keeps for it; `seq_lens_sum` SGLang's, when set; `mirror_order`, for
    each live row in the batch's order, whose row `req_pool_indices_cpu` lists there,
    recorded only when some row is not its own (`_sglang_reads.mirror_order`). `full`:
    the rows were recorded and are compared request by request; when False (a sampled
    shadow between its full checks) `state` holds no rows and only their counts (and the
    mirror's order, against `kept`) are compared.
    """

    step: int
    op: str
    batch: str
    state: State
    other: str = ""
    items: tuple[ExtendItem, ...] = ()
    kept: tuple[str, ...] = ()
    rid: str = ""
    tokens: tuple[int, ...] = ()
    mirror_rows: int = 0
    seq_lens_sum: int | None = None
    evicted: tuple[Eviction, ...] = ()
    mirror_order: tuple[str, ...] = ()
    full: bool = True


@attrs.frozen
class Mismatch:
    """The first field where SGLang and batchstate differ after an operation.

    `since`: the first step after the last check that saw the pool counts and this
    batch's rows request by request equal (`Checked`), so the difference arose in
    steps `since` to `step`; -1 when not known. With every call fully checked it is
    `step`, or earlier where the pool counts waited for a checkpoint (see `compare`)
    or another call (a release) came between.
    """

    step: int
    op: str
    field: str
    sglang: str
    batchstate: str
    request: str = ""
    since: int = -1

    def __str__(self) -> str:
        who = f", request {self.request}" if self.request else ""
        where = ""
        if 0 <= self.since < self.step:
            where = f" (arose in steps {self.since} to {self.step}: the last full check passed)"
        return (
            f"step {self.step}, after {self.op}{who}: {self.field} is {self.sglang} in SGLang, "
            f"{self.batchstate} in batchstate{where}"
        )


@attrs.define
class Checked:
    """Where SGLang and batchstate were last seen equal: the first step after the last
    passed comparison of the pool counts, and of each batch's rows request by request
    (a merge carries the older of its two batches'). A difference found at a step arose
    after these: `since` gives the first step of that range."""

    pools: int = 0
    rows: dict[str, int] = attrs.field(factory=dict)

    def since(self, op: Operation) -> int:
        """The first step of the range a difference found after `op` arose in."""
        if op.op not in ROW_OPS:
            return self.pools
        return min(self.pools, self.rows.get(op.batch, self.pools))

    def passed(self, op: Operation, *, pools: bool) -> None:
        """`op` was checked and nothing differed (`pools`: its pool counts were compared)."""
        if op.op == "merge_batch":  # the other batch's rows join this one's
            other = self.rows.pop(op.other, self.pools)
            self.rows[op.batch] = min(self.rows.get(op.batch, self.pools), other)
        if op.op in ROW_OPS and op.full:
            self.rows[op.batch] = op.step + 1
        if pools:
            self.pools = op.step + 1


def apply(replica: Replica, op: Operation) -> None:
    """Replay `op` on `replica`, after evicting the cached prefixes SGLang's call evicted
    (which cached pages eviction takes is policy: SGLang's least-recently-used clock and
    node boundaries differ from batchstate's)."""
    replica.evict(op.evicted)
    if op.op == "prepare_for_extend":
        replica.extend(op.batch, op.items)
    elif op.op == "prepare_for_decode":
        replica.decode(op.batch)
    elif op.op in ("filter_batch", "retract_decode"):
        replica.filter(op.batch, op.kept)
    elif op.op in ("merge_batch", "mix_with_running"):
        # A mixed step: the running rows, decoded already, join the extend's rows.
        replica.merge(op.batch, op.other)
    elif op.op == "release_kv_cache":
        replica.release(op.rid, op.tokens)
    elif op.op == "checkpoint_kv_cache":
        replica.checkpoint(op.rid)


def check(op: Operation, replica: Replica, *, pools: bool = True) -> Mismatch | None:
    """`compare(op, replica.state(op.batch), pools=pools)`, without building batchstate's
    `State` where the answer needs none: when the replica holds SGLang's rows in SGLang's
    order with SGLang's lengths (one list comparison each) and SGLang's mirror lists each
    row as its own (no `mirror_order` recorded), and for an operation that is not `full`
    (counts and the mirror's order only). Free request rows and pool counts are compared
    as `compare` does. Any other case, a difference included, goes to `compare`, which
    names it."""
    counts = replica.pools_state()
    if op.op not in ROW_OPS:
        found = None
    elif not op.full:
        found = _counts(op, replica.num_rows(op.batch), replica.seq_lens_sum(op.batch))
        found = found or _held(op, counts)
    elif (
        op.op != "prepare_for_extend"
        and op.mirror_rows == len(op.state.rids)
        and not op.mirror_order
        and replica.same_rows(op.batch, op.state.rids, op.state.seq_lens)
    ):
        found = _totals(op, counts, replica.seq_lens_sum(op.batch))
    else:
        return compare(op, replica.state(op.batch), pools=pools)
    if found is None:
        found = _free_slots(op, counts)
    if found is None and pools:
        found = _pools(op, counts)
    return found


def compare(op: Operation, mine: State, *, pools: bool = True) -> Mismatch | None:
    """The first difference between SGLang's recorded state and batchstate's, or None.

    Rows are compared after `ScheduleBatch` calls (per request: rid, tokens in
    the KV cache, tokens read from the prefix cache, the mirror's order; for an
    operation that is not `full`, their number and total, and the mirror's order); free
    request rows after every call; token counts when `pools` (the caller's: no extended
    request is still waiting for its checkpoint, since batchstate publishes a prefill's
    pages in the extend and SGLang when result processing checkpoints each request;
    under overlap that is a turn later).
    """
    found = None
    if op.op in ROW_OPS and op.full:
        found = _rows(op, mine)
    elif op.op in ROW_OPS:
        found = _counts(op, len(mine.rids), sum(mine.seq_lens)) or _held(op, mine)
    if found is None:
        found = _free_slots(op, mine)
    if found is None and pools:
        found = _pools(op, mine)
    return found


def touched(op: Operation) -> str:
    """The requests whose holdings `op` changed, as a pool-level mismatch names them: the
    released or checkpointed request, an extend's requests, a decode's rows ('' for a
    filter or merge, which moves rows between batches and allocates nothing)."""
    if op.rid:
        return op.rid
    if op.op == "prepare_for_extend":
        return ", ".join(item.rid for item in op.items)
    if op.op == "prepare_for_decode":  # a sampled operation records its rows in `kept`
        return ", ".join(op.state.rids or op.kept)
    return ""


def _differ(op: Operation, field: str, sglang: object, ours: object, rid: str = "") -> Mismatch:
    return Mismatch(op.step, op.op, field, str(sglang), str(ours), rid)


def _mirror(op: Operation, mine: State) -> Mismatch | None:
    theirs = op.state
    if op.mirror_rows != len(theirs.rids):
        return _differ(op, "req_pool_indices_cpu rows", op.mirror_rows, len(mine.rids))
    return _order(op, theirs.rids)


def _order(op: Operation, rids: tuple[str, ...]) -> Mismatch | None:
    # Row i of every per-row tensor (the device's req_pool_indices included) is reqs[i]'s:
    # a mirror that lists the right rows in another order points row i at another request.
    # SGLang's alone (`rids`: its live rows'), so a sampled operation checks it too.
    for listed, rid in zip(op.mirror_order, rids, strict=False):
        if listed != rid:
            return _differ(op, "req_pool_indices_cpu order", f"{listed}'s row", f"{rid}'s row", rid)
    return None


def _rows(op: Operation, mine: State) -> Mismatch | None:
    theirs = op.state
    mirror = _mirror(op, mine)
    if mirror is not None:
        return mirror
    # Row order is policy (retract_decode keeps SGLang's retraction order, batchstate's
    # filter keeps positions increasing): rows are compared by request.
    if sorted(theirs.rids) != sorted(mine.rids):
        odd = sorted(set(theirs.rids) ^ set(mine.rids))
        return _differ(op, "rows", sorted(theirs.rids), sorted(mine.rids), odd[0] if odd else "")
    names = ("seq_lens", "prefix_lens") if op.op == "prepare_for_extend" else ("seq_lens",)
    for name in names:
        ours = dict(zip(mine.rids, getattr(mine, name), strict=True))
        for rid, value in zip(theirs.rids, getattr(theirs, name), strict=True):
            if value != ours[rid]:
                return _differ(op, name[:-1], value, ours[rid], rid)
    return _totals(op, mine, sum(mine.seq_lens))


def _counts(op: Operation, rows: int, seq_lens_sum: int) -> Mismatch | None:
    # Between full checks: how many rows, not which (`kept` is SGLang's live rows' rids).
    if op.mirror_rows != len(op.kept):
        return _differ(op, "req_pool_indices_cpu rows", op.mirror_rows, rows)
    order = _order(op, op.kept)
    if order is not None:
        return order
    if len(op.kept) != rows:
        return _differ(op, "row count", len(op.kept), rows)
    total = seq_lens_sum + sum(length for _, length in op.state.held)
    if op.seq_lens_sum is not None and op.seq_lens_sum != total:
        return _differ(op, "seq_lens_sum", op.seq_lens_sum, total)
    return None


def _held(op: Operation, mine: State) -> Mismatch | None:
    held = dict(mine.held)
    for rid, length in op.state.held:
        if held.get(rid) != length:
            return _differ(op, "held chunk tokens", length, held.get(rid), rid)
    return None


def _totals(op: Operation, mine: State, seq_lens_sum: int) -> Mismatch | None:
    # Rows already equal: the held chunks, and SGLang's running total when it keeps one.
    found = _held(op, mine)
    total = seq_lens_sum + sum(length for _, length in op.state.held)
    if found is None and op.seq_lens_sum is not None and op.seq_lens_sum != total:
        found = _differ(op, "seq_lens_sum", op.seq_lens_sum, total)
    return found


def _free_slots(op: Operation, mine: State) -> Mismatch | None:
    # Rows are taken and given back at the same calls on both sides, published or not.
    if op.state.free_slots != mine.free_slots:
        return _differ(op, "free_slots", op.state.free_slots, mine.free_slots, touched(op))
    return None


def _pools(op: Operation, mine: State) -> Mismatch | None:
    theirs = op.state
    # batchstate evicts the exact shortage where SGLang's estimate adds a page per request
    # (policy): free and evictable tokens are compared as their sum.
    counts = (
        ("protected_tokens", theirs.protected_tokens, mine.protected_tokens),
        (
            "free_tokens + evictable_tokens",
            theirs.free_tokens + theirs.evictable_tokens,
            mine.free_tokens + mine.evictable_tokens,
        ),
    )
    for name, sglang, ours in counts:
        if sglang != ours:
            return _differ(op, name, sglang, ours, touched(op))
    return None


def dumps(entry: PoolsConfig | Operation) -> str:
    """One trace line."""
    kind = {"op": "pools"} if isinstance(entry, PoolsConfig) else {}
    return json.dumps({**kind, **attrs.asdict(entry)}, separators=(",", ":")) + "\n"


class TraceError(Error, ValueError):
    """A trace line is not one this version writes: names the line and what is wrong."""


def read(path: Path) -> tuple[PoolsConfig, Iterator[Operation]]:
    """The pools line and the operations of a trace file."""
    lines = path.read_text().splitlines()
    if not lines:
        raise TraceError(f"{path}: empty trace")
    try:
        head = json.loads(lines[0])
        if not isinstance(head, dict) or head.get("op") != "pools":
            raise KeyError("the first line must be the pools line")
        config = PoolsConfig(
            int(head["page_size"]), int(head["kv_tokens"]), int(head["rows"]), int(head["context"])
        )
    except (ValueError, TypeError, KeyError) as error:
        raise TraceError(f"{path}:1: {_what(error)}") from None

    def operations() -> Iterator[Operation]:
        for number, line in enumerate(lines[1:], start=2):
            try:
                yield _operation(json.loads(line))
            except (ValueError, TypeError, KeyError) as error:
                raise TraceError(f"{path}:{number}: {_what(error)}") from None

    return config, operations()


def _what(error: Exception) -> str:
    """What is wrong with a line, in words (no Python repr): the message of a
    command line's one-line usage error."""
    if isinstance(error, json.JSONDecodeError):
        return f"not JSON ({error.msg} at column {error.colno})"
    if isinstance(error, KeyError):
        key = str(error.args[0]) if error.args else ""
        return key if " " in key else f"not a trace line: no field {key!r}"
    if isinstance(error, TypeError):
        return "not a trace line: a field holds the wrong kind of value (or is not an object)"
    return f"not a trace line: a field holds the wrong value ({error})"


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _operation(raw: dict[str, Any]) -> Operation:
    state = raw["state"]
    return Operation(
        step=int(raw["step"]),
        op=str(raw["op"]),
        batch=str(raw["batch"]),
        state=State(
            rids=tuple(map(str, state["rids"])),
            seq_lens=_ints(state["seq_lens"]),
            prefix_lens=_ints(state["prefix_lens"]),
            held=tuple((str(rid), int(n)) for rid, n in state["held"]),
            free_slots=int(state["free_slots"]),
            free_tokens=int(state["free_tokens"]),
            evictable_tokens=int(state["evictable_tokens"]),
            protected_tokens=int(state["protected_tokens"]),
        ),
        other=str(raw["other"]),
        items=tuple(
            ExtendItem(
                str(i["rid"]), _ints(i["tokens"]), int(i["extend_len"]), int(i["prefix_len"])
            )
            for i in raw["items"]
        ),
        kept=tuple(map(str, raw["kept"])),
        rid=str(raw["rid"]),
        tokens=_ints(raw["tokens"]),
        mirror_rows=int(raw["mirror_rows"]),
        seq_lens_sum=None if raw["seq_lens_sum"] is None else int(raw["seq_lens_sum"]),
        evicted=tuple(Eviction(_ints(e["tokens"]), int(e["keep"])) for e in raw["evicted"]),
        # Absent from traces whose mirror listed every row as its own.
        mirror_order=tuple(map(str, raw.get("mirror_order", ()))),
        full=bool(raw.get("full", True)),  # traces written before sampling are all full
    )
