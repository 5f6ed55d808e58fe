"""Where the audit says a read was made: the caller frames it keeps, and in what order.

These assertions hold whatever else sits on the stack between the code that
read and torch (a wrapper that instruments the library, the test runner):
they look at this file's frames, at the count, and at frames that must never
appear.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from batchstate.audit import DeviceRead, DeviceReadError, device_reads

THIS_FILE = f"tests/audit/{Path(__file__).name}"


def _unique_in(tensor: torch.Tensor) -> object:
    return torch.unique(tensor)  # torch.unique is Python code in torch: not a caller


def _through(tensor: torch.Tensor) -> object:
    return _unique_in(tensor)


@contextmanager
def _reading_on_entry(tensor: torch.Tensor) -> Iterator[None]:
    tensor.tolist()  # runs inside contextlib's __enter__
    yield


def _entering(tensor: torch.Tensor) -> None:
    with _reading_on_entry(tensor):
        pass


def _forbidden_read(call: Callable[[torch.Tensor], object], stack_depth: int) -> DeviceRead:
    with (
        device_reads(forbid=True, stack_depth=stack_depth) as log,
        pytest.raises(DeviceReadError) as caught,
    ):
        call(torch.arange(4, device="meta"))
    (read,) = log.report().reads
    assert caught.value.read is read
    return read


def _first_line(function: Callable[..., object]) -> str:
    # How the audit names a helper's first body line (each helper reads there or calls on).
    lines, start = inspect.getsourcelines(function)
    body = start + next(i for i, line in enumerate(lines) if line.startswith("def ")) + 1
    return f"{THIS_FILE}:{body} in {function.__name__}"


def _frames_here(call: Callable[[torch.Tensor], object]) -> list[str]:
    # This file's frames among every caller of the read.
    return [frame for frame in _forbidden_read(call, 1000).stack if frame.startswith(THIS_FILE)]


def test_callers_are_kept_innermost_first_from_the_line_that_read() -> None:
    """This file's frames appear as `tests/file.py:line in function`, innermost first."""
    ours = _frames_here(_through)
    assert ours[:2] == [_first_line(_unique_in), _first_line(_through)]
    assert ours[2].endswith(" in _forbidden_read")
    assert ours[3].endswith(" in _frames_here")
    assert ours[4].endswith(" in test_callers_are_kept_innermost_first_from_the_line_that_read")


def test_a_deep_limit_walks_to_the_bottom_of_the_stack() -> None:
    """A limit past the stack's height keeps every caller and stops at the bottom."""
    read = _forbidden_read(_through, stack_depth=1000)
    assert 4 <= len(read.stack) < 1000
    assert "<unknown>" not in read.stack


@pytest.mark.parametrize("call", [_through, _entering], ids=["torch_python_code", "contextlib"])
def test_frames_of_torch_contextlib_and_the_audit_are_never_callers(
    call: Callable[[torch.Tensor], object],
) -> None:
    """The frames between the read and the audit belong to torch, contextlib or the audit."""
    read = _forbidden_read(call, stack_depth=1000)
    assert not [
        frame
        for frame in read.stack
        if frame.startswith(("torch/", "batchstate/audit.py")) or "contextlib.py:" in frame
    ]


def test_a_read_on_entering_a_context_is_located_in_its_generator() -> None:
    """A read in a `@contextmanager`'s set-up names the generator, then the `with`."""
    assert _frames_here(_entering)[:2] == [_first_line(_reading_on_entry), _first_line(_entering)]


@pytest.mark.parametrize(("stack_depth", "kept"), [(0, 1), (1, 1), (2, 2), (3, 3)])
def test_stack_depth_bounds_the_frames_kept(stack_depth: int, kept: int) -> None:
    """At most `stack_depth` frames are kept, and always one; the location is the first."""
    read = _forbidden_read(_through, stack_depth=stack_depth)
    assert len(read.stack) == kept
    assert read.location == read.stack[0]
