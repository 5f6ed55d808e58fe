"""`batchstate replay`'s usage errors: exit 2, one line on stderr, before torch loads.

Each case runs the command line in a fresh interpreter, which reports after `main`
returns whether torch was ever imported. Exit 1 is a divergence and only that: a
trace made here (batchstate alone, no SGLang) replays to 0, and the same trace with
one recorded length changed to 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

import attrs
import pytest

from batchstate.cli._replay import POOLS_FIELDS, VLLM_POOLS_FIELDS
from batchstate.sglang.replica import ExtendItem, Replica
from batchstate.sglang.trace import Operation, PoolsConfig, dumps

# The command line in a fresh interpreter: its exit code, and whether torch loaded.
_PROBE: Final = """\
import sys
from batchstate.cli import main
code = main(sys.argv[1:])
print(code, "torch" in sys.modules)
"""
_POOLS: Final = '{"op": "pools", "page_size": 16, "kv_tokens": 256, "rows": 4, "context": 512}'


def _replay(path: Path) -> tuple[str, str]:
    """The probe's last line (`code torch-loaded`) and what it printed on stderr."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "replay", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout, done.stderr
    return done.stdout.splitlines()[-1], done.stderr


def _missing(folder: Path) -> Path:
    return folder / "missing.jsonl"


def _folder(folder: Path) -> Path:
    return folder


def _binary(folder: Path) -> Path:
    path = folder / "trace.jsonl"
    path.write_bytes(bytes(range(256)) * 4)
    return path


def _not_utf8(folder: Path) -> Path:
    path = folder / "trace.jsonl"
    path.write_bytes(_POOLS.encode() + b"\n\xff\xfe{}\n")
    return path


def _not_json(folder: Path) -> Path:
    path = folder / "trace.jsonl"
    path.write_text("step,op,batch\n1,prepare_for_extend,b0\n")
    return path


def _wrong_first_line(folder: Path) -> Path:
    path = folder / "trace.jsonl"
    path.write_text('{"op": "prepare_for_decode", "step": 0}\n' + _POOLS + "\n")
    return path


def _pools_line_without_a_field(folder: Path) -> Path:
    path = folder / "trace.jsonl"
    path.write_text('{"op": "pools", "page_size": 16, "kv_tokens": 256, "rows": 4}\n')
    return path


def _empty(folder: Path) -> Path:
    path = folder / "trace.jsonl"
    path.write_text("")
    return path


_CASES: Final = [
    (_missing, "missing.jsonl: no such file"),
    (_folder, ": is a folder, not a trace file"),
    (_binary, "trace.jsonl: a binary file, not a trace"),
    (_not_utf8, "trace.jsonl: a binary file, not a trace"),
    (_not_json, "trace.jsonl:1: not JSON (Expecting value at column 1)"),
    (_wrong_first_line, "trace.jsonl:1: the first line must be the pools line"),
    (_pools_line_without_a_field, "trace.jsonl:1: the pools line has no context"),
    (_empty, "trace.jsonl: empty file, not a trace"),
]


@pytest.mark.parametrize(
    ("make", "says"),
    [pytest.param(make, says, id=make.__name__.strip("_")) for make, says in _CASES],
)
def test_a_usage_error_is_one_line_and_exit_2_before_torch_loads(
    tmp_path: Path, make: Callable[[Path], Path], says: str
) -> None:
    line, err = _replay(make(tmp_path))
    assert line == "2 False", err
    assert err.startswith("batchstate replay: error: ") and says in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and "Error(" not in err, err


def _trace(folder: Path, *, seq_len_shift: int = 0) -> Path:
    """A two-call trace of batchstate's own replica: one request extended, then decoded;
    each call's recorded state is the replica's, the decode's length moved by
    `seq_len_shift` (as if SGLang held another)."""
    config = PoolsConfig(page_size=16, kv_tokens=256, rows=4, context=512)
    replica = Replica(page_size=16, kv_tokens=256, rows=4, context=512)
    item = ExtendItem("r0", tuple(range(100, 140)), extend_len=40, prefix_len=0)
    replica.extend("b0", [item])
    extended = replica.state("b0")
    replica.checkpoint("r0")
    replica.decode("b0")
    decoded = replica.state("b0")
    moved = tuple(n + seq_len_shift for n in decoded.seq_lens)
    entries: list[PoolsConfig | Operation] = [
        config,
        Operation(0, "prepare_for_extend", "b0", extended, items=(item,), mirror_rows=1),
        Operation(
            1, "prepare_for_decode", "b0", attrs.evolve(decoded, seq_lens=moved), mirror_rows=1
        ),
    ]
    path = folder / "trace.jsonl"
    path.write_text("".join(dumps(entry) for entry in entries))
    return path


def test_a_trace_without_divergence_exits_0(tmp_path: Path) -> None:
    line, err = _replay(_trace(tmp_path))
    assert line == "0 True", err


def test_only_a_divergence_exits_1(tmp_path: Path) -> None:
    path = _trace(tmp_path, seq_len_shift=1)
    line, err = _replay(path)
    assert line == "1 True", err
    assert err == ""


def test_a_bad_later_line_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    """Past the pools line, the trace's reader names the line; still exit 2, one line."""
    path = _trace(tmp_path)
    path.write_text(path.read_text() + '{"op": "prepare_for_decode"}\n')
    line, err = _replay(path)
    assert line == "2 True", err
    assert err.startswith("batchstate replay: error: ") and "trace.jsonl:4: " in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_the_trace_made_here_reads_as_json_lines(tmp_path: Path) -> None:
    lines = _trace(tmp_path).read_text().splitlines()
    assert [json.loads(line)["op"] for line in lines] == [
        "pools",
        "prepare_for_extend",
        "prepare_for_decode",
    ]


def test_the_pools_line_check_names_the_trace_readers_fields() -> None:
    """The check before torch loads keeps its own copy of the pools line's fields: the same."""
    assert tuple(field.name for field in attrs.fields(PoolsConfig)) == POOLS_FIELDS
    from batchstate.vllm.trace import PoolsConfig as VllmPoolsConfig  # noqa: PLC0415

    assert tuple(field.name for field in attrs.fields(VllmPoolsConfig)) == VLLM_POOLS_FIELDS


@pytest.mark.parametrize(
    ("later", "says"),
    [
        pytest.param("{", "trace.jsonl:2: not JSON", id="not-json"),
        pytest.param('{"step": 0}', "trace.jsonl:2: not a trace line: no field", id="no-field"),
        pytest.param("[1, 2]", "trace.jsonl:2: not a trace line: a field holds", id="not-object"),
        pytest.param(
            '{"step": "zero", "op": "decode", "batch": "b0", "state": {}}',
            "trace.jsonl:2: not a trace line: a field holds the wrong value",
            id="bad-number",
        ),
    ],
)
def test_a_later_line_that_is_not_a_trace_line_is_one_line_and_exit_2(
    tmp_path: Path, later: str, says: str
) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{_POOLS}\n{later}\n")
    line, err = _replay(path)
    assert line.startswith("2 "), err
    assert err.startswith("batchstate replay: error: ") and says in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and "Error(" not in err and "Error'" not in err, err
