"""The `batchstate simulate` command: output, exit codes, and one-line errors."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Final

import pytest

import batchstate
import batchstate.cli
import batchstate.engine._simulate
from batchstate.cli import EXIT_CODES, main
from batchstate.cli._parser import build_parser
from batchstate.engine import OracleResult

DOCS: Final = Path(__file__).resolve().parents[2] / "docs"

# A small, quick run; each test adds what it checks.
SMALL: Final = ["simulate", "--requests", "24", "--no-progress", "--kv-tokens", "512"]


def test_summary_table_reports_a_passing_run(capsys: pytest.CaptureFixture[str]) -> None:
    """A default-shaped run prints the summary with the oracle's pass and conserved pools."""
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    assert out.startswith("batchstate simulate   OK\n")
    assert "oracle              pass (24/24 requests match)" in out
    assert "pool conservation   ok: 32/32 slots, " in out  # free, or cached and evictable


def test_json_output_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    """`--json` prints one JSON object with the summary's numbers and no progress bar."""
    assert main([*SMALL, "--json", "--device", "meta"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["ok"] is True
    assert summary["num_finished"] == summary["num_requests"] == 24
    assert summary["device_reads"] == 0 and summary["oracle_passed"] is None
    assert summary["oracle_s"] is None  # skipped: no time, rather than a tiny one
    assert captured.err == ""


def test_json_times_the_oracle_when_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--json", "--requests", "4"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["oracle_passed"] is True and summary["oracle_s"] > 0


BAD_ARGUMENTS: Final = [
    (["--requests", "-3"], "--requests must be >= 0, got -3"),
    (["--kv-tokens", "64"], "the KV pool is too small for one request"),
    (["--kv-tokens", "100"], "--kv-tokens must be a non-negative multiple of --page-size=16"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu' (choose from 'cpu', "),
    (["--max-reqs", "8"], "--max-reqs 8 is below --max-running 32"),
    (["--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["--max-running", "-1"], "--max-running must be >= 1, got -1"),
    (["--prompt-len", "9", "3"], "--prompt-len needs 1 <= MIN <= MAX, got 9 3"),
    (["--max-context-len", "10"], "--max-context-len 10 is shorter than the longest request"),
    (["--max-running", "x"], "argument --max-running: invalid int value: 'x'"),
    (["--arrival", "sometimes"], "argument --arrival: invalid choice"),
    (["--sampling", "hot"], "argument --sampling: invalid choice: 'hot' (choose from"),
    (["--temperature", "0.7"], "--temperature sets the parameters of --sampling fixed, not"),
    (["--sampling", "mixed", "--top-k", "5"], "--top-k sets the parameters of --sampling"),
    (["--sampling", "fixed", "--temperature", "-1"], "--temperature must be a number >= 0"),
    (["--sampling", "fixed", "--temperature", "inf"], "--temperature must be a number >= 0"),
    (["--sampling", "fixed", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--sampling", "fixed", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--sampling", "fixed", "--top-k", "-2"], "--top-k must be >= 0 (0 keeps every token)"),
    (["--sampling", "fixed", "--min-p", "2"], "--min-p must be in [0, 1], got 2.0"),
    (["--sampling", "fixed", "--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
    (["--plot", ""], "argument --plot: the path is empty; give a file name such as run.png"),
    (
        ["--shared-prefix", "4.5", "32", "0.5"],
        "argument --shared-prefix: COUNT must be a whole number, got '4.5'",
    ),
    (
        ["--shared-prefix", "4", "3e1", "0.5"],
        "argument --shared-prefix: LEN must be a whole number, got '3e1'",
    ),
    (["--shared-prefix", "a", "b", "c"], "COUNT must be a whole number, got 'a'"),
    (["--shared-prefix", "4", "32", "x"], "FRACTION must be a number, got 'x'"),
    (["--shared-prefix", "4", "32", "1.5"], "--shared-prefix FRACTION must be in [0, 1]"),
    (["--cuda-graph-sizes", "4", "2"], "--cuda-graph-sizes: captured sizes must be >= 1"),
    (["--dp", "2", "--device", "meta"], "--dp needs a model device (cpu or cuda)"),
    (["--dp-fault", "1:x"], "argument --dp-fault: expected RANK:STEP or RANK:STEP:hang"),
]


@pytest.mark.parametrize(("args", "message"), BAD_ARGUMENTS)
def test_bad_arguments_get_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad argument exits 2 with a single error line that names it, never a traceback."""
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert " _" not in err and "'_" not in err  # no private helper's name


# Runs every usage error above in one fresh interpreter: each must exit 2 with torch unloaded.
_PROBE: Final = """\
import json, sys
from batchstate.cli import main
for args in json.loads(sys.argv[1]):
    code = main(["simulate", *args])
    print(code, "torch" in sys.modules, flush=True)
"""


def test_every_usage_error_comes_before_torch_loads() -> None:
    """Each option's value is checked (configs, memory, plot path) before torch is imported.

    Importing torch takes seconds (6-28 s were measured on a busy 2-core machine);
    a usage error found before it answers in well under a second.
    """
    cases = [args for args, _ in BAD_ARGUMENTS] + [
        ["--requests", "100000000", "--device", "meta"],
        ["--plot", "missing/run.png"],
    ]
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["2 False"] * len(cases), done.stderr


def test_a_plot_folder_that_cannot_be_written_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--plot` tries a file in its folder first: a read-only one is a usage error, not a run."""
    pytest.importorskip("matplotlib")
    folder = Path("/proc")  # no file can be made there, by root either
    if not folder.is_dir():
        pytest.skip("needs Linux's /proc")

    def must_not_run(*_: object) -> None:
        raise AssertionError("the simulation ran")

    monkeypatch.setattr(batchstate.engine, "simulate", must_not_run)
    assert main([*SMALL, "--plot", str(folder / "run.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchstate simulate: error: --plot /proc/run.png: cannot create a")
    assert err.count("\n") == 1


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Piped (CI, `| tee`), stderr gets a line per phase and every few seconds, no bar."""
    args = ["simulate", "--requests", "24", "--kv-tokens", "512", "--device", "meta"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "engine: 0/24 requests, " in err and "engine: 24/24 requests, " in err
    assert "\r" not in err and "%|" not in err


@pytest.mark.parametrize(
    ("args", "reported"),
    [
        ([], "greedy: 24 greedy, 0 sampled"),
        (["--sampling", "mixed"], "mixed: 4 greedy, 20 sampled (temperature 0.6-1.2, "),
        (
            ["--sampling", "fixed", "--temperature", "0.8", "--top-p", "0.9", "--mixed"],
            "fixed: 0 greedy, 24 sampled (temperature 0.8, top-p 0.9, top-k 0, min-p 0.0)",
        ),
        (["--sampling", "mixed", "--no-prefix-cache", "--chunk-size", "0"], "20 sampled"),
    ],
)
def test_sampling_runs_match_the_oracle_and_report_their_mix(
    args: list[str], reported: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each sampling mix runs, in mixed and whole-prompt modes, and the oracle passes."""
    assert main([*SMALL, "--json", *args]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["oracle_passed"] is True
    assert reported in summary["sampling"]


@pytest.mark.parametrize(
    ("name", "magic"), [("run.png", b"\x89PNG\r\n\x1a\n"), ("run.svg", b"<?xml")]
)
def test_plot_writes_the_format_its_extension_names(
    name: str, magic: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--plot` writes the image after printing the summary, in the extension's format."""
    pytest.importorskip("matplotlib")
    path = tmp_path / name
    assert main([*SMALL, "--device", "meta", "--plot", str(path)]) == 0
    assert path.read_bytes().startswith(magic)
    assert capsys.readouterr().out.startswith("batchstate simulate   OK\n")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing/run.png", "missing/run.png: the folder {tmp}/missing does not exist"),
        ("run.txt", "run.txt: unsupported format .txt; choose one of "),
        ("run", "run: no extension; choose one of "),
        (".", "is a folder"),
    ],
)
def test_a_bad_plot_path_is_a_usage_error_before_any_work(
    name: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A folder that does not exist or a format matplotlib cannot write: exit 2, nothing run."""
    pytest.importorskip("matplotlib")

    def must_not_run(*_: object) -> None:
        raise AssertionError("the simulation ran")

    monkeypatch.setattr(batchstate.engine, "simulate", must_not_run)  # the CLI imports it to run
    assert main([*SMALL, "--plot", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err
    assert err.startswith("batchstate simulate: error: --plot ") and err.count("\n") == 1
    if "choose one of" in message:
        assert "png" in err and "svg" in err and "pdf" in err


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

    def disagree(*_: object, **__: object) -> OracleResult:
        return OracleResult(24, 1, "request 3: engine [1] != alone [2]")

    monkeypatch.setattr(batchstate.engine._simulate, "check_oracle", disagree)
    assert main(SMALL) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("batchstate simulate   FAILED\n")
    assert captured.err == (
        "batchstate simulate: failed the oracle: FAIL (1/24 requests differ;"
        " first: request 3: engine [1] != alone [2])\n"
    )


def test_no_command_prints_usage_and_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    """`batchstate` alone is a usage error that shows how to use it, not a one-word complaint."""
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: batchstate [-h] [-V] COMMAND ...")
    assert "simulate" in err and "exit status:" in err


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_comes_from_the_package_metadata(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([flag]) == 0
    assert capsys.readouterr().out == f"batchstate {version('batchstate')}\n"
    assert batchstate.__version__ == version("batchstate")


def _simulate_parser() -> argparse.ArgumentParser:
    commands = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    parser: argparse.ArgumentParser = commands.choices["simulate"]
    return parser


def test_every_option_has_help_and_shows_its_default_once() -> None:
    """Flags show no default; an option with a value shows one, in words or as its value."""
    parser = _simulate_parser()
    formatter = parser.formatter_class(prog="batchstate simulate")
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        shown = (formatter._get_help_string(action) or "") % {"default": action.default}
        takes_value = action.nargs != 0
        expected = 1 if takes_value and action.dest != "plot" else 0
        assert shown.count("(default") == expected, (action.option_strings, shown)


def test_exit_codes_are_documented_in_the_help_and_the_docs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert [code for code, _ in EXIT_CODES] == [0, 1, 2]
    assert main(["simulate", "--help"]) == 0
    help_text = capsys.readouterr().out
    engine_doc = (DOCS / "engine.md").read_text()
    for code, meaning in EXIT_CODES:
        assert f"  {code}  {meaning}" in help_text
        assert f"| {code} | {meaning} |" in engine_doc


def test_quiet_and_no_progress_are_one_option(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--requests", "2", "--device", "meta", "--kv-tokens", "512"]
    assert main([*args, "-q"]) == 0
    assert main([*args, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_module_runs_the_same_command_line() -> None:
    """`python -m batchstate` is the `batchstate` command."""
    done = subprocess.run(
        [sys.executable, "-m", "batchstate", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"batchstate {version('batchstate')}\n"


def test_console_script_runs() -> None:
    """The installed `batchstate` entry point runs a meta simulation end to end."""
    script = shutil.which("batchstate")
    command = [script] if script else [sys.executable, "-m", "batchstate"]
    done = subprocess.run(
        [*command, *SMALL, "--device", "meta", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
