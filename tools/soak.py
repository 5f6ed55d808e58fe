"""Soak: a long seeded run of the public transitions, bookkeeping only, on the `meta` device.

A small continuous-batching loop written against the public API alone (no
engine): requests arrive, are admitted by `extend` (long prompts in chunks:
the request is filtered out, keeps its memory, and comes back as a
`Chunked` holding what it cached), merged into the running batch, decoded
until they finish, filtered out and released. When decode runs out of KV tokens the newest
row is retracted (released, its request queued again from scratch).

Device tensors live on `meta`, where any read of data raises, so the whole
run also proves that no transition reads the device. Invariants
(`check_batch`, `check_pools` with every live batch) are checked every
`--check-every` steps and at the end, where every slot and page must be free.

    python tools/soak.py --requests 100000 --check-every 500 --seed 6

`--production` soaks the step production runs instead: the reference
engine's scheduler with the prefix cache, chunked prefill, overlap and
speculative decoding all on, over shared prefixes and follow-up turns, on
`meta`, with the pools and leaks checked every `--check-every` steps; at the
end `flush` must leave every page and slot free.

    python tools/soak.py --production --requests 100000 --check-every 1000 --seed 6

Not run in CI; docs/reliability.md records its figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from returns.result import Success

from batchstate import (
    Batch,
    Chunked,
    Extended,
    Idle,
    OutOfKVTokens,
    Pools,
    Req,
    check_batch,
    check_pools,
    decode,
    extend,
    filter_batch,
    flush,
    idle,
    make_pools,
    merge,
    release,
    split,
)
from batchstate.engine import EngineConfig, SimulationConfig, WorkloadConfig, simulate


@dataclass
class _Request:
    rid: int
    prompt: tuple[int, ...]
    output_len: int
    slot: int = 0
    gen: int = 0  # the generation it holds its slot at
    cached: int = 0  # prompt tokens with KV (chunked prefill progress)
    generated: int = 0


@dataclass
class _Stats:
    steps: int = 0
    extends: int = 0
    decodes: int = 0
    chunks: int = 0
    retractions: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    checks: int = 0
    failures: dict[str, int] = field(default_factory=dict)


class _Loop:
    """The engine loop's state: pools, running batch, its model, held and waiting requests."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.pools = make_pools(
            args.max_reqs, args.max_context_len, args.kv_tokens, self.device, args.page_size
        )
        self.waiting: deque[_Request] = deque()
        self.held: list[_Request] = []  # chunked prefill between chunks: memory kept
        self.running: Batch = idle(self.device)
        self.rows: list[_Request] = []  # the model of `running`, in row order
        self.stats = _Stats()

    def admit(self) -> None:
        """Extend chunk continuations first, then waiting requests, within the prefill budget."""
        items: list[Req | Chunked] = []
        admitted: list[_Request] = []
        targets: list[int] = []  # prompt tokens cached once this extend has run
        budget = self.args.max_prefill_tokens
        free_slots = self.pools.num_free_slots
        for request in [*self.held, *self.waiting]:
            if budget <= 0 or len(self.rows) + len(admitted) >= self.args.max_running:
                break
            if not request.cached and free_slots == 0:
                break  # held requests come first; waiting ones need a slot
            chunk = min(len(request.prompt) - request.cached, budget)
            req = Req(request.rid, request.prompt[: request.cached + chunk])
            items.append(
                Chunked(req, request.slot, request.cached, gen=request.gen)
                if request.cached
                else req
            )
            free_slots -= not request.cached
            admitted.append(request)
            targets.append(request.cached + chunk)
            budget -= chunk
        if not items:
            return
        result = extend(idle(self.device), items, self.pools)
        if not isinstance(result, Success):
            _count(self.stats, result.failure())
            return
        batch, self.pools = result.unwrap()
        self.stats.extends += 1
        slots = batch.rows.req_pool_indices.host.tolist()
        gens = batch.rows.gens.tolist()
        done: list[int] = []
        for row, (request, slot, target) in enumerate(zip(admitted, slots, targets, strict=True)):
            self.stats.prompt_tokens += target - request.cached
            request.slot, request.cached, request.gen = slot, target, gens[row]
            if request in self.held:
                self.held.remove(request)
            else:
                self.waiting.remove(request)
            if request.cached == len(request.prompt):
                done.append(row)
            else:
                self.held.append(request)
                self.stats.chunks += 1
        incoming = filter_batch(batch, done)
        if len(incoming.rows):
            running = self.running
            assert not isinstance(running, Extended)  # the loop never keeps an Extended
            self.running = merge(running, incoming)
            self.rows += [admitted[row] for row in done]

    def decode(self) -> None:
        """Decode every row, retracting the newest row while KV runs out."""
        while self.rows:
            assert not isinstance(self.running, Idle)
            decoded = decode(self.running, self.pools)
            if isinstance(decoded, Success):
                self.running, self.pools = decoded.unwrap()
                self.stats.decodes += 1
                for request in self.rows:
                    request.generated += 1
                self.stats.generated_tokens += len(self.rows)
                return
            _count(self.stats, decoded.failure())
            if not isinstance(decoded.failure(), OutOfKVTokens):
                raise SystemExit(f"unexpected decode failure: {decoded.failure()}")
            victim = self.rows.pop()
            self.running, self.pools = _drop(self.running, self.pools, [len(self.rows)])
            victim.cached, victim.generated, victim.slot = 0, 0, 0
            self.waiting.appendleft(victim)
            self.stats.retractions += 1

    def finish(self) -> None:
        """Rows that generated their output leave the batch and are released."""
        finished = [
            row for row, request in enumerate(self.rows) if request.generated >= request.output_len
        ]
        if finished:
            self.running, self.pools = _drop(self.running, self.pools, finished)
            gone = set(finished)
            self.rows = [request for row, request in enumerate(self.rows) if row not in gone]
            self.stats.finished += len(finished)

    def check(self) -> None:
        """Every invariant, on the host (a meta device holds no data to compare)."""
        compare = self.device.type != "meta"
        check_batch(self.running, compare_device=compare)
        check_pools(self.pools, [self.running], compare_device=compare)
        assert self.running.rows.rids.tolist() == [request.rid for request in self.rows]
        for request in self.held:
            assert int(self.pools.slot_tokens[request.slot]) == request.cached
        self.stats.checks += 1


def main() -> int:
    args = _parser().parse_args()
    # Host ops here are tiny: intra-op threads only add spin-waits (ms each on a busy machine).
    torch.set_num_threads(args.threads)
    if args.production:
        return _production(args)
    rng = random.Random(args.seed)
    loop = _Loop(args)
    stats = loop.stats
    next_rid = 0
    started = time.perf_counter()
    while stats.finished < args.requests:
        for _ in range(_arrivals(rng, args.arrival_rate)):
            if next_rid < args.requests:
                loop.waiting.append(_new_request(rng, next_rid, args))
                next_rid += 1
        loop.admit()
        loop.decode()
        loop.finish()
        stats.steps += 1
        if args.check_every and stats.steps % args.check_every == 0:
            loop.check()
    loop.check()
    pools = loop.pools
    assert pools.num_free_slots == args.max_reqs, "slots still owned at the end"
    assert pools.num_free_tokens == args.kv_tokens, "KV tokens still owned at the end"
    elapsed = time.perf_counter() - started
    report = {
        "device": args.device,
        "seed": args.seed,
        "requests": args.requests,
        "finished": stats.finished,
        "steps": stats.steps,
        "extends": stats.extends,
        "decodes": stats.decodes,
        "chunk_continuations": stats.chunks,
        "retractions": stats.retractions,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "invariant_checks": stats.checks,
        "failures_returned": stats.failures,
        "wall_s": round(elapsed, 1),
        "us_per_step": round(1e6 * elapsed / max(stats.steps, 1)),
        "end": f"{pools.num_free_slots}/{args.max_reqs} slots and"
        f" {pools.num_free_tokens}/{args.kv_tokens} KV tokens free",
    }
    print(json.dumps(report, indent=2))
    return 0


def _production(args: argparse.Namespace) -> int:
    """The engine's production step on meta, to the end; every page free after `flush`."""
    workload = WorkloadConfig(
        num_requests=args.requests,
        arrival_rate=args.arrival_rate,
        prompt_len=(8, 48),
        output_len=(4, 48),
        seed=args.seed,
        shared_prefixes=4,
        shared_prefix_len=64,
        shared_fraction=0.5,
        follow_ups=0.3,
    )
    engine = EngineConfig(
        max_running=args.max_running,
        max_prefill_tokens=args.max_prefill_tokens,
        check_every=args.check_every,
        chunk_size=32,
        overlap=True,
        speculative=3,
    )
    config = SimulationConfig(
        workload=workload,
        engine=engine,
        max_reqs=args.max_reqs,
        num_kv_tokens=args.kv_tokens,
        page_size=args.page_size,
        device=args.device,
        prefix_cache=True,
    )
    config.validate()
    started = time.perf_counter()
    run = simulate(config)
    elapsed = time.perf_counter() - started
    trace = run.trace
    pools = flush(run.pools)
    assert len(run.outputs) == args.requests, "requests left unfinished"
    assert pools.num_free_slots == pools.max_reqs, "slots still owned at the end"
    assert pools.num_free_tokens == args.kv_tokens, "pages still owned or cached after flush"
    report = {
        "requests_finished": len(run.outputs),
        "steps": len(trace),
        "chunks": trace.num_chunks,
        "cache_hits": trace.cache_hits,
        "prefill_computed": trace.prefill_computed,
        "prefill_cached": trace.prefill_cached,
        "evicted_pages": trace.evicted_pages,
        "retractions": trace.num_retractions,
        "speculative_steps": trace.speculative_steps,
        "drafted": trace.drafted_tokens,
        "accepted": trace.accepted_drafts,
        "overshoot_tokens": trace.overshoot_tokens,
        "invariant_checks": trace.num_checks,
        "device_reads": trace.device_reads,
        "audited_steps": trace.num_audited,
        "wall_s": round(elapsed, 1),
        "end": f"{pools.num_free_slots}/{pools.max_reqs} slots and"
        f" {pools.num_free_tokens}/{args.kv_tokens} KV tokens free after flush",
    }
    print(json.dumps(report, indent=2))
    return 0


def _drop(running: Batch, pools: Pools, gone: list[int]) -> tuple[Batch, Pools]:
    """Filter rows `gone` out of `running` and release them."""
    assert not isinstance(running, Idle)
    keep = [row for row in range(len(running.rows)) if row not in set(gone)]
    kept, left = split(running, keep)
    pools = release(left, kept, pools).unwrap()
    return kept, pools


def _count(stats: _Stats, failure: object) -> None:
    name = type(failure).__name__
    stats.failures[name] = stats.failures.get(name, 0) + 1


def _arrivals(rng: random.Random, rate: float) -> int:
    # Poisson arrivals per step, by inversion (no numpy needed).
    count, threshold, product = 0, pow(2.718281828459045, -rate), rng.random()
    while product > threshold:
        count += 1
        product *= rng.random()
    return count


def _new_request(rng: random.Random, rid: int, args: argparse.Namespace) -> _Request:
    prompt_len = rng.randint(*args.prompt_len)
    output_len = rng.randint(*args.output_len)
    return _Request(rid, tuple(rng.randrange(32000) for _ in range(prompt_len)), output_len)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--requests", type=int, default=100_000)
    add("--seed", type=int, default=6)
    add("--device", default="meta", help="meta (default): any device read raises")
    add("--check-every", type=int, default=500, help="steps between invariant checks")
    add("--arrival-rate", type=float, default=2.0, help="mean requests per step")
    add("--prompt-len", type=int, nargs=2, default=(1, 300), metavar=("MIN", "MAX"))
    add("--output-len", type=int, nargs=2, default=(1, 64), metavar=("MIN", "MAX"))
    add("--max-running", type=int, default=48)
    add("--max-reqs", type=int, default=64)
    add("--kv-tokens", type=int, default=4096)
    add("--page-size", type=int, default=16)
    add("--max-context-len", type=int, default=512)
    add("--threads", type=int, default=1, help="torch intra-op threads")
    add("--max-prefill-tokens", type=int, default=256, help="input ids per extend: chunks")
    add(
        "--production",
        action="store_true",
        help="soak the engine's production step: cache, chunks, overlap, speculation",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
