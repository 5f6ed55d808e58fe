"""The `batchstate simulate` command: output, exit codes, and one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import torch

import batchstate.engine._simulate
from batchstate.cli import main
from batchstate.engine import OracleResult

# A small, quick run; each test adds what it checks.
SMALL: Final = ["simulate", "--requests", "24", "--no-progress", "--kv-tokens", "512"]


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    # `main` sets one torch thread on cpu; leave the process as it was.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_summary_table_reports_a_passing_run(capsys: pytest.CaptureFixture[str]) -> None:
    """A default-shaped run prints the summary with the oracle's pass and conserved pools."""
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    assert out.startswith("batchstate simulate   OK\n")
    assert "oracle              pass (24/24 requests match)" in out
    assert "pool conservation   ok: 32/32 slots, 512/512 KV tokens free" in out


def test_json_output_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    """`--json` prints one JSON object with the summary's numbers and no progress bar."""
    assert main([*SMALL, "--json", "--device", "meta"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["ok"] is True
    assert summary["num_finished"] == summary["num_requests"] == 24
    assert summary["device_reads"] == 0 and summary["oracle_passed"] is None
    assert captured.err == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--requests", "-3"], "--requests must be >= 0, got -3"),
        (["--kv-tokens", "64"], "the KV pool is too small for one request"),
        (["--kv-tokens", "100"], "--kv-tokens must be a non-negative multiple of --page-size=16"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--page-size", "0"], "--page-size must be >= 1, got 0"),
        (["--max-running", "-1"], "--max-running must be >= 1, got -1"),
        (["--prompt-len", "9", "3"], "--prompt-len needs 1 <= MIN <= MAX, got 9 3"),
        (["--max-context-len", "10"], "--max-context-len 10 is shorter than the longest request"),
        (["--max-running", "x"], "argument --max-running: invalid int value: 'x'"),
        (["--arrival", "sometimes"], "argument --arrival: invalid choice"),
    ],
)
def test_bad_arguments_get_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad argument exits 2 with a single error line that names it, never a traceback."""
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--plot FILE.png` writes a PNG image of the run."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.png"
    assert main([*SMALL, "--device", "meta", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without matplotlib, `--plot` says how to install it, in one line, before running."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert main([*SMALL, "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "batchstate simulate: error: --plot needs matplotlib: pip install 'batchstate[plot]'\n"
    )


def test_an_oracle_failure_exits_1_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """When the oracle disagrees, the command exits 1 and names the first mismatch."""

    def disagree(*_: object) -> OracleResult:
        return OracleResult(24, 1, "request 3: engine [1] != alone [2]")

    monkeypatch.setattr(batchstate.engine._simulate, "check_oracle", disagree)
    assert main(SMALL) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("batchstate simulate   FAILED\n")
    assert captured.err == (
        "batchstate simulate: failed the oracle: FAIL (1/24 requests differ;"
        " first: request 3: engine [1] != alone [2])\n"
    )


def test_console_script_runs() -> None:
    """The installed `batchstate` entry point runs a meta simulation end to end."""
    script = shutil.which("batchstate")
    command = [script] if script else [sys.executable, "-m", "batchstate.cli"]
    done = subprocess.run(
        [*command, *SMALL, "--device", "meta", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
