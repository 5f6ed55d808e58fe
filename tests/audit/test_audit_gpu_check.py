"""tools/gpu_check.py: says so and succeeds without CUDA; its checking logic runs on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tools.gpu_check import check_graph_buffers, main

from tests.typecheck import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check runs")
def test_without_cuda_it_says_so_and_exits_0() -> None:
    """Run as a script on a machine without CUDA, it prints why and exits with status 0."""
    result = subprocess.run(
        [sys.executable, "tools/gpu_check.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("CUDA is not available (torch ")


def test_the_comparison_passes_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """Pointed at the CPU, the script runs both loops, finds them equal and reports OK."""
    assert main(["--device", "cpu", "--steps", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpu_check: torch ")
    runs = [line for line in lines if line.startswith("  page_size=")]
    assert [line.split(":")[0] for line in runs] == ["  page_size=1", "  page_size=16"]
    assert all("host side matches cpu: True" in line for line in runs)
    # Launches and copies are printed beside the µs, counted on meta for a CPU run.
    work = [line for line in lines if line.startswith("    per decode step, on meta:")]
    assert len(work) == 2
    assert all("device kernels" in line and "host-to-device copies" in line for line in work)
    # The graph-buffer check runs uncaptured: refilled buckets give SDPA's answer.
    graphs = [line for line in lines if line.startswith("  graph buffers, ")]
    assert len(graphs) == 5
    assert any(line.startswith("  graph buffers, extend 4x96:") for line in graphs)
    assert all(line.endswith("addresses unchanged: True") for line in graphs)
    assert lines[-1] == "gpu_check: OK"


def test_graph_attention_reads_the_buffers_and_sees_a_refill() -> None:
    """The captured body reads only device buffers: after a refill with other lengths its
    answer changes, to SDPA's on the new inputs."""
    assert check_graph_buffers(torch.device("cpu"))
