"""The `qgather` command line (also `python -m qgather`): a dispatch table of command groups, each a
module whose `main(argv) -> int` parses its own arguments.

A command's module is imported only when the command runs (a deferred import in its loader, which
import-linter sees like any other), so that `qgather --help` stays fast and starts no torch, and a
missing optional library only affects the command that needs it. The commands that run cases
unwind through the rank pools' cleanup on SIGTERM and Ctrl-C. Exit status, in every command,
pytest's convention (README's "Exit codes"): 0 ok, 1 a failing verdict / a surviving mutant / a
stale baseline entry, 2 interrupted (Ctrl-C, SIGTERM), 4 bad input (one line on stderr: a bad
option value, an unknown name, an empty selection).

    run        qgather.cli.run        the case suite under pytest
    case       qgather.cli.case       cases by id, their reports
    repro      qgather.cli.case       one case, its report, the environment, the rerun command
    list       qgather.cli.listing    implementations, formats, scenarios, mutants; --cases
    gpu-check  qgather.cli.gpu        GPUs, backends, optional libraries
    bench      qgather.cli.bench      benchmarks
    selftest   qgather.tools.selftest the bug zoo
    golden     qgather.tools.golden   the golden corpus
    baseline   qgather.cli.baseline   the known-issues baseline
    coverage   qgather.cli.coverage   a selection's coverage matrix
    sweep      qgather.cli.sweep      shapes x world sizes of one implementation, failures shrunk
    compare    qgather.cli.compare    two runs case by case: what an upgrade fixed and broke (no torch)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qgather.cli.common import USAGE_ERROR, OptionRefused, usage, with_cleanup_on_signals
from qgather.cli.interrupts import release_start_up
from qgather.errors import UsageError
from qgather.quiet import quiet_torchao

CommandMain = Callable[[Sequence[str]], int]


@dataclass(frozen=True)
class Command:
    """One command: the loader of the function that runs it with the command's arguments, and its help."""

    name: str
    load: Callable[[], CommandMain]
    help: str
    runs_cases: bool = False  # SIGTERM and Ctrl-C unwind through the pools' cleanup
    # its main raises the start-up's held interrupts itself, inside its own handling (run: the reports)
    releases_start_up: bool = False
    # where the command's module imports torch: a check of its arguments that imports nothing heavy
    check: Callable[[list[str]], None] | None = None

    def main(self, argv: Sequence[str]) -> int:
        """Import the command's module (only now: see the module docstring) and run it; a command with
        a `check` has its arguments read first (argparse's refusal or a UsageError, both exit 4, before
        torch loads)."""
        if self.check is not None:
            self.check(list(argv))
        command_main = self.load()  # a Ctrl-C while it loads is held (qgather.__main__) and raised below
        if self.runs_cases:  # from here on an interrupt ends in the pools' cleanup and exit 2, never a traceback
            return with_cleanup_on_signals(self.name, command_main, argv, release=not self.releases_start_up)
        release_start_up()
        return int(command_main(list(argv)) or 0)


# One check per command that has one: each imports only its parser's light module, when it runs.
def _check_selftest(argv: list[str]) -> None:
    from qgather.tools.arguments import selftest_parser
    selftest_parser().parse_args(argv)


def _check_golden(argv: list[str]) -> None:
    from qgather.tools.arguments import golden_parser
    golden_parser().parse_args(argv)


def _check_sweep(argv: list[str]) -> None:
    from qgather.cli.arguments import check_sweep
    check_sweep(argv)


# One loader per command: each imports its module when the command runs, not when qgather starts.
def _run() -> CommandMain:
    from qgather.cli.run import main
    return main


def _case() -> CommandMain:
    from qgather.cli.case import main_case
    return main_case


def _repro() -> CommandMain:
    from qgather.cli.case import main_repro
    return main_repro


def _list() -> CommandMain:
    from qgather.cli.listing import main
    return main


def _gpu_check() -> CommandMain:
    from qgather.cli.gpu import main
    return main


def _bench() -> CommandMain:
    from qgather.cli.bench import main
    return main


def _selftest() -> CommandMain:
    from qgather.tools.selftest import main
    return main


def _golden() -> CommandMain:
    from qgather.tools.golden import main
    return main


def _baseline() -> CommandMain:
    from qgather.cli.baseline import main
    return main


def _coverage() -> CommandMain:
    from qgather.cli.coverage import main
    return main


def _sweep() -> CommandMain:
    from qgather.cli.sweep import main
    return main


def _compare() -> CommandMain:
    from qgather.cli.compare import main
    return main


COMMANDS = {c.name: c for c in (
    Command("run", _run, "run the case suite (extra arguments go to pytest)", runs_cases=True,
            releases_start_up=True),
    Command("case", _case, "run cases by id and print their reports", runs_cases=True),
    Command("list", _list, "list implementations, formats, scenarios, mutants; --cases: a selection's case ids"),
    Command("repro", _repro, "run one case; print its report, the environment and the command to rerun it",
            runs_cases=True),
    Command("gpu-check", _gpu_check, "list the GPUs, backends and optional libraries the GPU job uses"),
    Command("bench", _bench, "run benchmarks (formats, runtime, gpu, suite: cases/s, list: seconds); default: all"),
    Command("selftest", _selftest, "run the bug zoo and print how many mutants were caught",
            check=_check_selftest),
    Command("golden", _golden, "write (or --check) the golden corpus under golden/", check=_check_golden),
    Command("baseline", _baseline, "update the known-issues baseline from a run's verdicts.json"),
    Command("coverage", _coverage, "print the coverage matrix (format x buffer x regime x scenario x configuration) "
            "of a selection as Markdown"),
    Command("sweep", _sweep, "explore shapes x world sizes of one impl and format; shrink each failure group",
            check=_check_sweep),
    Command("compare", _compare, "compare two runs' verdicts case by case (fixed, regressed, changed); "
            "exit 1 on a regression"),
)}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: the command names and their help (each command parses its own arguments)."""
    parser = argparse.ArgumentParser(
        prog="qgather",
        description="Correctness harness for quantized weight all-gather under PyTorch FSDP2.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        sub.add_parser(command.name, help=command.help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `qgather <command> [arguments]`; the command's exit status.

    Example:
        >>> main(["list", "formats"])   # what `qgather list formats` prints
    """
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # The reader went away (`qgather list --cases | head`): stop quietly, as `yes | head` does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE


def _main(argv: list[str]) -> int:
    quiet_torchao()
    if not argv or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0 if argv else USAGE_ERROR
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        return usage(name, f"no such command; choose from {', '.join(COMMANDS)}")
    try:
        return command.main(rest)
    except OptionRefused as exc:  # from a module outside qgather.cli that adds the shared options (sweep)
        return usage(name, exc.message)
    except UsageError as exc:  # a name no registry knows (a mutant, a benchmark), from any command
        return usage(name, str(exc))
    except SystemExit as exc:  # argparse's own refusal exits 2, pytest's "interrupted": bad input is 4
        if exc.code == 2:
            return USAGE_ERROR
        raise
