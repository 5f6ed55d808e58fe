"""Ragged `kv_indices` from the host or from the device: `python -m benchmarks.kv_indices`.

`fill_buffers` gathers FlashInfer's `kv_indices` on the device from the bucket's
page table, at cells the host computes and uploads with the block: one
int32 per page, O(pages) host work. The alternative derives each page's
cell on the device from `kv_indptr`, whose values the host already knows
and uploads: `searchsorted` finds each page's row, an `index_select` its
row's first cell, an add its place in the row, then the same gather, into
scratch buffers allocated once; O(rows) host work, three more kernels.

For each shape (rows, pages per row), this times on the CPU the host's
cells (what `fill_buffers` does) and counts their bytes; runs the device
derivation on the CPU as a stand-in device (checked equal; a GPU's time
for it is not measured here) and counts its kernels and allocations on
`meta`. Medians over `--repeats`; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

from benchmarks.counting import count_allocations, count_device_work


def host_cells(pages: np.ndarray, columns: int) -> np.ndarray:
    """Each page's cell in a page table `columns` wide, as `write_layout` computes them."""
    rows = pages.shape[0]
    kv_ptr = np.zeros(rows + 1, dtype=np.int32)
    np.add.accumulate(pages, out=kv_ptr[1:])
    starts = np.arange(0, rows * columns, columns, dtype=np.int32)
    np.subtract(starts, kv_ptr[:-1], out=starts)
    counter = np.arange(int(kv_ptr[-1]), dtype=np.int32)
    return np.add(starts.repeat(pages), counter)


def device_cells(  # noqa: PLR0917  # the uploaded offsets, then the buffers written
    kv_indptr: torch.Tensor,
    row_starts: torch.Tensor,
    counter: torch.Tensor,
    rows_of: torch.Tensor,
    cells: torch.Tensor,
    num_pages: int,
) -> torch.Tensor:
    """The same cells from `kv_indptr` and each row's `r * columns - kv_indptr[r]`, on the
    device, into `cells`: no allocation, no read (`num_pages` is the host's)."""
    rows = kv_indptr.shape[0] - 1
    out_rows = rows_of[:num_pages]
    torch.searchsorted(kv_indptr[1:], counter[:num_pages], right=True, out=out_rows)
    out = cells[:num_pages]
    torch.index_select(row_starts[:rows], 0, out_rows, out=out)
    out.add_(counter[:num_pages])
    return out


def _median_us(call: Callable[[], object], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def measure(rows: int, per_row: int, repeats: int) -> dict[str, float]:
    """Host µs of both ways at `rows` rows of `per_row` pages, and the device derivation's
    work counted on `meta`."""
    pages = np.full(rows, per_row, dtype=np.int32)
    columns = per_row + 1
    expected = host_cells(pages, columns)
    num_pages = expected.shape[0]
    results: dict[str, float] = {"pages": num_pages}
    results["host_us"] = _median_us(lambda: host_cells(pages, columns), repeats)
    results["upload_bytes"] = 4 * num_pages
    kv_ptr = np.zeros(rows + 1, dtype=np.int32)
    np.add.accumulate(pages, out=kv_ptr[1:])
    row_starts = np.arange(0, rows * columns, columns, dtype=np.int32) - kv_ptr[:-1]
    for name, device in (("meta", torch.device("meta")), ("cpu", torch.device("cpu"))):
        args = (
            torch.from_numpy(kv_ptr).to(device),
            torch.from_numpy(row_starts.astype(np.int64)).to(device),
            torch.arange(num_pages, dtype=torch.int32, device=device),
            torch.empty(num_pages, dtype=torch.int64, device=device),
            torch.empty(num_pages, dtype=torch.int64, device=device),
        )
        if name == "cpu":
            results["device_cpu_us"] = _median_us(partial(device_cells, *args, num_pages), repeats)
            got = device_cells(*args, num_pages)
            assert got.tolist() == expected.tolist()
        else:
            with count_device_work() as work, count_allocations() as made:
                device_cells(*args, num_pages)
            results["kernels"], results["allocations"] = work.kernels, len(made)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point: print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        "| rows | pages | host cells µs | cells uploaded, bytes"
        " | device way, run on the CPU µs | device way: kernels | allocations |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rows, per_row in ((8, 5), (64, 64), (1024, 8), (1024, 1133)):
        point = measure(rows, per_row, args.repeats)
        print(
            f"| {rows} | {point['pages']:,.0f} | {point['host_us']:,.1f}"
            f" | {point['upload_bytes']:,.0f} | {point['device_cpu_us']:,.1f}"
            f" | {point['kernels']:.0f} | {point['allocations']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
