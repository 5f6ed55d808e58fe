"""SGLang's real scheduler loop driven by batchstate (`batchstate.sglang.driven.Drive`),
held against stock SGLang on the same workload: its own `get_next_batch_to_run`,
`run_batch` and `process_batch_result`, in the default configuration (radix cache,
chunked prefill, overlap), pages 1 and 16, shared prefixes, retraction under memory
pressure, SGLang's own out-of-memory abort and client aborts mid-chunk and mid-decode.
Every forward carries the same requests, token ids, lengths and prefix hits as stock's,
every row writes and reads only its own KV, every output is stock's token for token,
and `Shadow` rides the driven loop without a finding. Skipped without SGLang."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

import torch

from batchstate.sglang import Shadow
from batchstate.sglang.driven.batch import DrivenFieldError
from batchstate.sglang.driven.drive import Drive
from batchstate.sglang.scheduler_loop import SchedulerLoop
from tests.sglang.test_sglang_real_loop import KV_TOKENS, Workload, _topology

pytestmark = SGLANG_MARKS

ROWS, CONTEXT = 16, 1024


@attrs.frozen
class Forward:
    """What the model worker is given in one forward, less the KV locations chosen."""

    mode: str
    rids: tuple[str, ...]
    input_ids: tuple[int, ...]
    seq_lens: tuple[int, ...]
    seq_lens_sum: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]


class KVWitness:
    """Wraps a loop's fake worker: records each forward, writes each computed token's id
    into a KV table at the location the batch gives it, and checks that every row reads,
    through the request-to-token table, exactly its own request's tokens."""

    def __init__(self, loop: SchedulerLoop) -> None:
        self.loop = loop
        self.forwards: list[Forward] = []
        self.rows_checked = 0
        self.kv = torch.full((KV_TOKENS[16] * 4,), -1, dtype=torch.int64)
        forward = loop.worker.forward_batch_generation

        def witnessed(batch: Any, **kwargs: object) -> object:
            self._witness(batch)
            return forward(batch, **kwargs)

        loop.worker.forward_batch_generation = witnessed  # type: ignore[method-assign]

    def _witness(self, batch: Any) -> None:
        extend = batch.forward_mode.is_extend()
        seq_lens = batch.seq_lens_cpu.tolist()
        total = batch.seq_lens_sum
        self.forwards.append(
            Forward(
                "extend" if extend else "decode",
                tuple(r.rid for r in batch.reqs),
                tuple(batch.input_ids.tolist()),
                tuple(seq_lens),
                int(total) if total is not None else sum(seq_lens),
                tuple(batch.prefix_lens) if extend else (),
                tuple(batch.extend_lens) if extend else (),
            )
        )
        self.kv[batch.out_cache_loc.long()] = batch.input_ids.long()
        table = self.loop.scheduler.req_to_token_pool.req_to_token
        for req, slot, length in zip(
            batch.reqs, batch.req_pool_indices_cpu.tolist(), seq_lens, strict=True
        ):
            stored = self.kv[table[slot, :length].long()].tolist()
            known = [*req.origin_input_ids, *req.output_ids][:length]
            # Under overlap the newest output may still be in flight: the relay gave it.
            assert stored[: len(known)] == known, (req.rid, "reads another request's KV")
            assert -1 not in stored, (req.rid, "reads KV nothing wrote")
            self.rows_checked += 1


def _run(
    page: int,
    overlap: bool,
    seed: int,
    *,
    driven: bool,
    shadow: bool = False,
    kv_tokens: int | None = None,
    unified_cache: bool = False,
) -> tuple[SchedulerLoop, Workload, KVWitness, Drive | None, Shadow | None]:
    kv = KV_TOKENS[page] if kv_tokens is None else kv_tokens
    loop = SchedulerLoop(
        page_size=page,
        kv_tokens=kv,
        rows=ROWS,
        context=CONTEXT,
        overlap=overlap,
        unified_cache=unified_cache,
    )
    drive = Drive(loop.scheduler).attach() if driven else None
    watcher = Shadow().attach() if shadow else None  # after the drive: it sees the driven calls
    witness = KVWitness(loop)
    workload = Workload(loop, seed)
    try:
        workload.run()
    finally:
        if watcher is not None:
            watcher.detach()
        if drive is not None:
            drive.detach()
    return loop, workload, witness, drive, watcher


CELLS = [
    *[(page, True, seed) for page in (1, 16) for seed in (1, 2, 3)],
    *[(page, False, 1) for page in (1, 16)],
]


@pytest.mark.parametrize(("page", "overlap", "seed"), CELLS)
def test_the_driven_loop_runs_every_forward_and_output_as_stock_sglang(
    page: int, overlap: bool, seed: int
) -> None:
    with _topology(page):
        stock, _, stock_seen, _, _ = _run(page, overlap, seed, driven=False)
        loop, work, seen, drive, shadow = _run(page, overlap, seed, driven=True, shadow=True)
    assert drive is not None and shadow is not None
    # The same forwards, in order: requests, token ids, lengths, cache hits, chunks.
    assert len(seen.forwards) == len(stock_seen.forwards) > 400
    first = next(
        (
            i
            for i, (a, b) in enumerate(zip(stock_seen.forwards, seen.forwards, strict=True))
            if a != b
        ),
        None,
    )
    assert first is None, (first, stock_seen.forwards[first], seen.forwards[first])
    assert drive.prefills + drive.decodes == len(seen.forwards)
    # Every request's outputs, token for token, and how each one ended.
    assert loop.outputs.tokens == stock.outputs.tokens
    assert loop.outputs.finished == stock.outputs.finished
    assert loop.outputs.aborted == stock.outputs.aborted
    assert work.aborted_mid_chunk >= 1 and work.aborted_mid_decode >= 1
    assert set(loop.outputs.finished) | set(loop.outputs.aborted) == set(work.prompts)
    # Shared prefixes were read and requests decoded together (as many as in stock).
    assert sum(1 for f in seen.forwards for hit in f.prefix_lens if hit) >= 10
    assert max(len(f.rids) for f in seen.forwards if f.mode == "decode") >= 4
    assert seen.rows_checked > 1500
    # The shadow, replaying every driven call on its own pools, found nothing.
    assert shadow.divergences == []
    assert len(shadow.operations) > 1000
    # The one Pools value holds nothing for any request at the end.
    pools = drive.pools
    assert pools.num_free_slots == pools.max_reqs
    assert pools.cache.num_locked == 0
    assert pools.num_available_tokens == pools.num_pages * pools.page_size


@pytest.mark.parametrize("page", [1, 16])
def test_over_a_servers_default_cache_the_driven_loop_runs_as_stock(page: int) -> None:
    # A 0.5.23 server builds a UnifiedRadixCache (full attention alone), not a RadixCache:
    # stock runs over it, and drive stands in for it.
    with _topology(page):
        stock, _, stock_seen, _, _ = _run(page, True, 1, driven=False, unified_cache=True)
        loop, _, seen, drive, _ = _run(page, True, 1, driven=True, unified_cache=True)
    assert drive is not None
    assert type(stock.scheduler.tree_cache).__name__ == "UnifiedRadixCache"
    assert len(seen.forwards) == len(stock_seen.forwards) > 400
    assert seen.forwards == stock_seen.forwards
    assert sum(1 for f in seen.forwards for hit in f.prefix_lens if hit) >= 10
    assert loop.outputs.tokens == stock.outputs.tokens
    assert loop.outputs.aborted == stock.outputs.aborted
    assert drive.pools.num_available_tokens == drive.pools.num_pages * drive.pools.page_size


def test_a_hybrid_models_cache_is_refused_at_attach_in_one_line() -> None:
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from batchstate.sglang.driven.support import DriveRefused

    with _topology(16):
        loop = SchedulerLoop(page_size=16, kv_tokens=1024, rows=ROWS, unified_cache=True)
        cache = loop.scheduler.tree_cache
        cache.tree_components = (ComponentType.FULL, ComponentType.SWA)  # a window's too
        with pytest.raises(DriveRefused, match=r"cache \(UnifiedRadixCache with SWA\)"):
            Drive(loop.scheduler)
        cache.tree_components, cache.disable = (ComponentType.FULL,), True
        with pytest.raises(DriveRefused, match="disabled UnifiedRadixCache"):
            Drive(loop.scheduler)
    assert not type(loop.scheduler.req_to_token_pool).__name__.endswith("View")


def _pressed(page: int, driven: bool, shared: int) -> tuple[SchedulerLoop, KVWitness, Drive | None]:
    # Short prompts (behind a `shared` head), long outputs: admission counts on requests
    # finishing early, they do not, and decoding runs out of KV again and again.
    loop = SchedulerLoop(
        page_size=page, kv_tokens=KV_TOKENS[page], rows=ROWS, context=CONTEXT, overlap=True
    )
    drive = Drive(loop.scheduler).attach() if driven else None
    witness = KVWitness(loop)
    rng = random.Random(7)
    head = [rng.randrange(100, 30000) for _ in range(shared)]
    for _ in range(24):
        tail = [rng.randrange(100, 30000) for _ in range(rng.randrange(8, 40))]
        loop.submit(head + tail, rng.randrange(150, 260))
    try:
        steps = 0
        while loop.busy and steps < 5000:
            loop.step()
            steps += 1
    finally:
        if drive is not None:
            drive.detach()
    return loop, witness, drive


@pytest.mark.parametrize("page", [1, 16])
def test_under_memory_pressure_the_driven_loop_retracts_as_stock_does(page: int) -> None:
    with _topology(page):
        stock, stock_seen, _ = _pressed(page, driven=False, shared=0)
        loop, seen, drive = _pressed(page, driven=True, shared=0)
    assert drive is not None
    assert seen.forwards == stock_seen.forwards
    assert loop.outputs.tokens == stock.outputs.tokens
    assert loop.outputs.finished == stock.outputs.finished
    assert _retracted(seen.forwards) >= 1  # SGLang then admits with a full reserve
    assert drive.pools.num_free_slots == drive.pools.max_reqs


def test_a_shared_prompt_admitted_together_is_deduplicated_a_turn_earlier() -> None:
    """The one policy difference: batchstate publishes a prefill's whole pages at its
    extend, so requests of one prefill sharing a head hold it once from then on; stock
    SGLang holds a copy each until its checkpoint, a turn later under overlap. Under
    memory pressure the driven scheduler then admits the next request a step earlier:
    the same outputs, in no more forwards."""
    with _topology(1):
        stock, stock_seen, _ = _pressed(1, driven=False, shared=24)
        loop, seen, drive = _pressed(1, driven=True, shared=24)
    assert drive is not None
    assert loop.outputs.tokens == stock.outputs.tokens
    assert loop.outputs.finished == stock.outputs.finished
    assert seen.forwards[0] == stock_seen.forwards[0]  # the first prefill: three requests
    assert (seen.forwards[1].mode, stock_seen.forwards[1].mode) == ("extend", "decode")
    assert len(seen.forwards) <= len(stock_seen.forwards)


def _retracted(forwards: list[Forward]) -> int:
    # A request prefilled again after it decoded was retracted (memory ran short).
    decoded: set[str] = set()
    again = 0
    for forward in forwards:
        if forward.mode == "decode":
            decoded.update(forward.rids)
        else:
            again += sum(1 for rid in forward.rids if rid in decoded)
            decoded.difference_update(forward.rids)
    return again


def test_a_driven_batch_has_no_mirror_to_assign() -> None:
    with _topology(16):
        loop = SchedulerLoop(
            page_size=16, kv_tokens=KV_TOKENS[16], rows=ROWS, context=CONTEXT, overlap=True
        )
        with Drive(loop.scheduler):
            Workload(loop, 1, requests=4)
            for _ in range(6):
                loop.step()
            batch = loop.scheduler.running_batch
            assert len(batch.reqs) >= 2
            for field in ("req_pool_indices_cpu", "seq_lens_sum", "seq_lens", "out_cache_loc"):
                with pytest.raises(DrivenFieldError, match=f"ScheduleBatch.{field} is read from"):
                    setattr(batch, field, None)
            assert batch.seq_lens_sum == sum(batch.seq_lens_cpu.tolist())


def _refusal(step: Callable[[], object]) -> str:
    with pytest.raises(DrivenFieldError) as refused:
        step()
    return str(refused.value)


# The source documents' three bugs of SGLang's mutable batch, tried on the driven loop.


def _forgets_the_mirror(original: Callable[..., Any]) -> Callable[..., Any]:
    # A decode builder that forgets the host mirror of req_pool_indices.
    def prepare_for_decode(batch: Any) -> None:
        original(batch)
        batch.req_pool_indices_cpu = None

    return prepare_for_decode


def _sums_on_the_device(original: Callable[..., Any]) -> Callable[..., Any]:
    # seq_lens_sum recomputed from the device tensor: a device sync on every decode.
    def prepare_for_decode(batch: Any) -> None:
        original(batch)
        batch.seq_lens_sum = int(batch.seq_lens.sum().item())

    return prepare_for_decode


@pytest.mark.parametrize("bug", [_forgets_the_mirror, _sums_on_the_device])
def test_a_patch_that_reintroduces_a_seed_bug_changes_nothing_under_drive(
    bug: Callable[[Callable[..., Any]], Callable[..., Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    with _topology(16):
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        clean, _, clean_seen, _, _ = _run(16, True, 1, driven=False)
        # SGLang's class patched as the bug would be written into it, counting its runs.
        calls = [0]
        buggy = bug(ScheduleBatch.prepare_for_decode)

        def counted(batch: Any) -> None:
            calls[0] += 1
            buggy(batch)

        monkeypatch.setattr(ScheduleBatch, "prepare_for_decode", counted)
        stock = SchedulerLoop(
            page_size=16, kv_tokens=KV_TOKENS[16], rows=ROWS, context=CONTEXT, overlap=True
        )
        Workload(stock, 1)
        try:  # stock SGLang runs the patched method on every decode (the first bug crashes)
            for _ in range(100):
                stock.step()
        except TypeError:
            assert bug is _forgets_the_mirror
        assert calls[0] > 0
        calls[0] = 0
        # Driven, the same patch never computes a batch: the run is the clean one.
        loop, _, seen, _, _ = _run(16, True, 1, driven=True)
        assert calls[0] == 0
        assert seen.forwards == clean_seen.forwards
        assert loop.outputs.tokens == clean.outputs.tokens
        # Run on a driven batch directly, the bug's own line has no field to write into.
        loop = SchedulerLoop(
            page_size=16, kv_tokens=KV_TOKENS[16], rows=ROWS, context=CONTEXT, overlap=True
        )
        with Drive(loop.scheduler):
            Workload(loop, 1, requests=4)
            while loop.step() != "decode":
                pass
            with pytest.raises(DrivenFieldError):
                bug(lambda batch: None)(loop.scheduler.running_batch)


def test_an_emptied_batch_has_no_rows_for_a_merge_to_bring_back() -> None:
    """Stock SGLang's `filter_batch` that keeps no request leaves the batch's tensors as
    they were, and a merge that does not check `is_empty` first concatenates them back;
    a driven batch emptied has no rows, and merging it adds none."""
    rows: dict[bool, tuple[int, int]] = {}
    for driven in (False, True):
        with _topology(16):
            loop = SchedulerLoop(
                page_size=16, kv_tokens=KV_TOKENS[16], rows=ROWS, context=CONTEXT, overlap=True
            )
            drive = Drive(loop.scheduler).attach() if driven else None
            try:
                Workload(loop, 2, requests=12)
                s = loop.scheduler
                # Right after a whole prefill (no chunk left over): its batch is merged into
                # the running one at the next turn.
                while not (
                    loop.step() == "prefill"
                    and s.chunked_req is None
                    and len(s.running_batch.reqs) >= 2
                ):
                    pass
                emptied, other = s.running_batch, s.last_batch
                emptied.filter_batch(keep_indices=[])
                other.merge_batch(emptied)  # the merge the seed bug made without a check
                rows[driven] = (len(other.reqs), int(other.seq_lens.shape[0]))
            finally:
                if drive is not None:
                    drive.detach()
    stock_reqs, stock_rows = rows[False]
    assert stock_rows > stock_reqs  # stock: the emptied batch's stale rows came back
    driven_reqs, driven_rows = rows[True]
    assert driven_rows == driven_reqs
