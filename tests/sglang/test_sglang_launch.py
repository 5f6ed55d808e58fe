"""`python -m batchstate.sglang.launch` turns the watch on in the process it starts.

The probe stands in for SGLang's server: it reports what its start-up left behind.
No SGLang import is needed (the hook waits for SGLang's `schedule_batch`).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import batchstate

PROBE = """
import json, os, sys
from batchstate.sglang._hook import AttachAfterImport, ENV_ATTACH, ENV_MODE, ENV_TRACE_DIR
from batchstate.sglang._hook import ENV_FULL_CHECK_EVERY
hooks = [f.target for f in sys.meta_path if isinstance(f, AttachAfterImport)]
seen = {"mode": os.environ[ENV_MODE], "trace": os.environ[ENV_TRACE_DIR]}
seen["attach"] = os.environ[ENV_ATTACH]
seen["every"] = os.environ[ENV_FULL_CHECK_EVERY]
print(json.dumps({"hooks": hooks, **seen, "argv": sys.argv[1:]}))
"""


def _launch(tmp_path: Path, *args: str) -> dict[str, object]:
    (tmp_path / "probe_server.py").write_text(PROBE)
    src = str(Path(batchstate.__file__).parent.parent)
    env = {"PYTHONPATH": f"{tmp_path}:{src}", "PATH": "/usr/bin:/bin"}
    command = [
        sys.executable,
        "-m",
        "batchstate.sglang.launch",
        "--watch-module",
        "probe_server",
        *args,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=60)
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_launched_process_has_the_hook_and_the_server_its_arguments(tmp_path: Path) -> None:
    seen = _launch(tmp_path, "--watch-trace-dir", str(tmp_path), "--model-path", "m", "--port", "1")
    assert seen == {
        "hooks": ["sglang.srt.managers.schedule_batch"],
        "mode": "raise",
        "attach": "watch",
        "every": "1",
        "trace": str(tmp_path),
        "argv": ["--model-path", "m", "--port", "1"],
    }


def test_log_mode_reaches_the_launched_process(tmp_path: Path) -> None:
    assert _launch(tmp_path, "--watch-log")["mode"] == "log"


def test_shadow_mode_waits_for_the_scheduler_module(tmp_path: Path) -> None:
    seen = _launch(tmp_path, "--shadow", "--watch-log")
    assert (seen["attach"], seen["mode"]) == ("shadow", "log")
    assert seen["hooks"] == ["sglang.srt.managers.scheduler"]


def test_the_shadows_full_check_interval_reaches_the_launched_process(tmp_path: Path) -> None:
    seen = _launch(tmp_path, "--shadow", "--shadow-full-check-every", "16", "--port", "1")
    assert (seen["attach"], seen["every"], seen["argv"]) == ("shadow", "16", ["--port", "1"])


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("--shadow-full-check-every", "4"), "needs --shadow"),
        (("--shadow", "--shadow-full-check-every", "0"), "must be at least 1"),
    ],
)
def test_a_full_check_interval_without_a_shadow_or_below_one_is_refused(
    tmp_path: Path, args: tuple[str, ...], reason: str
) -> None:
    with pytest.raises(subprocess.CalledProcessError) as refused:
        _launch(tmp_path, *args)
    assert reason in refused.value.stderr


SHADOWED = """
import json, os, sys
os.environ.update(BATCHSTATE_SGLANG_WATCH="raise", BATCHSTATE_SGLANG_ATTACH="shadow")
os.environ["BATCHSTATE_SGLANG_TRACE_DIR"] = sys.argv[1]
from batchstate.sglang._hook import install_from_environment
from batchstate.sglang._stubs import install_stubs
install_from_environment()
install_stubs()  # CPU: no triton
import sglang.srt.managers.scheduler as scheduler
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.mem_cache import common
from batchstate.sglang import Shadow
wrapped = [ScheduleBatch.prepare_for_extend.__qualname__, common.release_kv_cache.__qualname__]
cells = ScheduleBatch.prepare_for_extend.__closure__ or ()
every = [c.cell_contents.full_check_every for c in cells if isinstance(c.cell_contents, Shadow)]
print(json.dumps([wrapped, every]))
"""


def test_a_shadow_attaches_when_sglangs_scheduler_is_imported(tmp_path: Path) -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    src = str(Path(batchstate.__file__).parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", SHADOWED, str(tmp_path)],
        env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin", "BATCHSTATE_SGLANG_FULL_CHECK_EVERY": "8"},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    wrapped, every = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(name.startswith("Shadow._wrap_") for name in wrapped), wrapped
    assert every == [8]  # the interval the launcher put in the environment


DRIVEN = """
import json, random, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
from batchstate.sglang._stubs import install_stubs
install_stubs()  # what a GPU machine has and this one lacks (triton, ...)
import sglang.srt.managers.scheduler  # the hook drives each scheduler made from now on
from batchstate.sglang import cpu_topology
from batchstate.sglang.driven.memory import RadixCacheView
from batchstate.sglang.scheduler_loop import SchedulerLoop

limits = {"max_running_requests": 8, "pp_max_micro_batch_size": 8}
with cpu_topology(chunked_prefill_size=128, page_size=16, **limits):
    loop = SchedulerLoop(page_size=16, kv_tokens=1024, rows=8, overlap=True)
    rng = random.Random(0)
    for _ in range(6):
        loop.submit([rng.randrange(100, 30000) for _ in range(40)], 12)
    steps = 0
    while loop.busy and steps < 500:
        loop.step()
        steps += 1
s = loop.scheduler
ended = sorted(loop.outputs.finished.values())
lengths = [len(t) for t in loop.outputs.tokens.values()]
driven = isinstance(s.tree_cache, RadixCacheView)
print(json.dumps([driven, type(s.running_batch).__name__, ended, lengths]))
"""


def test_drive_is_turned_on_in_the_scheduler_as_it_starts(tmp_path: Path) -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    src = str(Path(batchstate.__file__).parent.parent)
    site = str(Path(batchstate.__file__).parent / "sglang" / "_site")
    done = subprocess.run(
        [sys.executable, "-c", DRIVEN, str(Path(__file__).parents[2])],
        env={
            "PYTHONPATH": f"{site}:{src}",
            "PATH": "/usr/bin:/bin",
            "BATCHSTATE_SGLANG_DRIVE": "1",
        },
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    driven, running, finished, lengths = json.loads(done.stdout.strip().splitlines()[-1])
    assert driven and running == "DrivenScheduleBatch"
    assert finished == ["FINISH_LENGTH"] * 6 and lengths == [12] * 6


def test_drive_refuses_what_it_does_not_run_before_anything_starts(tmp_path: Path) -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    src = str(Path(batchstate.__file__).parent.parent)
    (tmp_path / "probe_server.py").write_text("print('started')\n")
    launch = [sys.executable, "-m", "batchstate.sglang.launch", "--drive"]
    done = subprocess.run(
        [*launch, "--watch-module", "probe_server", "--model-path", "m", "--enable-mixed-chunk"],
        env={"PYTHONPATH": f"{tmp_path}:{src}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 2
    assert "started" not in done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        "batchstate drive mode does not run --enable-mixed-chunk True: "
        "mix_with_running is not driven yet"
    )
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run(
            [sys.executable, "-m", "batchstate.sglang.launch", "--drive", "--shadow"],
            env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            check=True,
            timeout=60,
        )
