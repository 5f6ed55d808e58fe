"""Attach a `Watch` (or a `Shadow`) in a process as soon as SGLang has imported what it wraps.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Literal

ENV_MODE = "BATCHSTATE_SGLANG_WATCH"
"""'raise' or 'log': what the watch does at a divergence; unset, nothing is attached."""
ENV_TRACE_DIR = "BATCHSTATE_SGLANG_TRACE_DIR"
"""Where each process writes its trace, `sglang-trace-PID.jsonl` (a shadow's:
`sglang-shadow-PID.jsonl`, which `batchstate replay` reads)."""
ENV_ATTACH = "BATCHSTATE_SGLANG_ATTACH"
"""'shadow' attaches a `Shadow`; anything else (or unset) a `Watch`."""
ENV_DRIVE = "BATCHSTATE_SGLANG_DRIVE"
"""'1' drives each scheduler with batchstate (`batchstate.sglang.driven`), checked at its
start; nothing else is attached."""
ENV_FULL_CHECK_EVERY = "BATCHSTATE_SGLANG_FULL_CHECK_EVERY"
"""A `Shadow`'s `full_check_every` (a positive integer; unset: 1, every call in full)."""
TARGET = "sglang.srt.managers.schedule_batch"
"""A `Watch` wraps `ScheduleBatch`: it attaches once this module is loaded."""
SHADOW_TARGET = "sglang.srt.managers.scheduler"
"""A `Shadow` also replaces the cache calls the scheduler's modules imported by name:
it attaches once the scheduler module (and so every module it imports) is loaded."""


class _AttachingLoader(importlib.abc.Loader):
    """Runs the real loader, then attaches the watch (or `then`) to what it defined."""

    def __init__(self, loader: importlib.abc.Loader, then: Callable[[], object]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._then()


class AttachAfterImport(importlib.abc.MetaPathFinder):
    """Finds the module `target` names through the other finders and wraps its loader,
    to run `then` (attaching the watch or shadow, by default) once it is loaded; once."""

    def __init__(self, target: str = TARGET, then: Callable[[], object] | None = None) -> None:
        self.target = target
        self.then = _attach if then is None else then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _AttachingLoader(spec.loader, self.then)
        return spec


def _attach() -> None:
    from batchstate.sglang.shadow import Shadow
    from batchstate.sglang.watch import Watch

    shadow = os.environ.get(ENV_ATTACH) == "shadow"
    name = f"sglang-{'shadow' if shadow else 'trace'}-{os.getpid()}.jsonl"
    trace = Path(os.environ.get(ENV_TRACE_DIR, ".")) / name
    mode: Literal["raise", "log"] = "log" if os.environ.get(ENV_MODE) == "log" else "raise"
    # A structure it cannot read never stops the scheduler: logged once, then detached.
    attached: Shadow | Watch
    if shadow:
        every = int(os.environ.get(ENV_FULL_CHECK_EVERY, "1"))  # the launcher checked it
        attached = Shadow(
            on_divergence=mode, trace_path=trace, on_unsupported="detach", full_check_every=every
        )
    else:
        attached = Watch(on_divergence=mode, trace_path=trace, on_unsupported="detach")
    atexit.register(attached.attach().detach)


def _drive() -> None:
    from batchstate.sglang.driven.drive import drive_every_scheduler

    drive_every_scheduler()


def install_from_environment() -> None:
    """Register the import hook when `ENV_DRIVE` or `ENV_MODE` is set; otherwise do nothing."""
    if os.environ.get(ENV_DRIVE) == "1":
        if not any(isinstance(f, AttachAfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, AttachAfterImport(SHADOW_TARGET, _drive))
        return
    if os.environ.get(ENV_MODE) in ("raise", "log") and not any(
        isinstance(f, AttachAfterImport) for f in sys.meta_path
    ):
        shadow = os.environ.get(ENV_ATTACH) == "shadow"
        sys.meta_path.insert(0, AttachAfterImport(SHADOW_TARGET if shadow else TARGET))
