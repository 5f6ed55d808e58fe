"""Summaries of the timings: medians, spread, ratios; as a text table, markdown, JSON and a plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from benchmarks.scenario import PHASES, Config

__all__ = ["PANELS", "Point", "markdown", "plot", "summarise", "text_table"]

# One plot panel per timed phase, and the whole step.
PANELS: Final = (*PHASES, "step")
_NAMES: Final = ("batchstate", "mutable", "floor")
_LABELS: Final = {"batchstate": "(a) batchstate", "mutable": "(b) mutable", "floor": "(c) floor"}

# One benchmark point's summary, as JSON-ready data.
Point = dict[str, Any]


def summarise(config: Config, timings: dict[str, dict[str, list[int]]]) -> Point:
    """Median and interquartile range (µs) per implementation and phase, and the step ratios."""
    stats: dict[str, dict[str, dict[str, float]]] = {}
    for name, phases in timings.items():
        stats[name] = {}
        for phase, samples in phases.items():
            q1, _, q3 = statistics.quantiles(samples, n=4)
            stats[name][phase] = {
                "median_us": statistics.median(samples) / 1e3,
                "q1_us": q1 / 1e3,
                "q3_us": q3 / 1e3,
                "samples": len(samples),
            }
    step = {name: stats[name]["step"]["median_us"] for name in stats}
    return {
        "batch_size": config.batch_size,
        "page_size": config.page_size,
        "stats": stats,
        "a_over_b": step["batchstate"] / step["mutable"],
        "a_over_c": step["batchstate"] / step["floor"],
    }


def text_table(points: Sequence[Point]) -> str:
    """The step table as markdown (it reads fine as plain text too)."""
    lines = [
        "| page | batch | (a) batchstate µs | (b) mutable µs | (c) floor µs | a/b | a/c |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for point in points:
        cells = [_median_iqr(point["stats"][name]["step"]) for name in _NAMES]
        lines.append(
            f"| {point['page_size']} | {point['batch_size']} | {' | '.join(cells)}"
            f" | {point['a_over_b']:.2f} | {point['a_over_c']:.2f} |"
        )
    return "\n".join(lines)


def phase_table(points: Sequence[Point]) -> str:
    """Median µs of each phase, (a) / (b) / (c), as markdown."""
    lines = [
        "| page | batch | " + " | ".join(PHASES) + " |",
        "|---:|---:|" + "---:|" * len(PHASES),
    ]
    for point in points:
        cells = [
            " / ".join(f"{point['stats'][name][phase]['median_us']:.0f}" for name in _NAMES)
            for phase in PHASES
        ]
        lines.append(f"| {point['page_size']} | {point['batch_size']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def markdown(points: Sequence[Point], extras: dict[str, Any]) -> str:
    """The results section of docs/performance.md."""
    growth = extras["growth"]
    parts = [
        "#### Whole step (median µs, interquartile range in brackets)",
        "",
        text_table(points),
        "",
        "#### Each phase (median µs: (a) / (b) / (c))",
        "",
        phase_table(points),
        "",
        "#### Growth, memory and allocations",
        "",
        "Growth of (a)'s step time with batch size: "
        + ", ".join(f"page {page}: {growth[page]}" for page in growth)
        + ".",
        "",
        "| per step / per request, page size 1, batch size 64 | (a) batchstate | (b) mutable"
        " | (c) floor |",
        "|---|---:|---:|---:|",
    ]
    for label, key in (
        ("Python heap blocks allocated per step", "blocks"),
        ("host bytes of batch state per request", "host_bytes"),
        ("device bytes of batch state per request", "device_bytes"),
    ):
        row = extras[key]
        parts.append(f"| {label} | " + " | ".join(f"{row[name]:.0f}" for name in _NAMES) + " |")
    parts += ["", *work_table(extras["work"], extras["work_batch_size"])]
    return "\n".join(parts) + "\n"


_WORK: Final = (
    ("host torch ops", "host_ops"),
    ("numpy calls", "numpy_calls"),
    ("device kernels", "kernels"),
    ("host-to-device copies", "copies"),
)


def work_table(
    work: dict[int, dict[str, dict[str, dict[str, float]]]], batch_size: int
) -> list[str]:
    """Per page size and phase: each count as (a) / (b) / (c), markdown lines."""
    lines = [
        f"#### Work per phase at batch size {batch_size} (counted on the meta device;"
        " (a) / (b) / (c))",
        "",
        "| page | phase | " + " | ".join(label for label, _ in _WORK) + " |",
        "|---:|---|" + "---:|" * len(_WORK),
    ]
    for page_size, counts in sorted(work.items()):
        for phase in PANELS:
            cells = [
                " / ".join(f"{counts[name][phase][key]:.0f}" for name in _NAMES) for _, key in _WORK
            ]
            lines.append(f"| {page_size} | {phase} | {' | '.join(cells)} |")
    return lines


def plot(points: Sequence[Point], path: Path) -> None:
    """One panel per phase and one for the whole step: median µs against batch size."""
    import matplotlib  # noqa: PLC0415 (an optional, dev-only dependency)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True)
    styles = {1: "-", 16: "--"}
    colours = {"batchstate": "C0", "mutable": "C1", "floor": "C2"}
    for axis, panel in zip(axes.flat, PANELS, strict=True):
        for page_size, style in styles.items():
            rows = [point for point in points if point["page_size"] == page_size]
            sizes = [point["batch_size"] for point in rows]
            for name in _NAMES:
                medians = [point["stats"][name][panel]["median_us"] for point in rows]
                axis.plot(
                    sizes,
                    medians,
                    style,
                    marker="o",
                    markersize=3,
                    color=colours[name],
                    label=f"{_LABELS[name]}, page {page_size}",
                )
        axis.set_title(panel)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
    for axis in axes[1]:
        axis.set_xlabel("batch size")
    for axis in axes[:, 0]:
        axis.set_ylabel("median µs")
    axes.flat[0].legend(fontsize=7)
    figure.suptitle(
        "batchstate step cost: (a) frozen records, (b) mutable batch, (c) bare tensor ops"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _median_iqr(stats: dict[str, float]) -> str:
    return f"{stats['median_us']:.0f} [{stats['q1_us']:.0f}-{stats['q3_us']:.0f}]"
