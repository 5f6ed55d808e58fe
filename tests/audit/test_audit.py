"""The device-read audit: what it counts, what it leaves alone, and how it reports."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import attrs
import pytest
import torch

from batchstate.audit import (
    DeviceRead,
    DeviceReadError,
    DeviceReadReport,
    ReadKind,
    device_reads,
    permitted_reads,
)

META = torch.device("meta")
Read = Callable[[torch.Tensor], object]


def _index_put_mask(tensor: torch.Tensor) -> None:
    copy = tensor.clone()
    copy[copy > 1] = 0


# Each way host code reads device data, with the op the dispatcher shows for it.
READS: list[tuple[str, Read, str, ReadKind]] = [
    ("item", lambda t: t[0].item(), "_local_scalar_dense", ReadKind.SCALAR),
    ("int", lambda t: int(t[0]), "_local_scalar_dense", ReadKind.SCALAR),
    ("bool", lambda t: bool(t[0] > 0), "_local_scalar_dense", ReadKind.SCALAR),
    ("if_any", lambda t: 1 if (t > 2).any() else 0, "_local_scalar_dense", ReadKind.SCALAR),
    ("equal", lambda t: torch.equal(t, t), "equal", ReadKind.SCALAR),
    ("cpu", lambda t: t.cpu(), "_to_copy", ReadKind.COPY),
    ("tolist", lambda t: t.tolist(), "_to_copy", ReadKind.COPY),
    ("to_cpu", lambda t: t.to("cpu"), "_to_copy", ReadKind.COPY),
    ("to_cpu_non_blocking", lambda t: t.to("cpu", non_blocking=True), "_to_copy", ReadKind.COPY),
    ("copy_into_cpu", lambda t: torch.empty(4, dtype=t.dtype).copy_(t), "copy_", ReadKind.COPY),
    ("nonzero", lambda t: t.nonzero(), "nonzero", ReadKind.SHAPE),
    ("where_mask", lambda t: torch.where(t > 1), "nonzero", ReadKind.SHAPE),
    ("unique", torch.unique, "_unique2", ReadKind.SHAPE),
    ("masked_select", lambda t: t.masked_select(t > 1), "masked_select", ReadKind.SHAPE),
    ("bool_index", lambda t: t[t > 1], "index", ReadKind.SHAPE),
    # A CPU scalar may sit beside device tensors: the device tensor after it is what is read.
    (
        "masked_select_cpu_scalar",
        lambda t: torch.masked_select(torch.tensor(5), t > 1),
        "masked_select",
        ReadKind.SHAPE,
    ),
    # meta does not raise for this one: only the audit sees it.
    ("bool_index_put", _index_put_mask, "index_put_", ReadKind.SHAPE),
    ("repeat_interleave", lambda t: t.repeat_interleave(t), "repeat_interleave", ReadKind.SHAPE),
    ("bincount", torch.bincount, "bincount", ReadKind.SHAPE),
]

# Device work that never waits for data: the decode path is made of these.
NOT_READS: list[tuple[str, Read]] = [
    ("index_select", lambda t: t.index_select(0, torch.tensor([1, 0], device=t.device))),
    ("cat", lambda t: torch.cat((t, t))),
    ("add_scalar", lambda t: t + 1),
    ("int_index_put", lambda t: t.clone().index_put_((t[:2],), t[:2])),
    ("masked_fill", lambda t: t.masked_fill(t > 1, 0)),
    ("sized_repeat", lambda t: t.repeat_interleave(t, output_size=6)),
    ("nonzero_static", lambda t: torch.nonzero_static(t, size=4)),
    ("host_to_device", lambda t: torch.arange(4).to(t.device)),
    ("dtype_cast", lambda t: t.to(torch.float64)),  # a `_to_copy` with no device: stays put
    # A list of tensors in second place, one of them bool: only indexing ops read a mask.
    ("bool_in_a_foreach", lambda t: torch._foreach_mul([t.float()], [t > 1])),
    ("shape", lambda t: (t.shape[0], len(t))),
]


def _meta_tensor() -> torch.Tensor:
    return torch.arange(4, device=META)


@pytest.mark.parametrize(("name", "read", "op", "kind"), READS, ids=[r[0] for r in READS])
def test_forbid_names_each_read_before_it_runs(
    name: str, read: Read, op: str, kind: ReadKind
) -> None:
    """In forbid mode each read raises DeviceReadError with its op, kind and device."""
    tensor = _meta_tensor()
    with device_reads(forbid=True) as log, pytest.raises(DeviceReadError) as caught:
        read(tensor)
    found = caught.value.read
    assert found.op.split(".")[1] == op
    assert found.kind is kind
    assert found.device == "meta"
    assert found.location == found.stack[0]
    assert found.permitted is None
    assert log.report().reads == (found,)


@pytest.mark.parametrize(("name", "read", "op", "kind"), READS, ids=[r[0] for r in READS])
def test_forbid_locates_each_read_in_the_calling_file(
    name: str, read: Read, op: str, kind: ReadKind
) -> None:
    """The location a forbidden read names is this file, where the read was written."""
    with pytest.raises(DeviceReadError) as caught, device_reads(forbid=True):
        read(_meta_tensor())
    assert caught.value.read.location.startswith("tests/audit/test_audit.py:")


@pytest.mark.parametrize(("name", "read", "op", "kind"), READS, ids=[r[0] for r in READS])
def test_count_mode_records_and_lets_the_read_run(
    name: str, read: Read, op: str, kind: ReadKind
) -> None:
    """Count mode records the read, then torch runs it: on meta, with no data, that fails."""
    tensor = _meta_tensor()
    with device_reads() as log, contextlib.suppress(RuntimeError, NotImplementedError):
        read(tensor)  # meta has no data to give: torch raises after the audit counted the read
    assert [(found.op.split(".")[1], found.kind) for found in log.report().reads] == [(op, kind)]


@pytest.mark.parametrize(("name", "read", "op", "kind"), READS, ids=[r[0] for r in READS])
def test_reads_of_cpu_tensors_are_host_work(name: str, read: Read, op: str, kind: ReadKind) -> None:
    """The same calls on CPU tensors are not device reads."""
    with device_reads(forbid=True) as log:
        read(torch.arange(4))
    assert log.count == 0


@pytest.mark.parametrize(("name", "work"), NOT_READS, ids=[r[0] for r in NOT_READS])
def test_device_work_that_waits_for_nothing_is_not_a_read(name: str, work: Read) -> None:
    """Ops whose output shape and values stay on the device pass a forbidding audit."""
    with device_reads(forbid=True) as log:
        work(_meta_tensor())
    assert log.count == 0


def test_permitted_reads_are_counted_not_forbidden() -> None:
    """A read inside permitted_reads is recorded with its reason and does not raise."""
    tensor = _meta_tensor()
    with device_reads(forbid=True) as log:
        with permitted_reads("the one sync"), pytest.raises(NotImplementedError):
            tensor.cpu()
        with pytest.raises(DeviceReadError):
            tensor.cpu()  # outside the block, forbidden again
    report = log.report()
    assert [read.permitted for read in report.reads] == ["the one sync", None]
    assert report.forbidden == report.reads[1:]


def test_nested_audits_both_see_a_read() -> None:
    """An engine's audit and an inner one each record the same read."""
    with device_reads() as outer, device_reads() as inner, pytest.raises(RuntimeError):
        int(_meta_tensor()[0])
    assert outer.count == inner.count == 1


def test_stack_depth_limits_the_frames_kept() -> None:
    """Each read keeps at most `stack_depth` caller frames, innermost first, outside torch."""

    def helper(tensor: torch.Tensor) -> object:
        return tensor.tolist()

    with device_reads(stack_depth=2) as log, pytest.raises(NotImplementedError):
        helper(_meta_tensor())
    (read,) = log.report().reads
    assert len(read.stack) == 2
    assert read.stack[0].endswith(" in helper")
    assert read.stack[1].endswith(" in test_stack_depth_limits_the_frames_kept")


def test_report_renders_as_a_short_list() -> None:
    """The report is a frozen record and prints one line per read."""
    read = DeviceRead(
        "aten._local_scalar_dense.default",
        ReadKind.SCALAR,
        "cuda:0",
        "engine/sched.py:42 in plan",
        ("engine/sched.py:42 in plan",),
    )
    permitted = attrs.evolve(read, kind=ReadKind.COPY, op="aten._to_copy.default", permitted="sync")
    report = DeviceReadReport((read, permitted))
    assert str(report) == (
        "2 device read(s):\n"
        "  scalar read aten._local_scalar_dense.default from cuda:0"
        " at engine/sched.py:42 in plan\n"
        "  copy read aten._to_copy.default from cuda:0"
        " at engine/sched.py:42 in plan (permitted: sync)"
    )
    assert str(DeviceReadReport(())) == "no device reads"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        report.reads = ()  # type: ignore[misc]  # frozen: the check is the point
    deep = attrs.evolve(read, stack=("engine/sched.py:42 in plan", "engine/loop.py:7 in step"))
    error = DeviceReadError(deep)
    assert isinstance(error, RuntimeError)
    assert error.read is deep
    assert str(error) == (
        f"forbidden {deep}\n  engine/sched.py:42 in plan\n  engine/loop.py:7 in step"
    )
