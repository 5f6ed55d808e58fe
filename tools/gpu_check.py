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
mirrors, and prints a short report. Exit status 1 if anything differs or
raised.
"""

from __future__ import annotations

import argparse
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

from batchstate import Batch, Pools, check_batch, check_pools
from batchstate.audit import device_reads
from tools.decode_loop import LoopConfig, Snapshot, run_loop, scripted_accept

__all__ = ["main"]

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
