"""`python -m batchstate.sglang.launch` turns the watch on in the process it starts.

The probe stands in for SGLang's server: it reports what its start-up left behind.
No SGLang import is needed (the hook waits for SGLang's `schedule_batch`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import batchstate

PROBE = """
import json, os, sys
from batchstate.sglang._hook import AttachAfterImport, ENV_MODE, ENV_TRACE_DIR
hooks = [type(f).__name__ for f in sys.meta_path if isinstance(f, AttachAfterImport)]
seen = {"mode": os.environ[ENV_MODE], "trace": os.environ[ENV_TRACE_DIR]}
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
        "hooks": ["AttachAfterImport"],
        "mode": "raise",
        "trace": str(tmp_path),
        "argv": ["--model-path", "m", "--port", "1"],
    }


def test_log_mode_reaches_the_launched_process(tmp_path: Path) -> None:
    assert _launch(tmp_path, "--watch-log")["mode"] == "log"
