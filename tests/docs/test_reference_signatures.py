"""The API reference's griffe extension: signatures and docstring sections say only what a
caller can write (no implementation `Any`, no unexported default such as `NO_COLUMNS`)."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import griffe
import pytest
from tools.griffe_signatures import PublicSignatures

import batchstate

SRC: Final = Path(__file__).resolve().parents[2] / "src"


def _load(*extensions: griffe.Extension) -> griffe.Module:
    package = griffe.load(
        "batchstate",
        search_paths=[SRC],
        extensions=griffe.load_extensions(*extensions),
        docstring_parser=griffe.Parser.google,
        allow_inspection=False,
    )
    assert isinstance(package, griffe.Module)
    return package


@pytest.fixture(scope="module")
def package() -> griffe.Module:
    return _load(PublicSignatures())


def _target(package: griffe.Module, name: str) -> object:
    """The object `batchstate.<name>` stands for, in the private module defining it."""
    member = package[name]
    return member.final_target if isinstance(member, griffe.Alias) else member


def _function(package: griffe.Module, name: str) -> griffe.Function:
    function = _target(package, name)
    assert isinstance(function, griffe.Function)
    return function


def _parameters_section(function: griffe.Function) -> list[griffe.DocstringParameter]:
    assert function.docstring is not None
    for section in function.docstring.parsed:
        if isinstance(section, griffe.DocstringSectionParameters):
            return list(section.value)
    return []


def test_without_the_extension_the_docstring_shows_the_implementations_any() -> None:
    """What the extension is for: griffe alone types `extend`'s `columns` as `Any`, with
    the private `NO_COLUMNS` as its default."""
    function = _function(_load(), "extend")
    columns = next(p for p in _parameters_section(function) if p.name == "columns")
    assert str(columns.annotation) == "Any"
    assert str(columns.default) == "NO_COLUMNS"


def test_an_overloaded_functions_sections_take_the_types_its_overloads_agree_on(
    package: griffe.Module,
) -> None:
    function = _function(package, "extend")
    documented = {p.name: p for p in _parameters_section(function)}
    assert str(documented["pools"].annotation) == "Pools"  # the same in every overload
    assert documented["reqs"].annotation is None  # Sequence[Req | Chunked[NoColumns]] or [C]
    assert str(documented["columns"].annotation) == "C"  # only one overload has it
    assert documented["columns"].default is None  # omitted, not defaulted
    assert documented["batch"].annotation is None  # Idle[NoColumns] or Idle[C]
    assert function.returns is None  # the overloads' returns differ


def test_no_public_overloaded_function_documents_any_or_a_private_default(
    package: griffe.Module,
) -> None:
    """Every overloaded function of `batchstate.__all__` (there are several)."""
    overloaded = [
        function
        for name in batchstate.__all__
        if isinstance(function := _target(package, name), griffe.Function) and function.overloads
    ]
    assert len(overloaded) >= 4
    shown = [
        f"{function.name}({parameter.name}: {parameter.annotation} = {parameter.default})"
        for function in overloaded
        for parameter in _parameters_section(function)
        if "Any" in str(parameter.annotation) or "NO_COLUMNS" in str(parameter.default)
    ]
    assert shown == []


def test_a_function_without_overloads_keeps_its_annotations(package: griffe.Module) -> None:
    function = _function(package, "decode")
    assert str(function.returns) == "Result[BatchAndPools[Decoding[C]], DecodeError]"


def test_a_field_defaulting_to_an_unexported_constant_shows_its_value(
    package: griffe.Module,
) -> None:
    columns = package["records.rows.Rows.columns"]
    assert isinstance(columns, griffe.Attribute)
    assert str(columns.value) == "NoColumns()"
