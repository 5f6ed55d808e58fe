"""The production step benchmark: `python -m benchmarks.production` (see docs/performance.md).

Times (a) batchstate and (b) the SGLang-style mutable baseline on the
production step (`benchmarks.production_plan`), interleaved step by step with
(c) the plain step's floor (`benchmarks.impl_floor`: the tensor ops of one
decode, filter, release, extend and merge, with no cache and no chunking)
at the same batch and page size. With `--columns sampling`, all three carry
each request's sampling parameters, with the same values. Timed steps come in
`--rounds` blocks; each
implementation's figure is its best block's median (the machine is shared:
the best block is the one least disturbed). Prints the table; `--docs`
rewrites the production section of docs/performance.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import torch

from benchmarks.impl_floor import FloorStep
from benchmarks.measure import BaselineColumns, by_role, timed_step
from benchmarks.production_batchstate import BatchstateProduction
from benchmarks.production_mutable import MutableProduction
from benchmarks.production_plan import PHASES, ProductionPlan, Turn, make_production_plan
from benchmarks.production_state import ProductionOutcome
from benchmarks.scenario import PHASES as PLAIN_PHASES
from benchmarks.scenario import Config, make_plan

__all__ = [
    "IMPLEMENTATIONS",
    "final_outcomes",
    "implementations_carrying",
    "main",
    "run",
    "run_turn",
]

_ROOT: Final = Path(__file__).resolve().parent.parent
_DOC: Final = _ROOT / "docs" / "performance.md"
_BEGIN, _END = "<!-- production: begin -->", "<!-- production: end -->"
_NAMES: Final = ("batchstate", "mutable", "floor")


class Production(Protocol):
    """One way to run the production step; `forward` stands for the model and is not timed."""

    @property
    def name(self) -> str:
        """Its key in the results: batchstate or mutable."""

    @property
    def hits(self) -> int:
        """New requests so far that read a cached prefix."""

    def decode(self) -> None: ...
    def prefill(self, turn: Turn) -> None: ...
    def forward(self, turn: Turn) -> None: ...
    def settle(self) -> None: ...
    def release(self, turn: Turn) -> None: ...
    def merge(self) -> None: ...
    def outcome(self) -> ProductionOutcome: ...


IMPLEMENTATIONS: Final[tuple[Callable[[ProductionPlan], Production], ...]] = (
    BatchstateProduction,
    MutableProduction,
)


def implementations_carrying(
    columns: BaselineColumns = "none",
) -> tuple[Callable[[ProductionPlan], Production], ...]:
    """(a) and (b), each carrying `columns` with the same values."""
    if columns == "none":
        return IMPLEMENTATIONS
    return (
        functools.partial(BatchstateProduction, sampling=True),
        functools.partial(MutableProduction, sampling=True),
    )


def run_turn(impl: Production, turn: Turn) -> None:
    """One iteration, untimed."""
    impl.decode()
    impl.prefill(turn)
    impl.forward(turn)
    impl.settle()
    impl.release(turn)
    impl.merge()


def _timed_turn(impl: Production, turn: Turn, out: dict[str, list[int]]) -> None:
    clock = time.perf_counter_ns
    t0 = clock()
    impl.decode()
    t1 = clock()
    impl.prefill(turn)
    t2 = clock()
    impl.forward(turn)  # the model's part: left out of the step
    t3 = clock()
    impl.settle()
    t4 = clock()
    impl.release(turn)
    t5 = clock()
    impl.merge()
    t6 = clock()
    spans = (t1 - t0, t2 - t1, t4 - t3, t5 - t4, t6 - t5)
    for phase, span in zip(PHASES, spans, strict=True):
        out[phase].append(span)
    out["step"].append(sum(spans))


def final_outcomes(
    batch_size: int, page_size: int, num_turns: int, columns: BaselineColumns = "none"
) -> list[ProductionOutcome]:
    """Each implementation's state after `num_turns` iterations and one more decode."""
    plan = make_production_plan(batch_size, page_size, num_turns)
    outcomes = []
    for make in implementations_carrying(columns):
        impl = make(plan)
        for turn in plan.turns:
            run_turn(impl, turn)
        impl.decode()
        outcomes.append(impl.outcome())
    return outcomes


def time_point(  # noqa: PLR0917  # a point and how long to time it
    batch_size: int,
    page_size: int,
    repeats: int,
    warmup: int,
    rounds: int,
    columns: BaselineColumns = "none",
) -> dict[str, Any]:
    """Best-of-`rounds` medians (µs) per implementation and phase, and the step ratios."""
    steps = warmup + rounds * repeats
    plan = make_production_plan(batch_size, page_size, steps)
    floor_plan = make_plan(Config(batch_size, page_size), steps)
    impls: list[Production] = [make(plan) for make in implementations_carrying(columns)]
    floor = FloorStep(floor_plan, sampling=columns == "sampling")
    names = [impl.name for impl in impls] + [floor.name]
    phases = {**{impl.name: PHASES for impl in impls}, floor.name: PLAIN_PHASES}
    blocks: list[dict[str, dict[str, list[int]]]] = []
    scratch: dict[str, list[int]] = {phase: [] for phase in (*PLAIN_PHASES, "step")}
    for index, (turn, join) in enumerate(zip(plan.turns, floor_plan.steps, strict=True)):
        if index >= warmup and (index - warmup) % repeats == 0:
            blocks.append({name: {p: [] for p in (*phases[name], "step")} for name in names})
        for which in (*range(index % 3, 3), *range(index % 3)):  # rotate who goes first
            if which == len(impls):
                timed_step(floor, join, scratch if index < warmup else blocks[-1][floor.name])
            elif index < warmup:
                run_turn(impls[which], turn)
            else:
                _timed_turn(impls[which], turn, blocks[-1][impls[which].name])
    hits = impls[0].hits
    del impls, floor
    gc.collect()
    best = by_role(
        {
            name: {
                phase: min(statistics.median(block[name][phase]) for block in blocks) / 1e3
                for phase in blocks[0][name]
            }
            for name in names
        }
    )
    step = {name: times["step"] for name, times in best.items()}
    return {
        "batch_size": batch_size,
        "page_size": page_size,
        "best_us": best,
        "a_over_b": step["batchstate"] / step["mutable"],
        "a_over_c": step["batchstate"] / step["floor"],
        "hit_rate": hits / steps,
    }


def run(
    sizes: Sequence[int],
    pages: Sequence[int],
    repeats: int,
    warmup: int,
    rounds: int,
    *,
    quiet: bool = False,
    columns: BaselineColumns = "none",
) -> list[dict[str, Any]]:
    """Time every (page size, batch size) point."""
    points = []
    for page_size in pages:
        for batch_size in sizes:
            points.append(time_point(batch_size, page_size, repeats, warmup, rounds, columns))
            if not quiet:
                print(text_table(points[-1:]).splitlines()[-1], flush=True)
    return points


def text_table(points: Sequence[dict[str, Any]]) -> str:
    """The production step table as markdown."""
    lines = [
        "| page | batch | (a) batchstate µs | (b) mutable µs | (c) plain floor µs | a/b | a/c"
        " | cache hits |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for point in points:
        cells = [f"{point['best_us'][name]['step']:.0f}" for name in _NAMES]
        lines.append(
            f"| {point['page_size']} | {point['batch_size']} | {' | '.join(cells)}"
            f" | {point['a_over_b']:.2f} | {point['a_over_c']:.2f}"
            f" | {point['hit_rate']:.0%} |"
        )
    return "\n".join(lines)


def phase_table(points: Sequence[dict[str, Any]]) -> str:
    """Best median µs of each phase, (a) / (b), as markdown."""
    lines = [
        "| page | batch | " + " | ".join(PHASES) + " |",
        "|---:|---:|" + "---:|" * len(PHASES),
    ]
    for point in points:
        best = point["best_us"]
        cells = [
            f"{best['batchstate'][phase]:.0f} / {best['mutable'][phase]:.0f}" for phase in PHASES
        ]
        lines.append(f"| {point['page_size']} | {point['batch_size']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def markdown(points: Sequence[dict[str, Any]]) -> str:
    """The production section's generated tables."""
    return "\n".join(
        [
            "#### Whole production step (best-of-blocks median µs)",
            "",
            text_table(points),
            "",
            "#### Each phase (best-of-blocks median µs: (a) / (b))",
            "",
            phase_table(points),
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=60, help="timed steps per block")
    parser.add_argument("--rounds", type=int, default=3, help="blocks; the best one counts")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--columns",
        choices=("none", "sampling"),
        default="none",
        help="the column set all three carry: none, or each request's sampling parameters",
    )
    parser.add_argument("--docs", action="store_true", help="rewrite docs/performance.md")
    args = parser.parse_args(argv)
    if args.columns != "none" and args.docs:
        parser.error("--docs records the run without columns: drop --columns")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    points = run(
        args.sizes, args.pages, args.repeats, args.warmup, args.rounds, columns=args.columns
    )
    wall = time.perf_counter() - started
    snippet = markdown(points)
    if args.columns != "none":
        snippet = f"All three carry `{args.columns}` columns.\n\n{snippet}"
    print()
    print(snippet)
    print(f"in {wall:.1f} s")
    if args.docs:
        text = _DOC.read_text()
        body = (
            f"{_BEGIN}\n`python -m benchmarks.production --rounds {args.rounds}"
            f" --repeats {args.repeats} --warmup {args.warmup}` (full run {wall:.0f} s):\n\n"
            f"{snippet}{_END}"
        )
        pattern = f"{re.escape(_BEGIN)}.*?{re.escape(_END)}"
        _DOC.write_text(re.sub(pattern, lambda _: body, text, flags=re.S))
        print(f"rewrote {_DOC}")


if __name__ == "__main__":
    main()
