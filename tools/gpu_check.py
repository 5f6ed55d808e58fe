"""Run the decode loop on a GPU with every CUDA sync an error, and check it against the CPU.

    python tools/gpu_check.py            # on a CUDA machine; elsewhere says so and exits 0
    python tools/gpu_check.py --steps 300

For page sizes 1 and 16, the script runs the loop of `tools/decode_loop.py`
(extend, decode, staggered filters and releases, merges, speculative
verify and sync) twice: on the CPU, and on CUDA under
`torch.cuda.set_sync_debug_mode("error")` and a forbidding
`batchstate.audit.device_reads`. Only `sync`'s read is permitted (it lifts
the debug mode for itself). It then compares the host side of both runs
after every transition, compares the final device tensors with their
mirrors, and prints a short report. On CUDA it then pads a decode forward
to each of the sizes 1, 2, 4 and 8, captures one CUDA graph per size of
paged SDPA attention over the padded inputs, and checks that its replay
equals the eager run; FlashInfer's decode and FA3's `flash_attn_with_kvcache`
run on the same inputs when they are installed (each says so when not).
Last, for decode buckets of 1, 4 and 8 rows, an extend bucket of 4 rows
and 96 tokens and a verify bucket of 4 rows and 3 drafts a row, it fills
one bucket's `GraphBuffers` straight from a step's record, captures a
CUDA graph of attention that reads only the buffers, fills them from
another step's record (other rows, lengths, prompts and drafts), replays,
and compares the real tokens with SDPA run eagerly on the unpadded
`forward_inputs`; the buffers' addresses must not move (on the CPU the
same check runs without capture: `--device cpu`).
Exit status 1 if anything differs or raised.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import torch

if __package__ in (None, ""):  # run as a script: make `tools` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.counting import count_device_work

from batchstate import (
    Batch,
    ForwardInputs,
    GraphBuffers,
    Padded,
    Pools,
    Req,
    check_batch,
    check_pools,
    decode,
    extend,
    fill_buffers,
    forward_inputs,
    idle,
    make_pools,
    pad,
    unpad,
    unpad_tokens,
    verify,
)
from batchstate.audit import device_reads
from batchstate.backends import fa3_args, flashinfer_decode_plan, sdpa_attention
from tools.decode_loop import LoopConfig, Snapshot, run_loop, scripted_accept

__all__ = ["check_graph_buffers", "graph_attention", "main"]

_PAGE_SIZES: Final = (1, 16)


def main(argv: Sequence[str] | None = None) -> int:
    """Check every page size and print the report; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=200, help="decode steps per run")
    parser.add_argument(
        "--device", default="cuda", help="device to check (cpu runs the script's own test)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"CUDA is not available (torch {torch.__version__}): nothing to check on a GPU.")
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"gpu_check: torch {torch.__version__}, {name}, {args.steps} steps per run")
    ok = True
    for page_size in _PAGE_SIZES:
        config = LoopConfig(page_size=page_size, num_steps=args.steps, draft_every=3)
        ok = _check(device, config) and ok
    if device.type == "cuda":
        ok = _check_forward(device) and ok
    ok = check_graph_buffers(device) and ok
    print("gpu_check: OK" if ok else "gpu_check: FAILED")
    return 0 if ok else 1


def _check(device: torch.device, config: LoopConfig) -> bool:
    label = f"page_size={config.page_size}"
    started = time.perf_counter()
    expected = run_loop(torch.device("cpu"), config, scripted_accept)
    cpu_s = time.perf_counter() - started
    run_loop(
        device, LoopConfig(page_size=config.page_size, num_steps=4), scripted_accept
    )  # warm-up
    last: list[tuple[Batch, Pools]] = []

    def keep_last(batch: Batch, pools: Pools) -> None:
        last[:] = [(batch, pools)]

    started = time.perf_counter()
    try:
        with _sync_debug_errors(device), device_reads(forbid=True) as log:
            got = run_loop(device, config, scripted_accept, keep_last)
    except Exception as error:  # report any failure, then go on to the next page size
        print(f"  {label}: FAILED on {device}: {type(error).__name__}: {error}")
        return False
    device_s = time.perf_counter() - started
    report = log.report()
    mismatch = _first_mismatch(expected, got)
    batch, pools = last[0]
    check_batch(batch, compare_device=True)  # outside the debug mode: these compare by copying
    check_pools(pools, [batch], compare_device=True)
    syncs = sum(snapshot.event == "sync" for snapshot in got)
    print(
        f"  {label}: {len(got)} transitions ({syncs} syncs) in {device_s:.2f} s on {device},"
        f" {cpu_s:.2f} s on cpu; device reads: {report.count}"
        f" ({len(report.forbidden)} forbidden); host side matches cpu: {mismatch is None}"
    )
    print(f"    {_work_per_step(device, config, device_s)}")
    if mismatch is not None:
        print(f"    first difference: {mismatch}")
    for read in report.forbidden[:5]:
        print(f"    {read}")
    # Every sync reads once from a real device; on the CPU nothing is a device read.
    expected_reads = 0 if device.type == "cpu" else syncs
    return mismatch is None and report.count == expected_reads and not report.forbidden


def _check_forward(device: torch.device) -> bool:
    # Padded decode forwards replayed from one CUDA graph per size, then FlashInfer and FA3
    # (when installed) fed the same inputs, each against torch SDPA on the same cache.
    ok = True
    heads, dim, page_size = 4, 64, 16
    for size in (1, 2, 4, 8):
        pools = make_pools(size, 256, 64 * 64, device, page_size)
        reqs = [Req(rid, tuple(range(1, 20 + 7 * rid))) for rid in range(max(size - 1, 1))]
        extended, pools = extend(idle(device), reqs, pools).unwrap()
        decoding, pools = decode(extended, pools).unwrap()
        padded = pad(forward_inputs(decoding, pools.table, page_size), [size]).unwrap()
        inputs = padded.inputs
        generator = torch.Generator(device=device).manual_seed(size)
        k = torch.randn(pools.kv_cache_size, heads, dim, device=device, generator=generator)
        v = torch.randn(pools.kv_cache_size, heads, dim, device=device, generator=generator)
        q = torch.randn(inputs.num_tokens, heads, dim, device=device, generator=generator)
        eager = sdpa_attention(inputs, q, k, v)
        graph = torch.cuda.CUDAGraph()
        static_q = q.clone()
        with torch.cuda.graph(graph):
            static_out = sdpa_attention(inputs, static_q, k, v)
        static_q.copy_(q)
        graph.replay()
        replayed = unpad(padded.wrap(static_out))
        same = bool(torch.equal(replayed, unpad(padded.wrap(eager))))
        line = f"  cuda graph, decode size {size}: replay equals eager: {same}"
        for name, run in _backends(inputs, q, k, v, page_size).items():
            error = float((run - eager)[: padded.num_real_tokens].abs().max())
            line += f"; {name} max error {error:.2e}"
            same = same and error < 1e-2
        print(line)
        ok = ok and same
    return ok


def check_graph_buffers(device: torch.device) -> bool:
    """Capture attention over filled `GraphBuffers`, refill with other steps, replay, compare.

    On CUDA each bucket's graph is captured once, over its first step's
    fill; each later step refills the same buffers and replays. Elsewhere
    the graph's body runs eagerly over the same buffers.
    """
    ok = True
    heads, dim, page_size = 2, 32, 16
    buckets = {
        "decode 1": (GraphBuffers.for_decode(device, page_size, 1, 16), 0),
        "decode 4": (GraphBuffers.for_decode(device, page_size, 4, 16), 0),
        "decode 8": (GraphBuffers.for_decode(device, page_size, 8, 16), 0),
        "extend 4x96": (GraphBuffers.for_extend(device, page_size, 4, 96, 16), -1),
        "verify 4x3": (GraphBuffers.for_verify(device, page_size, 4, 3, 16), 3),
    }
    for name, (buffers, drafts) in buckets.items():
        addresses = _addresses(buffers)
        generator = torch.Generator(device=device).manual_seed(buffers.rows)
        k = torch.randn(64 * 256, heads, dim, device=device, generator=generator)
        v = torch.randn(64 * 256, heads, dim, device=device, generator=generator)
        static_q = torch.zeros(buffers.tokens, heads, dim, device=device)
        errors, graph, static_out = [], None, None
        for step in range(3):
            rows = max(buffers.rows - step, 1)
            inputs, padded = _step(buffers, rows, drafts, step)
            q = torch.randn(inputs.num_tokens, heads, dim, device=device, generator=generator)
            static_q.copy_(padded.pad_tokens(q))
            if device.type != "cuda":
                static_out = graph_attention(padded.inputs, static_q, k, v)
            elif graph is None:
                graph = torch.cuda.CUDAGraph()
                graph_attention(padded.inputs, static_q, k, v)  # warm-up outside the capture
                with torch.cuda.graph(graph):
                    static_out = graph_attention(padded.inputs, static_q, k, v)
            else:
                graph.replay()
            if graph is not None and step == 0:
                graph.replay()
            assert static_out is not None
            replayed = unpad_tokens(padded.wrap(static_out))
            errors.append(float((replayed - sdpa_attention(inputs, q, k, v)).abs().max()))
        same = max(errors) < 1e-4 and _addresses(buffers) == addresses
        print(
            f"  graph buffers, {name}: 3 steps of other rows and lengths into one bucket,"
            f" max error {max(errors):.1e}, addresses unchanged:"
            f" {_addresses(buffers) == addresses}"
        )
        ok = ok and same
    return ok


def graph_attention(
    inputs: ForwardInputs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Paged causal attention from the device sides alone: fixed shapes, so a graph replays it.

    Each token finds its row in `qo_indptr`, reads its row's `page_table`
    pages in full, and masks keys past its position or its row's length;
    tokens in no row get zeros.
    """
    table, page_size = inputs.page_table.device, inputs.page_size
    rows, width = table.shape
    tokens = q.shape[0]
    token_at = torch.arange(tokens, device=q.device)
    row = torch.searchsorted(inputs.qo_indptr.device[1:], token_at.to(torch.int32), right=True)
    in_row = row < rows
    row = row.clamp(max=rows - 1)
    offsets = torch.arange(page_size, device=q.device)
    locs = (table.long()[:, :, None] * page_size + offsets).reshape(rows, width * page_size)
    keys, values = k[locs[row]], v[locs[row]]  # [tokens, keys, heads, dim]
    key_at = torch.arange(width * page_size, device=q.device)
    seq = inputs.seq_lens.device.long()[row]
    visible = (key_at[None, :] <= inputs.positions.device[:, None]) & (
        key_at[None, :] < seq[:, None]
    )
    scores = torch.einsum("thd,tkhd->thk", q, keys) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    out = torch.einsum("thk,tkhd->thd", scores.softmax(-1).nan_to_num(0.0), values)
    return out * in_row[:, None, None]


def _step(buffers: GraphBuffers, rows: int, drafts: int, step: int) -> tuple[ForwardInputs, Padded]:
    # One step's forward, filled into `buffers` from its record, and its unpadded inputs:
    # `rows` requests of lengths that change with `step`, their prompts (drafts < 0), a
    # decode, or a verify window of ragged drafts (at most `drafts` a row).
    device, page_size = buffers.device, buffers.page_size
    pools = make_pools(8, 256, 64 * 256, device, page_size)
    reqs = [Req(rid, tuple(range(1, 9 + 23 * rid + 11 * step))) for rid in range(rows)]
    if drafts < 0:  # prompts of at most 96 tokens in all
        reqs = [Req(rid, tuple(range(1, 4 + 7 * rid + 5 * step))) for rid in range(rows)]
    extended, pools = extend(idle(device), reqs, pools).unwrap()
    if drafts < 0:
        inputs = forward_inputs(extended, pools.table, page_size)
        return inputs, fill_buffers(buffers, extended, pools.table).unwrap()
    decoding, pools = decode(extended, pools).unwrap()
    if not drafts:
        inputs = forward_inputs(decoding, pools.table, page_size)
        return inputs, fill_buffers(buffers, decoding, pools.table).unwrap()
    draft_lens = [(row + step) % (drafts + 1) for row in range(rows)]
    window, pools = verify(decoding, draft_lens, pools).unwrap()
    slot_tokens = pools.slot_tokens
    inputs = forward_inputs(window, pools.table, page_size, slot_tokens=slot_tokens)
    return inputs, fill_buffers(buffers, window, pools.table, slot_tokens=slot_tokens).unwrap()


def _addresses(buffers: GraphBuffers) -> list[int]:
    tensors = (buffers.block, buffers.page_table, buffers.kv_indices, buffers.out_cache_loc)
    return [tensor.data_ptr() for tensor in tensors]


def _backends(
    inputs: ForwardInputs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_size: int
) -> dict[str, torch.Tensor]:
    # Each installed backend's output on the same inputs; absent ones are left out.
    runs: dict[str, torch.Tensor] = {}
    pages_k = k.view(-1, page_size, *k.shape[1:]).half()
    pages_v = v.view(-1, page_size, *v.shape[1:]).half()
    try:
        flashinfer = importlib.import_module("flashinfer")  # optional: GPU machines only
    except ImportError:
        print("  flashinfer: not installed")
    else:
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(
            **flashinfer_decode_plan(inputs),
            num_qo_heads=q.shape[1],
            num_kv_heads=k.shape[1],
            head_dim=q.shape[2],
            q_data_type=torch.float16,
        )
        runs["flashinfer"] = wrapper.run(q.half(), (pages_k, pages_v)).float()
    try:
        fa3 = importlib.import_module("flash_attn_interface")  # as above
    except ImportError:
        print("  fa3: not installed")
    else:
        runs["fa3"] = fa3.flash_attn_with_kvcache(
            q.half(), pages_k, pages_v, causal=True, **fa3_args(inputs)
        ).float()
    return runs


def _work_per_step(device: torch.device, config: LoopConfig, seconds: float) -> str:
    # Launches and copies beside the µs: on a GPU each kernel and copy has a fixed cost.
    # A CPU "device" launches nothing: count the same loop on meta instead, where
    # nothing can be read, so verify windows are abandoned rather than synced.
    counted_on = device if device.type != "cpu" else torch.device("meta")
    accept = scripted_accept if counted_on == device else None
    with count_device_work() as work:
        run_loop(counted_on, config, accept)
    steps = config.num_steps
    return (
        f"per decode step, on {counted_on}: {work.kernels / steps:.1f} device kernels,"
        f" {work.copies / steps:.1f} host-to-device copies, {work.host_ops / steps:.1f} host"
        f" torch ops; {seconds / steps * 1e6:.0f} µs per step on {device} (checks included)"
    )


def _first_mismatch(expected: Sequence[Snapshot], got: Sequence[Snapshot]) -> str | None:
    for index, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            return f"transition {index} (step {want.step}, {want.event}): cpu {want}, device {have}"
    if len(expected) != len(got):
        return f"cpu ran {len(expected)} transitions, the device {len(got)}"
    return None


@contextmanager
def _sync_debug_errors(device: torch.device) -> Iterator[None]:
    # Every CUDA sync raises inside the block; a no-op on other devices.
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize()  # start from an idle device
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


if __name__ == "__main__":
    sys.exit(main())
