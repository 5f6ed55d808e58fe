"""Drive mode refuses, at start and in one line, an SGLang version or server configuration
it does not run (`batchstate.sglang.driven.support`). Skipped when SGLang is not installed."""

from __future__ import annotations

from typing import cast

import pytest

from tests.sglang.needs_sglang import SGLANG_MARKS, SGLANG_MISSING, SGLANG_PRESENT

if not SGLANG_PRESENT:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

import msgspec

from batchstate.errors import Error
from batchstate.sglang import cpu_topology
from batchstate.sglang.driven.support import REFUSED, DriveRefused, check_drive, main

pytestmark = SGLANG_MARKS

# A value of each refused field that turns its feature on.
TURNED_ON = {"_on": True, "_above_one": 2, "_set": "EAGLE"}


def test_sglangs_defaults_are_driven() -> None:
    with cpu_topology() as args:
        check_drive(args)  # the installed 0.5.23, overlap and the radix cache on, chunked prefill
        check_drive(args, version="0.5.23")


def test_another_sglang_version_is_refused_by_name() -> None:
    with cpu_topology() as args, pytest.raises(DriveRefused) as refused:
        check_drive(args, version="0.5.22")
    message = str(refused.value)
    assert "\n" not in message and "SGLang 0.5.22" in message and "0.5.23" in message
    assert DriveRefused.__mro__[1:3] == (Error, ValueError)


@pytest.mark.parametrize("refusal", REFUSED, ids=[r.field for r in REFUSED])
def test_each_configuration_drive_does_not_run_is_refused_in_one_line_naming_its_flag(
    refusal: object,
) -> None:
    from batchstate.sglang.driven.support import Refusal

    assert isinstance(refusal, Refusal)
    value = TURNED_ON[refusal.refused.__name__]
    with cpu_topology() as args:
        changed = msgspec.structs.replace(cast("msgspec.Struct", args), **{refusal.field: value})
        with pytest.raises(DriveRefused) as refused:
            check_drive(changed)
        check_drive(args)  # the published arguments were read, not changed
    message = str(refused.value)
    assert "\n" not in message and refusal.flag in message and repr(value) in message


def test_arguments_without_a_field_drive_reads_are_refused_naming_it() -> None:
    with pytest.raises(DriveRefused, match="'speculative_algorithm'"):
        check_drive(object(), version="0.5.23")


def test_the_command_line_check_reads_sglangs_own_server_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--model-path", "dummy", "--device", "cpu"]) == 0
    assert "runs this SGLang" in capsys.readouterr().out
    assert main(["--model-path", "dummy", "--device", "cpu", "--enable-mixed-chunk"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--enable-mixed-chunk True" in err


def test_the_docs_list_every_refused_flag() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    drive = page.split("### What drive runs, checked at start", 1)[1].split("\n### ", 1)[0]
    assert [r.flag for r in REFUSED if f"`{r.flag}`" not in drive] == []
