"""Plot a run: batch size, KV usage and step time over the steps (needs matplotlib)."""

from __future__ import annotations

import errno
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstate.engine._simulate import Simulation

__all__ = ["check_plot_path", "plot_run", "require_matplotlib"]


def require_matplotlib() -> None:
    """Raise `ImportError` with a one-line hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401, PLC0415  (optional dependency, checked on demand)
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'batchstate[plot]'") from None


def check_plot_path(path: Path) -> None:
    """Raise `ValueError` (one line) unless `plot_run` can write `path`; run it before a run.

    The folder must exist and take a new file, and the extension must be a format matplotlib
    can write (asked of matplotlib itself: png, pdf, svg, ...).
    """
    require_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase  # noqa: PLC0415  (optional dependency)

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"--plot {path}: the folder {folder} does not exist")
    if path.is_dir():
        raise ValueError(f"--plot {path}: is a folder; give a file name such as run.png")
    try:  # write a file there (permission bits do not bind root; a read-only mount does)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(
            f"--plot {path}: cannot create a file in {folder}: {_why(error)}"
        ) from None
    extension = path.suffix.lstrip(".").lower()
    if extension not in formats:
        what = f"unsupported format .{extension}" if extension else "no extension"
        raise ValueError(f"--plot {path}: {what}; choose one of {', '.join(formats)}")


def _why(error: OSError) -> str:
    # The folder was just found, so "No such file or directory" would be untrue: it is how
    # a folder that takes no files, such as /proc, refuses one.
    if error.errno == errno.ENOENT:
        return f"the folder exists but takes no new files (the system said: {error.strerror})"
    return error.strerror or str(error)


def plot_run(run: Simulation, path: Path) -> None:
    """Write a three-panel figure of `run` to `path`, in the format its extension names.

    Headless (the Agg backend). Check `path` first with `check_plot_path`.
    """
    import matplotlib  # noqa: PLC0415  (optional dependency)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    trace, pools = run.trace, run.pools
    steps = range(len(trace))
    capacity = pools.num_pages * pools.page_size
    extends = [step for step in steps if trace.is_extend[step]]
    decodes = [step for step in steps if not trace.is_extend[step]]
    figure, (sizes, memory, times) = plt.subplots(3, 1, figsize=(8, 6.4), sharex=True)
    sizes.plot(decodes, [trace.batch_size[s] for s in decodes], linewidth=0.8, label="decode rows")
    sizes.scatter(extends, [trace.batch_size[s] for s in extends], s=4, c="C1", label="extend rows")
    sizes.set_ylabel("batch size")
    sizes.legend(loc="upper right", fontsize="small")
    memory.plot(steps, [100 * used / max(capacity, 1) for used in trace.kv_tokens_used], c="C2")
    memory.set_ylabel("KV in use (%)")
    memory.set_ylim(0, 105)
    times.plot(steps, [1e3 * t for t in trace.step_s], linewidth=0.6, label="step")
    times.plot(steps, [1e3 * t for t in trace.bookkeeping_s], linewidth=0.6, label="bookkeeping")
    times.set_ylabel("time (ms)")
    times.set_yscale("log")
    times.set_xlabel("engine step")
    times.legend(loc="upper right", fontsize="small")
    config = run.config
    figure.suptitle(
        f"batchstate simulate: {len(run.specs)} requests on {config.device},"
        f" page size {pools.page_size}, {capacity} KV tokens"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=64)
    plt.close(figure)
