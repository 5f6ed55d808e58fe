"""Count, or forbid, device-to-host reads inside a block of host code.

A scheduler keeps CPU mirrors so that its host code never waits for the
device. `device_reads()` checks that it does not: inside the block, every
torch op runs through a `TorchDispatchMode` that recognises the ops that make
the host wait for device data, and records each one with its op and where it
was called from. It works on any code, an engine's own scheduler included,
not only on batchstate's transitions.

The module holds the rules first (which aten ops read, and on which
arguments: `classify`, each rule checked against what torch's dispatcher
passes for the host code that makes the read; only reads of data on a
non-CPU device count), then the audit that applies them.
"""

from __future__ import annotations

import contextlib
import enum
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import FrameType
from typing import Final, final

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchstate.base.errors import Error

__all__ = [
    "DeviceRead",
    "DeviceReadError",
    "DeviceReadLog",
    "DeviceReadReport",
    "ReadKind",
    "device_reads",
    "permitted_reads",
]


class ReadKind(enum.Enum):
    """Why an op makes the host wait for the device."""

    SCALAR = "scalar"  # a Python value from device data
    COPY = "copy"  # device data copied into a CPU tensor
    SHAPE = "shape"  # an output shape that depends on device data


def classify(
    func: torch._ops.OpOverload, args: Sequence[object], kwargs: dict[str, object]
) -> tuple[ReadKind, torch.device] | None:
    """The kind of read `func` makes on these arguments, and the device it reads; None if none."""
    name = func.overloadpacket.__name__
    if name == "_to_copy":
        source, target = _tensor_at(args, 0), kwargs.get("device")
        if source is None or not isinstance(target, torch.device):
            return None
        return _read_if(ReadKind.COPY, source.device, target.type == "cpu")
    if name == "copy_":
        target_tensor, source = _tensor_at(args, 0), _tensor_at(args, 1)
        if target_tensor is None or source is None:
            return None
        return _read_if(ReadKind.COPY, source.device, target_tensor.device.type == "cpu")
    kind = _READ_OPS.get(name)
    if kind is None and name in _BOOL_INDEX_OPS:
        kind = ReadKind.SHAPE if _has_bool_index(args) else None
    if kind is None and name == "repeat_interleave":
        kind = ReadKind.SHAPE if kwargs.get("output_size") is None else None
    if kind is None:
        return None
    device = _first_device(args)
    return None if device is None else _read_if(kind, device, True)


def _read_if(
    kind: ReadKind, device: torch.device, condition: bool
) -> tuple[ReadKind, torch.device] | None:
    return (kind, device) if condition and device.type != "cpu" else None


def _tensor_at(args: Sequence[object], position: int) -> torch.Tensor | None:
    item = args[position] if len(args) > position else None
    return item if isinstance(item, torch.Tensor) else None


def _first_device(args: Sequence[object]) -> torch.device | None:
    # The first non-CPU tensor among the arguments (and inside list arguments).
    for item in _flat(args):
        if item.device.type != "cpu":
            return item.device
    return None


def _has_bool_index(args: Sequence[object]) -> bool:
    # `index`/`index_put_` take (self, indices: list[Tensor | None], ...).
    indices = args[1] if len(args) > 1 else None
    return isinstance(indices, list | tuple) and any(
        isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
        for index in indices
    )


def _flat(args: Sequence[object]) -> Iterator[torch.Tensor]:
    for item in args:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, list | tuple):
            yield from (inner for inner in item if isinstance(inner, torch.Tensor))


# Ops whose result depends on device data in a way the host must wait for.
_READ_OPS: Final[dict[str, ReadKind]] = {
    "_local_scalar_dense": ReadKind.SCALAR,
    "equal": ReadKind.SCALAR,
    "allclose": ReadKind.SCALAR,
    "nonzero": ReadKind.SHAPE,
    "nonzero_numpy": ReadKind.SHAPE,
    "_unique": ReadKind.SHAPE,
    "_unique2": ReadKind.SHAPE,
    "unique_dim": ReadKind.SHAPE,
    "unique_consecutive": ReadKind.SHAPE,
    "unique_dim_consecutive": ReadKind.SHAPE,
    "masked_select": ReadKind.SHAPE,
    "bincount": ReadKind.SHAPE,
}
# Indexing ops that turn a bool mask into indices (a `nonzero`) first.
_BOOL_INDEX_OPS: Final = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


# Count, or forbid, device-to-host reads inside a block of host code.
#
# A scheduler keeps CPU mirrors so that its host code never waits for the
# device. `device_reads()` checks that it does not: inside the block, every
# torch op runs through a `TorchDispatchMode` that recognises the ops that
# make the host wait for device data, and records each one with its op and
# where it was called from. It works on any code, an engine's own scheduler
# included, not only on batchstate's transitions.
#
# What counts as a read (each verified against torch's dispatcher):
#
# | kind | how host code writes it | op the dispatcher sees |
# |---|---|---|
# | scalar | `.item()`, `int(t)`, `bool(t)`, `if t.any():`, `x in t` | `_local_scalar_dense` |
# | scalar | `torch.equal`, `torch.allclose` | `equal`, `allclose` |
# | copy | `.cpu()`, `.tolist()`, `.to("cpu")` | `_to_copy` to the CPU |
# | copy | `cpu_tensor.copy_(t)` | `copy_` into a CPU tensor |
# | shape | `nonzero`, `argwhere`, `torch.where(mask)` | `nonzero` |
# | shape | `unique` and its variants | `_unique2`, `unique_dim`, ... |
# | shape | `masked_select` | `masked_select` |
# | shape | `t[mask]`, `t[mask] = v` (a bool index) | `index`, `index_put_` |
# | shape | `repeat_interleave(t, repeats)` without `output_size`, `bincount` | same |
#
# Only reads of data on a non-CPU device count: ops on CPU tensors are host
# work. The `meta` device counts, which is what makes it a proof on a machine
# without a GPU: a read there has no data to return and raises, and in forbid
# mode the audit raises `DeviceReadError` first, naming the op and the line.
#
# Not seen: waits that read no tensor (`torch.cuda.synchronize()`, an event's
# `synchronize()`) and custom kernels that read device memory from the host.
# On CUDA, `torch.cuda.set_sync_debug_mode("error")` catches those.
#
# >>> import torch
# >>> seq_lens = torch.tensor([3, 5])  # CPU: host work, not a read
# >>> with device_reads(forbid=True) as log:
# ...     total = int(seq_lens.sum())
# >>> log.report().count
# 0


@final
@attrs.frozen
class DeviceRead:
    """One device-to-host read: the op, the device it read from, and where.

    `location` is the innermost caller outside torch and this module, as
    `folder/file.py:line in function`; `stack` holds up to `stack_depth`
    such frames, innermost first. `permitted` is the reason given to an
    enclosing `permitted_reads`, or None.
    """

    op: str
    kind: ReadKind
    device: str
    location: str
    stack: tuple[str, ...]
    permitted: str | None = None

    def __str__(self) -> str:
        why = f" (permitted: {self.permitted})" if self.permitted else ""
        return f"{self.kind.value} read {self.op} from {self.device} at {self.location}{why}"


@final
@attrs.frozen
class DeviceReadReport:
    """Every read seen inside a `device_reads` block, in order."""

    reads: tuple[DeviceRead, ...]

    @property
    def count(self) -> int:
        """Reads of every kind, permitted ones included."""
        return len(self.reads)

    @property
    def forbidden(self) -> tuple[DeviceRead, ...]:
        """The reads that no `permitted_reads` block allowed."""
        return tuple(read for read in self.reads if read.permitted is None)

    def __str__(self) -> str:
        if not self.reads:
            return "no device reads"
        lines = [f"{self.count} device read(s):", *(f"  {read}" for read in self.reads)]
        return "\n".join(lines)


class DeviceReadError(Error, RuntimeError):
    """A device-to-host read inside `device_reads(forbid=True)`.

    A `RuntimeError`, the class torch itself raises for a read it cannot
    do (an `.item()` on `meta`), so callers that already handle those
    catch this one too.
    """

    def __init__(self, read: DeviceRead) -> None:
        stack = "\n".join(f"  {frame}" for frame in read.stack)
        super().__init__(f"forbidden {read}\n{stack}")
        self.read = read


@final
class DeviceReadLog:
    """The reads of one `device_reads` block so far; `report()` freezes them."""

    __slots__ = ("_reads",)

    def __init__(self) -> None:
        self._reads: list[DeviceRead] = []

    @property
    def count(self) -> int:
        """Reads recorded so far, permitted ones included."""
        return len(self._reads)

    def report(self) -> DeviceReadReport:
        """The reads recorded so far, as a frozen report."""
        return DeviceReadReport(tuple(self._reads))

    def _record(self, read: DeviceRead) -> None:
        self._reads.append(read)


@contextmanager
def device_reads(*, forbid: bool = False, stack_depth: int = 4) -> Iterator[DeviceReadLog]:
    """Record every device-to-host read in the block; with `forbid`, raise on the first.

    Args:
        forbid: raise `DeviceReadError` at a read (before it runs), unless
            it is inside `permitted_reads`.
        stack_depth: caller frames kept per read, innermost first.

    Yields:
        A `DeviceReadLog`; call `report()` on it, inside or after the block.

    Raises:
        DeviceReadError: with `forbid`, at the first read not permitted.

    NOTE: every op in the block goes through Python, so the block runs
    slower; audit in tests and debug runs, not in production.
    """
    log = DeviceReadLog()
    with _AuditMode(log, forbid=forbid, stack_depth=stack_depth):
        yield log


@contextmanager
def permitted_reads(reason: str) -> Iterator[None]:
    """Mark the reads in the block as intended: recorded with `reason`, never forbidden.

    For the few reads a design needs, such as the speculative `sync`. It
    also lifts `torch.cuda.set_sync_debug_mode` for the block, so an engine
    run under `"error"` gets through its intended syncs. Outside both it
    does nothing.
    """
    token = _PERMITTED.set(reason)
    debug_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if debug_mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if debug_mode:
            torch.cuda.set_sync_debug_mode(debug_mode)
        _PERMITTED.reset(token)


class _AuditMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves its hooks unannotated
    # Sees every aten op after autograd, before the backend runs it: in time
    # to refuse a read that would otherwise block, or raise on `meta`.

    def __init__(self, log: DeviceReadLog, *, forbid: bool, stack_depth: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # as above
        self._log = log
        self._forbid = forbid
        self._stack_depth = stack_depth

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        found = classify(func, args, kwargs)
        if found is not None:
            kind, device = found
            stack = _callers(self._stack_depth)
            read = DeviceRead(
                str(func), kind, str(device), stack[0], stack, permitted=_PERMITTED.get()
            )
            self._log._record(read)
            if self._forbid and read.permitted is None:
                raise DeviceReadError(read)
        return func(*args, **kwargs)


def _callers(depth: int) -> tuple[str, ...]:
    # Frames outside torch, contextlib and this module, innermost first.
    frames: list[str] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and len(frames) < max(depth, 1):
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIPPED_PREFIXES) and filename != __file__:
            frames.append(f"{_short(filename)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return tuple(frames) or ("<unknown>",)


def _short(filename: str) -> str:
    # From the project folder that holds the file (batchstate/transitions/decoding.py,
    # tests/engine/test_x.py), else the file and its folder.
    parts = Path(filename).parts
    tops = [i for i, part in enumerate(parts) if part in _PROJECT_FOLDERS]
    return "/".join(parts[tops[-1] if tops else -2 :])


_PROJECT_FOLDERS: Final = frozenset({"batchstate", "tests", "benchmarks", "tools"})
_SKIPPED_PREFIXES: Final = (
    str(Path(torch.__file__).parent),
    contextlib.__file__,
)
_PERMITTED: Final[ContextVar[str | None]] = ContextVar("batchstate_permitted_read", default=None)
