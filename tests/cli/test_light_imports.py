"""The command line's help, version and usage errors, and `import batchstate`, load no torch."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import batchstate
import batchstate.cli._option_groups
import batchstate.cli._parser
from batchstate.base.lazy import typing_imports
from batchstate.engine import ARRIVALS, ATTENTION_KERNELS, DEVICES, SAMPLING_MIXES
from batchstate.engine._ranks import BACKENDS

# Runs the command line in a fresh interpreter, then says which heavy modules it loaded.
_PROBE = """\
import sys
from batchstate.cli import main
code = main(sys.argv[1:])
print(code, sorted(name for name in ("torch", "numpy") if name in sys.modules))
"""


def _loaded(*args: str) -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.stdout.splitlines()[-1], done.stderr


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--help"], 0),
        (["simulate", "--help"], 0),
        (["--version"], 0),
        ([], 2),  # no command: the usage
        (["simulate", "--bogus"], 2),
        (["simulate", "--requests", "x"], 2),
    ],
)
def test_help_version_and_usage_errors_load_no_torch(args: list[str], code: int) -> None:
    line, err = _loaded(*args)
    assert line == f"{code} []", err


def test_a_run_loads_the_engine() -> None:
    """The probe can see torch load: a run (meta, tiny) does load it."""
    line, err = _loaded("simulate", "--device", "meta", "--requests", "2", "-q", "--json")
    assert line == "0 ['numpy', 'torch']", err


def test_importing_the_package_loads_no_torch_until_a_name_is_used() -> None:
    probe = (
        "import sys, batchstate; before = 'torch' in sys.modules; batchstate.make_pools;"
        " print(before, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout == "False True\n"


def test_every_public_name_loads_from_the_module_its_import_names() -> None:
    sources = typing_imports(Path(batchstate.__file__))
    assert set(batchstate.__all__) <= set(sources)
    for name, source in sources.items():
        loaded = getattr(importlib.import_module(source.module), source.name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # old names load too, warning
            assert getattr(batchstate, name) is loaded
    assert set(batchstate.__all__) <= set(dir(batchstate))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'batchstate' has no attribute 'nothing'"):
        batchstate.nothing  # type: ignore[attr-defined]  # noqa: B018


def test_the_cli_choices_are_the_engines() -> None:
    """The parser writes the engine's choices out (to import no engine): they must agree."""
    groups = batchstate.cli._option_groups
    assert (
        groups.ARRIVALS,
        groups.SAMPLING_MIXES,
        groups.DEVICES,
        groups.ATTENTION_KERNELS,
        batchstate.cli._parser.BACKENDS,
    ) == (
        ARRIVALS,
        SAMPLING_MIXES,
        DEVICES,
        ATTENTION_KERNELS,
        BACKENDS,
    )
