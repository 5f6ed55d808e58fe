"""Attach a `Watch` in a process as soon as SGLang's `schedule_batch` module is imported.

`python -m batchstate.sglang.launch` sets the environment below and puts
`_site/sitecustomize.py` on PYTHONPATH, so every Python process SGLang starts
(the scheduler runs in its own process) calls `install_from_environment` at start-up.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ENV_MODE = "BATCHSTATE_SGLANG_WATCH"
"""'raise' or 'log': what the watch does at a divergence; unset, nothing is attached."""
ENV_TRACE_DIR = "BATCHSTATE_SGLANG_TRACE_DIR"
"""Where each process writes its trace, `sglang-trace-PID.jsonl`."""
TARGET = "sglang.srt.managers.schedule_batch"


class _AttachingLoader(importlib.abc.Loader):
    """Runs the real loader, then attaches the watch to the class it defined."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _attach()


class AttachAfterImport(importlib.abc.MetaPathFinder):
    """Finds `TARGET` through the other finders and wraps its loader; once."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _AttachingLoader(spec.loader)
        return spec


def _attach() -> None:
    from batchstate.sglang.watch import Watch

    trace = Path(os.environ.get(ENV_TRACE_DIR, ".")) / f"sglang-trace-{os.getpid()}.jsonl"
    if os.environ.get(ENV_MODE) == "log":
        watch = Watch(on_divergence="log", trace_path=trace).attach()
    else:
        watch = Watch(on_divergence="raise", trace_path=trace).attach()
    atexit.register(watch.detach)


def install_from_environment() -> None:
    """Register the import hook when `ENV_MODE` is set; otherwise do nothing."""
    if os.environ.get(ENV_MODE) in ("raise", "log") and not any(
        isinstance(f, AttachAfterImport) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, AttachAfterImport())
