"""Mutation testing of the library with mutmut 3, and the score per module.

Usage (from the repository root, with the dev extra installed):

    python tools/mutation.py memory.free_list transitions.merging  # these modules
    python tools/mutation.py                            # every module mutmut mutates
    python tools/mutation.py --report                   # the last runs' scores, no new run
    python tools/mutation.py --left pools.pools         # only mutants with no result yet
    python tools/mutation.py --survivors pools.pools    # only those not killed last time

A module is named by its path under src/batchstate, with dots (`pools.pools`;
`memory/free_list.py` works too).

Configuration is `[tool.mutmut]` in pyproject.toml (the engine and the CLI are
not mutated). Tests run in the fast profile (`BATCHSTATE_FAST=1`: small,
derandomized hypothesis budgets), on one thread: mutmut forks each mutant's
test run from a process that already ran torch, and a forked child that
finds torch's thread pool started can wait forever on a lock. mutmut works
in `mutants/` (git-ignored); `mutmut browse` or `mutmut show NAME` shows a surviving mutant.

Score = killed / (killed + survived + timeout + suspicious + no tests);
mutants skipped, caught by the type check or not yet checked are left out. Not run in CI:
a full run takes tens of minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "batchstate"
KILLED = {1, 3}


def _status(exit_code: int | None) -> str:
    if exit_code in KILLED:
        return "killed"
    # mutmut's own reading: 36, or SIGXCPU (its CPU-time limit) as the child reports it.
    return {None: "not checked", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
            36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
            37: "type check"}.get(exit_code, "other")  # fmt: skip


def exit_codes(modules: list[str]) -> dict[str, dict[str, int | None]]:
    """Mutant name -> mutmut's exit code (None: not checked), per module, from `mutants/`."""
    results: dict[str, dict[str, int | None]] = {}
    base = ROOT / "mutants" / "src" / PACKAGE
    for meta in sorted(base.rglob("*.py.meta")):
        module = ".".join(meta.relative_to(base).parts).removesuffix(".py.meta")
        if not modules or module in modules:
            results[module] = json.loads(meta.read_text())["exit_code_by_key"]
    return results


def scores(modules: list[str]) -> dict[str, Counter[str]]:
    """Mutant statuses per module, from mutmut's `.meta` files in `mutants/`."""
    return {
        module: Counter(_status(code) for code in codes.values())
        for module, codes in exit_codes(modules).items()
    }


def _selected(modules: list[str], *, left: bool, survivors: bool) -> list[str]:
    # mutmut reruns every mutant it is given by name: name only the ones wanted.
    if not (left or survivors):
        return [f"{PACKAGE}.{module}.*" for module in modules]
    return [
        name
        for codes in exit_codes(modules).values()
        for name, code in codes.items()
        if (left and code is None) or (survivors and code is not None and code not in KILLED)
    ]


def report(results: dict[str, Counter[str]]) -> int:
    """Print one line per module and a total; return the number of survivors."""
    total: Counter[str] = Counter()
    print(f"{'module':<28} {'mutants':>7} {'killed':>6} {'survived':>8} {'timeout':>7}"
          f" {'other':>5} {'unchecked':>9} {'score':>7}")  # fmt: skip
    for module, counts in results.items():
        total += counts
        print(_line(module, counts))
    if len(results) > 1:
        print(_line("all", total))
    return total["survived"]


def _line(module: str, counts: Counter[str]) -> str:
    killed, survived, timeout = counts["killed"], counts["survived"], counts["timeout"]
    left_out = counts["skipped"] + counts["type check"] + counts["not checked"]
    other = sum(counts.values()) - killed - survived - timeout - left_out
    scored = killed + survived + timeout + other
    score = f"{100 * killed / scored:.1f}%" if scored else "-"
    return (f"{module:<28} {sum(counts.values()):>7} {killed:>6} {survived:>8} {timeout:>7}"
            f" {other:>5} {left_out:>9} {score:>7}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="modules of src/batchstate, e.g. pools.pools")
    parser.add_argument("--report", action="store_true", help="print the last scores only")
    parser.add_argument("--left", action="store_true", help="only mutants not checked yet")
    parser.add_argument("--survivors", action="store_true", help="only mutants not killed")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    modules = [name.removesuffix(".py").replace("/", ".") for name in args.modules]
    if not args.report:
        names = _selected(modules, left=args.left, survivors=args.survivors)
        if not names:
            print("no mutant to run", file=sys.stderr)
            return 1
        threads = {name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env = {**os.environ, "BATCHSTATE_FAST": "1", **threads}
        command = [sys.executable, "-m", "mutmut", "run", "--max-children",
                   str(args.max_children), *names]  # fmt: skip
        subprocess.run(command, cwd=ROOT, env=env, check=False)
    results = scores(modules)
    if not results:
        print("no mutation results: run without --report first", file=sys.stderr)
        return 1
    report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
