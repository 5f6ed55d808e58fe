"""batchstate's step beside SGLang 0.5.23's real one: `python -m benchmarks.sglang_step`.

Two workloads, each at batch 8, 64, 256 and 1024 and page sizes 1 and 16, both
sides carrying sampling parameters (SGLang's batch always does; batchstate's
carries the standard `Sampling` columns):

- plain: decode, finish one row, admit one request, merge (`benchmarks.scenario`);
- default: a radix cache, a held 128-token chunk continued and a new request
  chunked in one prefill, shared system prompts, allocation evicting, and
  overlap on batchstate's side (`benchmarks.production_plan`).

SGLang's side is `benchmarks.sglang_batch` (its `PrefillAdder`, `ScheduleBatch`
and `RadixCache`, called as its scheduler calls them). The two sides replay the
same plan, step by step in one process, who goes first alternating, and each
phase is timed on the thread's CPU clock (`time.thread_time_ns`), so time other
processes take from this one is not counted. A phase's figure is its median over
the timed steps; a ratio is batchstate's median over SGLang's. The model's part
(the sampled tokens) is not timed on either side. Prints a Markdown table; `--quick`
runs a few steps at batch 8, page 1 (a smoke test, not a measurement).

    python -m benchmarks.sglang_step [--quick] [--steps 300] [--sizes 8 64] [--pages 1]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Final, NamedTuple

import torch

__all__ = ["TARGETS", "Point", "main", "run"]

PLAIN: Final = ("decode", "filter", "release", "extend", "merge")
DEFAULT: Final = ("decode", "prefill", "settle", "release", "merge")
# Step ratio targets (batchstate over SGLang) per workload: (batch <= 8, <= 64, larger).
TARGETS: Final = {"plain": (0.35, 0.25, 0.15), "default": (0.4, 0.3, 0.2)}

_Phase = tuple[str, Callable[[], object]]  # name ("" for untimed), call


class Point(NamedTuple):
    """One (workload, page, batch) point: median µs per phase and step, per side."""

    workload: str
    page_size: int
    batch_size: int
    sglang_us: dict[str, float]
    batchstate_us: dict[str, float]

    def ratio(self, phase: str) -> float:
        """batchstate's median over SGLang's, for `phase` or "step"."""
        return self.batchstate_us[phase] / self.sglang_us[phase]

    def target(self) -> float:
        """The step ratio this point should stay under."""
        small, medium, large = TARGETS[self.workload]
        return small if self.batch_size <= 8 else medium if self.batch_size <= 64 else large


def _plain(batch_size: int, page_size: int, steps: int) -> tuple[list[_Phase], list[_Phase]]:
    from benchmarks.impl_batchstate import BatchstateStep
    from benchmarks.scenario import Config, make_plan
    from benchmarks.sglang_batch import SGLangPlain

    plan = make_plan(Config(batch_size, page_size), steps)
    ours, theirs = BatchstateStep(plan, columns="sampling"), SGLangPlain(plan)
    mine: list[_Phase] = []
    sglang: list[_Phase] = []
    for join in plan.steps:
        mine += [
            ("decode", ours.decode),
            ("filter", partial(ours.filter, join)),
            ("release", ours.release),
            ("extend", partial(ours.extend, join)),
            ("merge", ours.merge),
        ]
        sglang += [
            ("decode", theirs.decode),
            ("", partial(theirs.forward, join)),
            ("release", partial(theirs.release, join)),
            ("filter", partial(theirs.filter, join)),
            ("extend", partial(theirs.extend, join)),
            ("", theirs.prefill_forward),
            ("merge", theirs.merge),
        ]
    return mine, sglang


def _default(batch_size: int, page_size: int, steps: int) -> tuple[list[_Phase], list[_Phase]]:
    from benchmarks.production_batchstate import BatchstateProduction
    from benchmarks.production_plan import make_production_plan
    from benchmarks.sglang_batch import SGLangDefault

    plan = make_production_plan(batch_size, page_size, steps)
    ours, theirs = BatchstateProduction(plan, sampling=True), SGLangDefault(plan)
    mine: list[_Phase] = []
    sglang: list[_Phase] = []
    for turn in plan.turns:
        mine += [
            ("decode", ours.decode),
            ("prefill", partial(ours.prefill, turn)),
            ("", partial(ours.forward, turn)),
            ("settle", ours.settle),
            ("release", partial(ours.release, turn)),
            ("merge", ours.merge),
        ]
        sglang += [
            ("decode", theirs.decode),
            ("prefill", partial(theirs.prefill, turn)),
            ("", partial(theirs.forward, turn)),
            ("settle", theirs.settle),
            ("release", partial(theirs.release, turn)),
            ("merge", theirs.merge),
        ]
    return mine, sglang


def _time(workload: str, batch_size: int, page_size: int, steps: int, warmup: int) -> Point:
    build, phases = (_plain, PLAIN) if workload == "plain" else (_default, DEFAULT)
    sides = build(batch_size, page_size, warmup + steps)
    per_step = [len(calls) // (warmup + steps) for calls in sides]
    spans: list[dict[str, list[int]]] = [{p: [] for p in (*phases, "step")} for _ in sides]
    clock = time.thread_time_ns
    gc.collect()
    gc.disable()  # a collection lands on whichever side happens to allocate past the mark
    try:
        for step in range(warmup + steps):
            for which in (step % 2, 1 - step % 2):  # who goes first alternates
                total = 0
                width = per_step[which]
                for name, call in sides[which][step * width : (step + 1) * width]:
                    start = clock()
                    call()
                    span = clock() - start
                    if name and step >= warmup:
                        spans[which][name].append(span)
                        total += span
                if step >= warmup:
                    spans[which]["step"].append(total)
            if step % 64 == 63:
                gc.collect()
    finally:
        gc.enable()
    ours, sglang = ({p: statistics.median(v) / 1e3 for p, v in s.items()} for s in spans)
    return Point(workload, page_size, batch_size, sglang, ours)


def run(
    sizes: Sequence[int], pages: Sequence[int], steps: int, warmup: int, *, quiet: bool = False
) -> list[Point]:
    """Time both workloads at every (page, batch) point, printing each row as it lands."""
    from batchstate.sglang import cpu_topology

    points = []
    with cpu_topology():
        for workload in ("plain", "default"):
            for page_size in pages:
                for batch_size in sizes:
                    points.append(_time(workload, batch_size, page_size, steps, warmup))
                    if not quiet:
                        print(_row(points[-1]), flush=True)
    return points


def _header(phases: Sequence[str]) -> str:
    cells = ["workload", "page", "batch", "SGLang step µs", "batchstate step µs"]
    cells += ["merge µs SGLang / batchstate"]
    cells += [f"{phase} ratio" for phase in phases] + ["step ratio", "target"]
    return "| " + " | ".join(cells) + " |\n|" + "---|" * len(cells)


def _row(point: Point) -> str:
    phases = PLAIN if point.workload == "plain" else DEFAULT
    held = "held" if point.ratio("step") <= point.target() else "NOT held"
    cells = [point.workload, str(point.page_size), str(point.batch_size)]
    cells += [f"{point.sglang_us['step']:.0f}", f"{point.batchstate_us['step']:.0f}"]
    cells += [f"{point.sglang_us['merge']:.0f} / {point.batchstate_us['merge']:.0f}"]
    cells += [f"{point.ratio(phase):.2f}" for phase in phases]
    cells += [f"**{point.ratio('step'):.2f}**", f"≤ {point.target()} {held}"]
    return "| " + " | ".join(cells) + " |"


def table(points: Sequence[Point]) -> str:
    """The points as Markdown, one table per workload (their phases differ)."""
    parts = []
    for workload, phases in (("plain", PLAIN), ("default", DEFAULT)):
        rows = [_row(point) for point in points if point.workload == workload]
        if rows:
            parts.append("\n".join([_header(phases), *rows]))
    return "\n\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per point")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps per point first")
    parser.add_argument("--quick", action="store_true", help="batch 8, page 1, a few steps")
    parser.add_argument("--json", type=Path, help="also write the points here")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("sglang") is None:
        print("skipped: sglang is not installed (pip install 'batchstate[sglang]')")
        return
    if args.quick:
        args.sizes, args.pages, args.steps, args.warmup = [8], [1], 5, 2
    warnings.simplefilter("ignore")  # SGLang warns about CUDA-only features on CPU
    torch.set_num_threads(1)
    started = time.perf_counter()
    points = run(args.sizes, args.pages, args.steps, args.warmup)
    print()
    print(table(points))
    print(f"in {time.perf_counter() - started:.1f} s")
    if args.json is not None:
        args.json.write_text(json.dumps([p._asdict() for p in points], indent=1))


if __name__ == "__main__":
    main()
