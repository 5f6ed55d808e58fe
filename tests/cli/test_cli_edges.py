"""`batchstate simulate`'s edges: modes in the JSON, bounds, fast refusals, true messages."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final

import attrs
import pytest
import torch

from batchstate.cli import main
from batchstate.cli._parser import build_parser
from batchstate.cli._values import Switch
from batchstate.engine import (
    DataParallelConfig,
    EngineConfig,
    ModelConfig,
    SimulationConfig,
    WorkloadConfig,
    render_dp_summary,
    summarize_dp,
)
from batchstate.engine import _simulation_config as simulation_config
from batchstate.engine._data_parallel import DataParallelRun, RankRun
from batchstate.engine._simulation_config import gpu_driver_present

# A small, quick run on meta (bookkeeping only); each test adds what it checks.
META: Final = ["simulate", "--requests", "6", "-q", "--kv-tokens", "512", "--device", "meta"]


@pytest.mark.parametrize(
    ("args", "modes"),
    [
        ([], {"model": "full", "chunk_size": 32, "mixed": False, "overlap": True}),
        (
            ["--chunk-size", "0", "--mixed", "--no-overlap", "--model", "hybrid"],
            {"model": "hybrid", "chunk_size": 0, "mixed": True, "overlap": False},
        ),
    ],
)
def test_json_says_which_modes_the_run_had(
    args: list[str], modes: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each mode switch's setting is in the JSON, beside the counts of what it did."""
    assert main([*META, "--json", *args]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {key: summary[key] for key in modes} == modes
    assert summary["prefix_cache"] is True and summary["speculative"] == 0


def test_the_table_names_the_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*META, "--no-overlap", "--chunk-size", "8", "--mixed"]) == 0
    lines = capsys.readouterr().out.splitlines()
    modes = "full model; chunks of 8 tokens, mixed steps on, overlap off"
    assert lines[2] == f"modes               {modes}"


def test_a_data_parallel_summary_says_which_modes_its_ranks_ran() -> None:
    """`--dp N --json` reports the same modes, and the cache and drafts (no row of their own)."""
    engine = EngineConfig(chunk_size=16, mixed=True, overlap=True, speculative=2)
    config = SimulationConfig(engine=engine, model=ModelConfig(), prefix_cache=False)
    rank = RankRun(0, {}, {}, 0, 0, 0, None, 0, 1, True, "32/32 slots free", 0.0)
    run = DataParallelRun(config, DataParallelConfig(1), (), (rank,), 0, 1, {}, 0.0, None, None)
    summary = summarize_dp(run)
    modes = ("model", "prefix_cache", "chunk_size", "mixed", "overlap", "speculative")
    assert {key: attrs.asdict(summary)[key] for key in modes} == {
        "model": "full",
        "prefix_cache": False,
        "chunk_size": 16,
        "mixed": True,
        "overlap": True,
        "speculative": 2,
    }
    assert render_dp_summary(summary).splitlines()[2] == (
        "modes             full model; chunks of 16 tokens, mixed steps on, overlap on,"
        " prefix cache off, speculative 2 drafts per step"
    )


def _simulate_parser() -> argparse.ArgumentParser:
    commands = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    parser: argparse.ArgumentParser = commands.choices["simulate"]
    return parser


def _switches() -> dict[str, Switch]:
    parser = _simulate_parser()
    return {
        action.option_strings[0]: action for action in parser._actions if isinstance(action, Switch)
    }


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--overlap"], {"overlap": True, "mixed": False, "prefix_cache": True}),
        (["--overlap", "--no-overlap"], {"overlap": False}),  # the last one given wins
        (["--no-overlap", "--overlap"], {"overlap": True}),
        (["--no-mixed"], {"mixed": False}),
        (["--mixed", "--no-mixed"], {"mixed": False}),
        (["--prefix-cache"], {"prefix_cache": True}),
        (["--no-prefix-cache"], {"prefix_cache": False}),
    ],
)
def test_a_mode_takes_its_explicit_default_and_its_no_form(
    args: list[str], expected: dict[str, bool], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--overlap` names the default explicitly, as `--no-mixed` and `--prefix-cache` do."""
    assert main([*META, "--json", *args]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {key: summary[key] for key in expected} == expected


def test_the_oracle_takes_both_forms(capsys: pytest.CaptureFixture[str]) -> None:
    cpu = [*META[:-2], "--requests", "2"]
    assert main([*cpu, "--json", "--no-oracle", "--oracle"]) == 0
    assert json.loads(capsys.readouterr().out)["oracle_passed"] is True
    assert main([*cpu, "--json", "--oracle", "--no-oracle"]) == 0
    assert json.loads(capsys.readouterr().out)["oracle"] == "skipped (--no-oracle)"


def test_every_on_off_option_has_both_forms_and_says_its_default() -> None:
    """A `--no-X` flag has its `--X`, and the help says in words which is the default."""
    switches = _switches()
    assert sorted(switches) == ["--mixed", "--oracle", "--overlap", "--prefix-cache"]
    for option, switch in switches.items():
        assert switch.option_strings == [option, f"--no-{option[2:]}"]
        said = "on by default" if switch.default else "off by default"
        assert said in (switch.help or ""), option
    options = {option for action in _simulate_parser()._actions for option in action.option_strings}
    # --no-progress is --quiet's other name: progress has no switch of its own to name.
    lone = {o for o in options if o.startswith("--no-") and f"--{o[5:]}" not in options}
    assert lone == {"--no-progress"}


# Values past what a run holds, bounded by the options they follow from (here the defaults:
# a table row of 48 + 48 tokens, a KV pool of 1024).
BOUNDS: Final = [
    (
        ["--speculative", "100000"],
        "--speculative 100000 is above 95: a verify window holds a row's decode token and its"
        " drafts, and a request's table row (--max-context-len) holds 96 tokens:"
        " lower --speculative",
    ),
    (
        ["--speculative", "2000", "--max-context-len", "4096"],
        "--speculative 2000 is above 1023: a verify window holds a row's decode token and its"
        " drafts, and the KV pool (--kv-tokens) holds 1024 tokens: lower --speculative",
    ),
    (
        # Named as itself, not as the window tokens its verify windows would need.
        ["--speculative", "100000", "--model", "hybrid"],
        "--speculative 100000 is above 95: ",
    ),
    (
        ["--max-running", "1000000"],
        "--max-running 1000000 is above 1024, the tokens in the KV pool (--kv-tokens), and each"
        " running request holds one at least: lower --max-running",
    ),
    (
        ["--max-running", "2000", "--max-reqs", "4000"],
        "--max-running 2000 is above 1024, the tokens in the KV pool",
    ),
]


@pytest.mark.parametrize(("args", "message"), BOUNDS)
def test_a_value_past_what_the_run_holds_is_refused_in_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"batchstate simulate: error: {message}")
    assert err.count("\n") == 1


def test_the_bounds_themselves_are_accepted() -> None:
    """As many drafts as a table row holds beside the decode token; one running request per
    KV token."""
    workload = WorkloadConfig(prompt_len=(8, 48), output_len=(4, 48))
    SimulationConfig(workload, EngineConfig(speculative=95), num_kv_tokens=1024).validate()
    SimulationConfig(workload, EngineConfig(max_running=1024), num_kv_tokens=1024).validate()
    with pytest.raises(ValueError, match="--max-running 1025 is above 1024"):
        SimulationConfig(workload, EngineConfig(max_running=1025), num_kv_tokens=1024).validate()


def test_as_many_drafts_as_the_row_holds_run(capsys: pytest.CaptureFixture[str]) -> None:
    """The bound is a real run: drafts past a request's output are not drafted."""
    assert main([*META, "--json", "--speculative", "95"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["speculative"] == 95 and summary["drafted_tokens"] > 0


# Runs each usage error in one fresh interpreter: each must exit 2 with torch unloaded.
_PROBE: Final = """\
import json, sys
from batchstate.cli import main
for args in json.loads(sys.argv[1]):
    code = main(["simulate", *args])
    print(code, "torch" in sys.modules, flush=True)
"""


def test_these_usage_errors_come_before_torch_loads() -> None:
    cases = [args for args, _ in BOUNDS]
    if Path("/proc").is_dir() and importlib.util.find_spec("matplotlib"):
        cases.append(["--plot", "/proc/x.png"])
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["2 False"] * len(cases), done.stderr


@pytest.mark.skipif(gpu_driver_present(), reason="this machine shows a GPU driver")
def test_cuda_without_a_gpu_driver_is_refused_before_torch_loads() -> None:
    """No driver, no device: said before importing torch (0.3-0.5 s here, against 3.6-5.2 s
    when torch was imported to ask it, on the 2-core machine the tests run on)."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps([["--device", "cuda"]])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout == "2 False\n", done.stderr
    assert (
        done.stderr == "batchstate simulate: error: device cuda: no CUDA device is available here\n"
    )


@pytest.fixture
def no_torch_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_ask() -> bool:
        raise AssertionError("torch was asked")

    monkeypatch.setattr(torch.cuda, "is_available", must_not_ask)


def test_without_a_driver_torch_is_not_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_torch_answer: None
) -> None:
    monkeypatch.setattr(simulation_config, "GPU_DRIVER_FILES", (str(tmp_path / "none"),))
    monkeypatch.setattr(simulation_config, "GPU_DRIVER_TOOLS", ("no-such-tool-here",))
    assert not gpu_driver_present()
    with pytest.raises(ValueError, match=r"^device cuda: no CUDA device is available here$"):
        SimulationConfig(device="cuda").validate()


@pytest.mark.parametrize("available", [False, True])
def test_with_a_driver_torch_answers(
    available: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A driver is not a device (none may be visible, or torch may be a cpu build): torch says."""
    driver = tmp_path / "version"
    driver.write_text("NVRM version: a driver\n")
    monkeypatch.setattr(simulation_config, "GPU_DRIVER_FILES", (str(driver),))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    assert gpu_driver_present()
    if available:
        SimulationConfig(device="cuda").validate()
    else:
        with pytest.raises(ValueError, match="no CUDA device is available here"):
            SimulationConfig(device="cuda").validate()


def test_a_driver_tool_on_path_counts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setattr(simulation_config, "GPU_DRIVER_FILES", ())
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_driver_present()


def test_a_folder_that_takes_no_files_is_named_truly(capsys: pytest.CaptureFixture[str]) -> None:
    """/proc is there, yet creating a file in it fails with ENOENT: the message says which."""
    pytest.importorskip("matplotlib")
    if not Path("/proc").is_dir():
        pytest.skip("needs Linux's /proc")
    assert main([*META, "--plot", "/proc/x.png"]) == 2
    assert capsys.readouterr().err == (
        "batchstate simulate: error: --plot /proc/x.png: cannot create a file in /proc:"
        " the folder exists but takes no new files"
        " (the system said: No such file or directory)\n"
    )


def test_a_folder_that_refuses_a_file_gives_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only mount (which binds root too, unlike permission bits) says so."""
    pytest.importorskip("matplotlib")

    def read_only(**_: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    assert main([*META, "--plot", str(tmp_path / "run.png")]) == 2
    assert capsys.readouterr().err == (
        f"batchstate simulate: error: --plot {tmp_path}/run.png: cannot create a file in"
        f" {tmp_path}: Read-only file system\n"
    )


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--requests", "0"], "no step ran: the workload has no requests"),
        (["--audit-every", "0"], "--audit-every 0"),
    ],
)
def test_the_summary_says_truly_why_no_read_was_counted(
    args: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*META, *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    reads = next(line for line in lines if line.startswith("device reads"))
    assert reads.split(maxsplit=2)[2].startswith(f"not counted ({why}) (decode path)")
    assert main([*META, *args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["device_reads"] is None and summary["audited_steps"] == 0
