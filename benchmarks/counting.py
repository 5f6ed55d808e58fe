"""Count what a block of host code asks of torch and numpy: host ops, kernels, copies, calls.

On a GPU each device kernel is a launch and each host-to-device copy has a
fixed cost, so their counts matter as much as host µs. Run the block with
device tensors on PyTorch's `meta` device: every op still reaches the
dispatcher, none runs, and nothing needs a GPU.

- host torch ops: aten ops whose tensors are all on the CPU;
- device kernels: aten ops touching a device tensor that compute something
  (views, and allocations that write nothing, are free on a GPU and left out);
- host-to-device copies: a CPU tensor copied onto the device;
- numpy calls: calls into numpy's API seen by a profile hook (functions and
  array methods; operators such as `a + 1` and indexing are not calls and
  are not seen, so this is a lower bound).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any, Final

import attrs
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Work", "count_allocations", "count_device_work"]

_ALLOCATIONS: Final = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    }
)
_COPIES: Final = frozenset({torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default})
_NUMPY_DIR: Final = np.__file__.rsplit("/", 1)[0]


@attrs.define
class Work:
    """What a block did, counted."""

    host_ops: int = 0
    kernels: int = 0
    copies: int = 0
    numpy_calls: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(
            self.host_ops + other.host_ops,
            self.kernels + other.kernels,
            self.copies + other.copies,
            self.numpy_calls + other.numpy_calls,
        )


# torch's dispatch-mode base is untyped (its __init__ and __init_subclass__ alike).
class _Classifier(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, work: Work) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's base is untyped
        self.work = work

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        outputs = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        on_device = [tensor.device.type != "cpu" for tensor in (*inputs, *outputs)]
        if not any(on_device):
            self.work.host_ops += 1
        elif func in _COPIES and any(tensor.device.type == "cpu" for tensor in inputs):
            self.work.copies += 1
        elif not (func.is_view or func in _ALLOCATIONS):
            self.work.kernels += 1
        return out


# torch's dispatch-mode base is untyped, as above.
class _Allocations(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, names: list[str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # as above
        self.names = names

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # A return with no alias annotation is a fresh tensor: `copy_`, `fill_` and views
        # return their input's storage (`Tensor(a!)`, `Tensor(a)`), everything else allocates.
        if any(
            argument.alias_info is None and "Tensor" in str(argument.type)
            for argument in func._schema.returns
        ):
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@contextmanager
def count_allocations() -> Iterator[list[str]]:
    """The aten ops of the block that return a newly allocated tensor, on any device, by name.

    From each op's schema: an op whose every tensor return aliases an input
    (in-place writes, `out=` variants, views) allocates nothing. Tensors
    made outside the dispatcher (`torch.from_numpy` of a host array) are
    not seen: they wrap memory numpy allocated.
    """
    names: list[str] = []
    with _Allocations(names):
        yield names


@contextmanager
def count_device_work() -> Iterator[Work]:
    """Count the block's host torch ops, device kernels, host-to-device copies and numpy calls."""
    work = Work()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        caller = frame if event == "c_call" else frame.f_back
        if caller is None or caller.f_code.co_filename.startswith(_NUMPY_DIR):
            return  # numpy calling itself
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            module = getattr(arg, "__module__", None) or ""
            work.numpy_calls += isinstance(owner, np.ndarray) or module.startswith("numpy")
        elif event == "call":
            work.numpy_calls += frame.f_code.co_filename.startswith(_NUMPY_DIR)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        with _Classifier(work):
            yield work
    finally:
        sys.setprofile(previous)
