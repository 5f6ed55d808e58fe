"""The mypy plugin checks a column set where it is declared, as `_read_fields` does at run time.

Every snippet goes through one mypy run (the project's configuration, which
enables `batchstate.mypy_plugin`); each test reads its snippet's errors. The
project's own sets (`NoColumns`, `Sampling`, the tests' and benchmarks') are
checked by the project's mypy run, whose configuration this module asserts.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import tomllib
from typing import Any, Final

import attrs
import numpy as np
import pytest
import torch

from batchstate import (
    ColumnError,
    Columns,
    DeviceOnly,
    HostColumn,
    Mirrored,
    Req,
    build_columns,
    extend,
    idle,
    make_pools,
)
from batchstate.base.mirrored import frozen
from batchstate.base.scalars import SCALAR_NAMES
from tests.docs.test_doc_blocks import ROOT, read_blocks
from tests.typecheck import mypy_errors

# Under xdist, one worker runs every test that runs mypy: one cache, warm after the first.
pytestmark = pytest.mark.xdist_group("mypy")

_PRELUDE: Final = """\
from typing import Any, ClassVar
import attr
import attrs
import numpy as np
import numpy.typing as npt
import torch
from batchstate import Columns, DeviceOnly, HostColumn, Mirrored, Sampling

"""

# A field of each kind the library does not carry: the snippet declares `Bad` with it.
BAD_FIELDS: Final = {
    "tensor": "torch.Tensor",
    "int": "int",
    "optional_mirror": "Mirrored[np.int64] | None",
    "any": "Any",
    "list": "list[float]",
    "tuple_of_columns": "tuple[Mirrored[np.int32], DeviceOnly]",
    "string_mirror": "Mirrored[np.str_]",
    "object_host": "HostColumn[np.object_]",
    "abstract_host": "HostColumn[np.integer[Any]]",
    "long_double": "Mirrored[np.longdouble]",
    "array_of_any": "npt.NDArray[Any]",
    "column_set": "Sampling",
}

# Every kind the library carries, every scalar type it admits, and the names they go by.
GOOD_FIELDS: Final = {
    "device_only": "DeviceOnly",
    "bare_mirror": "Mirrored",
    "ndarray": "npt.NDArray[np.float32]",
    "platform_sized": "Mirrored[np.intp]",
    "c_int": "HostColumn[np.intc]",
    "double": "Mirrored[np.double]",
    **{f"mirrored_{name}": f"Mirrored[np.{name}]" for name in SCALAR_NAMES},
    **{f"host_{name}": f"HostColumn[np.{name}]" for name in SCALAR_NAMES},
}

DECORATED: Final = {
    "frozen": ("@attrs.frozen(eq=False)", True),
    "attr_frozen": ("@attr.frozen", True),
    "define_frozen": ("@attrs.define(frozen=True)", True),
    "attr_s_frozen": ("@attr.s(frozen=True, auto_attribs=True)", True),
    "define": ("@attrs.define(eq=False)", False),
    "mutable": ("@attrs.mutable", False),
    "attr_s": ("@attr.s(auto_attribs=True)", False),
    "undecorated": ("", False),
}


def _bad(annotation: str) -> str:
    fields = f"    fine: DeviceOnly\n    wrong: {annotation}\n"
    return f"@attrs.frozen(eq=False)\nclass Bad(Columns):\n{fields}"


def _snippets() -> dict[str, str]:
    snippets = {f"bad_{name}": _bad(annotation) for name, annotation in BAD_FIELDS.items()}
    fields = "".join(f"    {name}: {annotation}\n" for name, annotation in GOOD_FIELDS.items())
    snippets["good_every_kind"] = (
        "@attrs.frozen(eq=False)\nclass Good(Columns):\n"
        f"{fields}    not_a_field: ClassVar[int] = 3\n\n"
        # A set extending another is checked on its own fields; its forward reference
        # resolves before the check.
        "@attrs.frozen(eq=False)\nclass Wider(Good):\n    later: 'Later'\n    extra: DeviceOnly\n\n"
        "Later = Mirrored[np.int8]\n"
    )
    snippets["bad_extension"] = (
        "@attrs.frozen(eq=False)\nclass Base(Columns):\n    fine: DeviceOnly\n\n"
        "@attrs.frozen(eq=False)\nclass Wider(Base):\n    wrong: torch.Tensor\n"
    )
    for name, (decorator, _) in DECORATED.items():
        snippets[f"decorated_{name}"] = (
            f"{decorator}\nclass Lora(Columns):\n    a: Mirrored[np.int32]\n"
        )
    # A plain attrs base (not a column set): attrs makes its fields the set's fields.
    snippets["inherited_plain_field"] = (
        "@attrs.frozen\nclass Base:\n    note: int\n\n"
        "@attrs.frozen(eq=False)\nclass Bad(Base, Columns):\n    tag: HostColumn[np.int64]\n\n"
        "class Plain:\n    hint: int\n\n"  # not attrs: its annotation is no field
        "@attrs.frozen(eq=False)\nclass Fine(Plain, Columns):\n    tag: HostColumn[np.int64]\n\n"
        "@attrs.frozen(eq=False)\nclass ColumnBase:\n    more: DeviceOnly\n\n"
        "@attrs.frozen(eq=False)\nclass AlsoFine(ColumnBase, Columns):\n    tag: DeviceOnly\n"
    )
    snippets["undecorated_extension"] = (
        "@attrs.frozen(eq=False)\nclass Base(Columns):\n    a: DeviceOnly\n\n"
        "class Wider(Base):\n    b: DeviceOnly\n"
    )
    return snippets


@functools.cache
def _errors() -> dict[str, list[str]]:
    return mypy_errors({name: _PRELUDE + code for name, code in _snippets().items()})


@pytest.mark.parametrize("name", sorted(BAD_FIELDS))
def test_a_field_that_is_no_column_is_an_error_naming_it(name: str) -> None:
    """One error, on the bad field, naming the set, the field and what a column is."""
    errors = _errors()[f"bad_{name}"]
    assert len(errors) == 1, errors
    (error,) = errors
    assert error.startswith("Bad.wrong: "), error
    assert error.endswith("[column-set]"), error
    kinds = "a column is Mirrored[S], DeviceOnly or HostColumn[S]"
    scalars = "[S] with S one of np.bool_, np.int8,"
    assert kinds in error or scalars in error, error


def test_every_column_kind_and_scalar_type_is_accepted() -> None:
    assert _errors()["good_every_kind"] == []


def test_a_set_extending_another_is_checked_on_its_own_fields() -> None:
    assert _errors()["bad_extension"] == [
        'Wider.wrong: a column is Mirrored[S], DeviceOnly or HostColumn[S], got "Tensor"'
        "  [column-set]"
    ]


def test_a_field_inherited_from_a_plain_attrs_base_is_checked_too() -> None:
    """attrs makes `Base.note` a field of `Bad`; the run time refuses it, and so does mypy."""
    assert _errors()["inherited_plain_field"] == [
        "Bad.note (a field of Base): a column is Mirrored[S], DeviceOnly or HostColumn[S],"
        ' got "int"  [column-set]'
    ]

    @attrs.frozen
    class Base:
        note: int

    @attrs.frozen(eq=False)
    class Bad(Base, Columns):  # type: ignore[column-set]  # the mistake, on purpose
        tag: HostColumn[np.int64]

    with pytest.raises(ColumnError, match=r"Bad\.note: a column is"):
        pools = make_pools(2, 8, 8, torch.device("cpu"))
        tags = Bad(1, frozen(np.ones(1, np.int64)))
        extend(idle("cpu", Bad), [Req(0, (1, 2))], pools, tags)


@pytest.mark.parametrize("name", sorted(DECORATED))
def test_a_set_must_be_a_frozen_attrs_class(name: str) -> None:
    errors = _errors()[f"decorated_{name}"]
    frozen = DECORATED[name][1]
    expected = (
        'Column set "Lora" must be a frozen attrs class of its own'
        " (decorate it with @attrs.frozen(eq=False))  [column-set]"
    )
    assert errors == ([] if frozen else [expected])


def test_a_subclass_of_a_set_needs_its_own_decorator() -> None:
    """mypy and the run time agree: an undecorated subclass would drop its own fields."""
    assert [error for error in _errors()["undecorated_extension"] if "Wider" in error] == [
        'Column set "Wider" must be a frozen attrs class of its own'
        " (decorate it with @attrs.frozen(eq=False))  [column-set]"
    ]

    @attrs.frozen(eq=False)
    class Base(Columns):
        a: DeviceOnly

    class Wider(Base):  # type: ignore[column-set]  # the run-time refusal
        b: DeviceOnly

    with pytest.raises(ColumnError, match=r"^Wider: a column set must be an attrs class$"):
        build_columns(Wider, {"a": [1]}, torch.device("cpu"))


# The kinds as values: subscripted with a scalar type that a test parameter holds.
_MIRRORED: Final[Any] = Mirrored
_HOST: Final[Any] = HostColumn


def _declare(name: str, **annotations: Any) -> type[Columns]:
    # A frozen column set made at run time, which mypy never sees.
    fields = {field: attrs.field(type=hint) for field, hint in annotations.items()}
    return attrs.make_class(name, fields, bases=(Columns,), frozen=True, eq=False)


@pytest.mark.parametrize("name", SCALAR_NAMES)
def test_the_run_time_builds_every_scalar_type_the_plugin_admits(name: str) -> None:
    scalar = getattr(np, name)
    both = _declare("Both", mirrored=_MIRRORED[scalar], host=_HOST[scalar])
    columns = build_columns(both, {"mirrored": [1, 0], "host": [0, 1]}, torch.device("cpu"))
    assert columns.mirrored.host.dtype == columns.host.dtype == np.dtype(scalar)  # type: ignore[attr-defined]  # a made class
    assert columns.mirrored.device.tolist() == [1, 0]  # type: ignore[attr-defined]  # as above


@pytest.mark.parametrize("scalar", [np.str_, np.object_, np.longdouble, np.integer, np.datetime64])
def test_the_run_time_refuses_the_scalar_types_the_plugin_refuses(scalar: type) -> None:
    refused = _declare("Refused", column=_HOST[scalar])
    with pytest.raises(ColumnError, match=r"^Refused\.column: a column's scalar type is one of"):
        build_columns(refused, {"column": [1]}, torch.device("cpu"))


def test_the_project_checks_itself_with_the_plugin() -> None:
    """pyproject's mypy runs the plugin after returns' (so src, tests, benchmarks, tools)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["plugins"] == ["returns.contrib.mypy.returns_plugin", "batchstate.mypy_plugin"]
    assert {"src", "tests", "benchmarks", "tools"} <= set(config["files"])


def test_the_column_sets_the_docs_declare_pass_the_plugin() -> None:
    """Each python block of README.md and docs/ that declares a set, checked as a module."""
    blocks = [
        block
        for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
        for block in read_blocks(path, path.read_text())
        if block.language == "python" and re.search(r"^class \w+\(Columns\):", block.code, re.M)
    ]
    assert blocks, "no block declares a column set"
    errors = mypy_errors(
        {f"block_{index}": block.program for index, block in enumerate(blocks)}  # after a setup
    )
    assert {name: found for name, found in errors.items() if found} == {}


def test_a_declared_field_type_is_what_the_run_time_reads() -> None:
    """The kinds the plugin accepts are the ones `build_columns` builds."""

    @attrs.frozen(eq=False)
    class Kinds(Columns):
        a: Mirrored[np.intp]
        b: DeviceOnly
        c: HostColumn[np.intc]

    columns = build_columns(
        Kinds, {"a": [1], "b": np.array([2], dtype=np.int32), "c": [3]}, torch.device("cpu")
    )
    assert columns.a.device.dtype == torch.int64
    assert columns.b.device.dtype == torch.int32
    assert columns.c.dtype == np.intc


def test_the_plugin_loads_neither_torch_nor_numpy() -> None:
    """mypy imports the plugin in its own process: it pays for mypy only."""
    code = (
        "import sys, batchstate.mypy_plugin; print('torch' in sys.modules, 'numpy' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]
