"""The command line's parser: its commands, option groups, help and one-line errors."""

from __future__ import annotations

import argparse
from typing import Final, NoReturn

from batchstate.base.version import __version__
from batchstate.cli._codes import EXIT_CODES, USAGE
from batchstate.cli._option_groups import (
    Add,
    add_engine_options,
    add_sampling_options,
    add_workload_options,
)
from batchstate.cli._replay import add_replay_command
from batchstate.cli._values import Switch, fault, plot_path

__all__ = ["BACKENDS", "HelpFormatter", "Parser", "build_parser"]

EPILOG: Final = "exit status:\n" + "\n".join(f"  {code}  {what}" for code, what in EXIT_CODES)
BACKENDS: Final = ("gloo", "nccl")  # the engine's, written here for the same reason as ARRIVALS


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, not usage plus a line."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: error: {message}\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Adds `(default: X)` to an option's help, unless it says its default itself.

    Flags and options whose default is computed (None) say nothing or say it
    in words, so each option shows its default once.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (
            "(default" in help_text
            or action.default in (None, argparse.SUPPRESS)
            or action.nargs == 0  # a flag: its name says what it changes
        ):
            return help_text
        return f"{help_text} (default: %(default)s)"


def build_parser() -> Parser:
    """The `batchstate` parser, with its `simulate` and `replay` commands and every option."""
    parser = Parser(
        prog="batchstate",
        description="batchstate's command line: run its reference serving engine and check it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    sim = commands.add_parser(
        "simulate",
        help="run the reference engine on a generated workload and check it",
        description=(
            "Run the reference continuous-batching engine on a seeded workload, check\n"
            "its tokens against the oracle, and print a summary."
        ),
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    add_workload_options(sim.add_argument_group("workload").add_argument)
    add_sampling_options(sim.add_argument_group("sampling").add_argument)
    add_engine_options(sim.add_argument_group("engine and pools").add_argument)
    _add_data_parallel_options(sim.add_argument_group("data parallel").add_argument)
    _add_output_options(sim.add_argument_group("checks and output").add_argument)
    add_replay_command(commands)
    return parser


def _add_data_parallel_options(add: Add) -> None:
    add(
        "--dp",
        type=int,
        default=None,
        metavar="N",
        help="run N data-parallel ranks (processes, or torchrun's): each owns its pools and"
        " batch, attention runs per rank and the MLPs are shared (default: one process;"
        " under torchrun, its world size)",
    )
    add(
        "--dp-backend",
        choices=BACKENDS,
        default=None,
        help="collectives of the shared layers (default: gloo on cpu, nccl on cuda)",
    )
    add(
        "--dp-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a collective may wait before every rank stops",
    )
    add(
        "--dp-fault",
        type=fault,
        default=None,
        metavar="RANK:STEP[:hang]",
        help="test the fault path: rank RANK raises in step STEP (with :hang, stops answering"
        " there), and every rank must stop (default: no fault)",
    )


def _add_output_options(add: Add) -> None:
    add(
        "--oracle",
        action=Switch,
        default=True,
        help="check each request's tokens against the model run alone (on by default;"
        " meta runs no model, so never runs it)",
    )
    add(
        "--check-every",
        type=int,
        default=100,
        metavar="N",
        help="check invariants every N steps (the pools and rows after the step, the"
        " forward's contract before its forward, off meta); 0: at the end only",
    )
    add(
        "--audit-every",
        type=int,
        default=16,
        metavar="N",
        help="count decode-path device reads every N steps; 0: never",
    )
    add("--json", action="store_true", help="print the summary as JSON on stdout")
    add(
        "--plot",
        type=plot_path,
        default=None,
        metavar="PATH",
        help="also plot the run to PATH, in the format its extension names (png, svg, pdf, ...);"
        " needs matplotlib",
    )
    add(
        "-q",
        "--quiet",
        "--no-progress",
        dest="quiet",
        action="store_true",
        help="no progress on stderr (a bar on a terminal; elsewhere, as in CI or piped to tee,"
        " a plain line every few seconds)",
    )
