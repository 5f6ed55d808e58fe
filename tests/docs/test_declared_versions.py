"""The torch pyproject.toml declares admits the releases that are tested, and no untested
minor release (docs/versions.md): installable beside SGLang 0.5.23 (torch 2.14.1) and
vLLM 0.33 (torch 2.14.0), and on the torch the whole suite runs on (2.13.0)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Final

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT: Final = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _requirement(name: str) -> Requirement:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    (found,) = [
        requirement
        for requirement in map(Requirement, project["dependencies"])
        if requirement.name == name
    ]
    return found


@pytest.mark.parametrize(
    "release",
    [
        "2.13.0",  # CI's whole suite (the CPU build)
        "2.14.0",  # vLLM 0.33's pin
        "2.14.1",  # SGLang 0.5.23's pin: CI runs batchstate.sglang's tests on it
    ],
)
def test_the_declared_torch_admits_each_tested_release(release: str) -> None:
    torch = _requirement("torch")
    assert torch.specifier.contains(Version(release)), (str(torch), release)
    # A local build tag (PyTorch's own index: 2.13.0+cpu, 2.14.1+cu130) is the same release.
    assert torch.specifier.contains(Version(f"{release}+cpu")), (str(torch), release)


@pytest.mark.parametrize("release", ["2.12.1", "2.15.0", "3.0.0"])
def test_the_declared_torch_refuses_untested_minor_releases(release: str) -> None:
    torch = _requirement("torch")
    assert not torch.specifier.contains(Version(release)), (str(torch), release)
