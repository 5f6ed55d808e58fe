"""Run the step benchmark: `python -m benchmarks.step` (see docs/performance.md).

Prints the table, writes JSON and a PNG plot, and with `--docs` rewrites the
results section of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import torch

from benchmarks.measure import (
    BaselineColumns,
    by_role,
    count_blocks,
    count_work,
    implementations_carrying,
    run_step,
    state_bytes,
    time_config,
)
from benchmarks.report import Point, markdown, plot, summarise, text_table
from benchmarks.scenario import Config, make_plan

__all__ = ["main", "run"]

_ROOT: Final = Path(__file__).resolve().parent.parent
_DOC: Final = _ROOT / "docs" / "performance.md"
_BEGIN, _END = "<!-- results: begin -->", "<!-- results: end -->"


def run(
    sizes: Sequence[int],
    pages: Sequence[int],
    repeats: int,
    warmup: int,
    *,
    quiet: bool = False,
    interleave: bool = True,
    columns: BaselineColumns = "none",
) -> tuple[list[Point], dict[str, Any]]:
    """Time every (page size, batch size) point, then count ops, allocations and bytes.

    With `columns`, all three carry that column set, with the same values.
    """
    impls = implementations_carrying(columns)
    points = []
    for page_size in pages:
        for batch_size in sizes:
            config = Config(batch_size, page_size)
            timings = time_config(config, repeats, warmup, impls, interleave=interleave)
            points.append(summarise(config, by_role(timings)))
            if not quiet:
                print(text_table(points[-1:]).splitlines()[-1], flush=True)
    probe = Config(64 if 64 in sizes else sizes[0], pages[0])
    extras: dict[str, Any] = {
        "columns": columns,
        "probe": probe._asdict(),
        "work": {
            page: by_role(count_work(Config(probe.batch_size, page), implementations=impls))
            for page in pages
        },
        "work_batch_size": probe.batch_size,
        "blocks": by_role(count_blocks(probe, columns=columns)),
        "growth": _growth(points, sizes),
        "machine": _machine(),
    }
    extras["host_bytes"], extras["device_bytes"] = _bytes_per_request(probe, columns)
    return points, extras


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=400, help="timed steps per point")
    parser.add_argument("--warmup", type=int, default=40, help="untimed steps per point first")
    parser.add_argument("--out", type=Path, default=_ROOT / "benchmarks" / "results")
    parser.add_argument("--docs", action="store_true", help="rewrite docs/performance.md results")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--columns",
        choices=("none", "sampling"),
        default="none",
        help="the column set all three carry: none, or each request's sampling parameters"
        " (batchstate's Sampling columns; SamplingBatchInfo's tensors in the baseline)",
    )
    parser.add_argument(
        "--alone",
        action="store_true",
        help="time each implementation's steps in one block, not interleaved (no --docs)",
    )
    args = parser.parse_args(argv)
    if args.alone and args.docs:
        parser.error("--docs records the interleaved run: drop --alone")
    if args.columns != "none" and args.docs:
        parser.error("--docs records the run without columns: drop --columns")
    # Engines pin host threads; on a small machine torch's pool makes tiny host
    # ops erratic (a 64-element op taking milliseconds), for all three alike.
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    points, extras = run(
        args.sizes,
        args.pages,
        args.repeats,
        args.warmup,
        interleave=not args.alone,
        columns=args.columns,
    )
    extras["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "step" if args.columns == "none" else f"step-{args.columns}"
    (args.out / f"{stem}.json").write_text(json.dumps({"points": points, **extras}, indent=1))
    plot(points, args.out / f"{stem}.png")
    snippet = markdown(points, extras)
    if args.columns != "none":
        snippet = f"All three carry `{args.columns}` columns.\n\n{snippet}"
    (args.out / f"{stem}.md").write_text(snippet)
    print()
    print(snippet)
    print(f"wrote {args.out}/{stem}.json, {stem}.png, {stem}.md in {extras['wall_s']} s")
    if args.docs:
        plot(points, _ROOT / "docs" / "performance.png")
        _rewrite_doc(snippet, extras)
        print(f"rewrote {_DOC} and docs/performance.png")


def _growth(points: Sequence[Point], sizes: Sequence[int]) -> dict[int, str]:
    # Step time at the largest size over that at 64 (or the smallest), per page size.
    low = 64 if 64 in sizes else min(sizes)
    growth = {}
    for page_size in sorted({point["page_size"] for point in points}):
        step = {
            point["batch_size"]: point["stats"]["batchstate"]["step"]["median_us"]
            for point in points
            if point["page_size"] == page_size
        }
        growth[page_size] = f"{step[max(sizes)] / step[low]:.1f}x ({max(sizes)} vs {low})"
    return growth


def _bytes_per_request(
    config: Config, columns: BaselineColumns
) -> tuple[dict[str, float], dict[str, float]]:
    # Measured right after a decode, when the batch holds every per-row field.
    plan = make_plan(config, 2)
    host, device = {}, {}
    for make in implementations_carrying(columns):
        impl = make(plan)
        run_step(impl, plan.steps[0])
        impl.decode()
        host[impl.name], device[impl.name] = (
            value / config.batch_size for value in state_bytes(impl)
        )
    return by_role(host), by_role(device)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    return (
        f"{cpu}, {torch.get_num_threads()} torch threads, Python {platform.python_version()},"
        f" torch {torch.__version__}, device tensors on cpu"
    )


def _rewrite_doc(snippet: str, extras: dict[str, Any]) -> None:
    text = _DOC.read_text()
    machine = f"Measured on: {extras['machine']} (full run {extras['wall_s']} s)."
    body = f"{_BEGIN}\n{machine}\n\n{snippet}{_END}"
    _DOC.write_text(
        re.sub(f"{re.escape(_BEGIN)}.*?{re.escape(_END)}", lambda _: body, text, flags=re.S)
    )


if __name__ == "__main__":
    main()
