"""The install commands the docs give are the ones CI runs, verbatim, in the order that
makes each environment what the docs say it is."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
CI: Final = ROOT / ".ci" / "run"


def _section(path: Path, heading: str) -> str:
    return path.read_text().split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def _commands(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)\n```", text, re.S)


def _ci_lines() -> list[str]:
    """.ci/run's commands, one a line, without comments."""
    return [
        line.strip()
        for line in CI.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _sglang_commands() -> tuple[str, str]:
    deployment, development = _commands(_section(ROOT / "docs" / "sglang.md", "## Install"), "bash")
    return deployment, development


def test_docs_sglang_gives_a_deployment_and_a_development_command() -> None:
    deployment, development = _sglang_commands()
    assert deployment == "pip install '.[sglang]'"  # no torch named: the deployment's stays
    assert "torch" not in deployment and "--no-deps" not in deployment
    assert development.startswith("pip install 'torch==")
    assert "--no-deps 'sglang==0.5.23'" in development


def test_ci_runs_docs_sglang_commands_verbatim() -> None:
    lines = _ci_lines()
    for command in _sglang_commands():
        assert command in lines, command


def test_ci_runs_the_readme_suite_before_sglang_is_installed() -> None:
    """The README's test command runs in a newcomer's environment, without SGLang: before
    docs/sglang.md's development command adds it to that environment."""
    setup = _section(ROOT / "README.md", "## Set up")
    readme_tests = _commands(setup, "sh")[1]
    lines = _ci_lines()
    _, development = _sglang_commands()
    assert lines.index(readme_tests) < lines.index(development)
    assert not any("sglang" in line for line in lines[: lines.index(readme_tests)])


def test_ci_installs_into_a_deployment_and_checks_its_torch_after() -> None:
    """The deployment command runs where torch 2.14.1 and SGLang are installed already, in
    a fresh environment, and is followed by a check that torch is still 2.14.1."""
    lines = _ci_lines()
    deployment, development = _sglang_commands()
    at = lines.index(deployment)
    before = lines[lines.index(development) + 1 : at]
    venv = [n for n, line in enumerate(before) if line.startswith("python3 -m venv ")]
    assert venv, "no fresh environment between the development and deployment commands"
    since = before[venv[-1] :]
    assert "pip install 'torch==2.14.1'" in since
    assert "pip install --no-deps 'sglang==0.5.23'" in since
    check = lines[at + 1]
    assert "torch.__version__" in check and '"2.14.1"' in check and "sys.exit(" in check
    assert any(line.startswith("pytest ") and "tests/sglang" in line for line in lines[at:])


def test_ci_runs_docs_engine_real_model_command_after_the_readme_suite() -> None:
    """docs/engine.md's real-model install runs verbatim in the newcomer's environment, after
    the README's suite (which must pass without transformers), and the real-model tests
    follow it."""
    install = _commands(
        _section(ROOT / "docs" / "engine.md", "## Real models: transformers' Llama and Qwen3"), "sh"
    )[0]
    first = install.splitlines()[0]
    assert "'.[dev,hf]'" in first
    lines = _ci_lines()
    readme_tests = _commands(_section(ROOT / "README.md", "## Set up"), "sh")[1]
    at = lines.index(first)
    assert lines.index(readme_tests) < at
    assert any(line.startswith("pytest ") and "test_hf_model.py" in line for line in lines[at:])


def _vllm_commands() -> tuple[str, str]:
    deployment, development = _commands(_section(ROOT / "docs" / "vllm.md", "## Install"), "bash")
    return deployment, development


def test_docs_vllm_gives_a_deployment_and_a_development_command() -> None:
    deployment, development = _vllm_commands()
    assert deployment == "pip install '.[vllm]'"  # no torch named: the deployment's stays
    assert development.startswith("pip install 'torch==")
    assert "--no-deps 'vllm==0.33.0'" in development


def test_ci_runs_docs_vllm_development_command_in_a_fresh_environment() -> None:
    """The development command runs verbatim, in an environment made for it after the
    README's suite, and batchstate.vllm's tests run there."""
    lines = _ci_lines()
    _, development = _vllm_commands()
    at = lines.index(development)
    assert lines[at - 2].startswith("python3 -m venv ") and lines[at - 1].startswith("source ")
    assert lines.index(_commands(_section(ROOT / "README.md", "## Set up"), "sh")[1]) < at
    assert lines[at + 1].startswith("pytest ") and "tests/vllm" in lines[at + 1]
