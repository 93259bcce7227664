"""`qgather run`: the case suite under pytest, in this process, with qgather's options and selection
checked first (by the plugin's own parsers) and reports written by default.

The default run is the default suite, what CI runs: `-m "not slow"` unless the user gives `-m` or
`--exhaustive`. Exit status: pytest's (0 ok, 1 failing verdicts, 2 interrupted, 4 usage error); a
selection that collects nothing (pytest's 5) is a usage error, 4."""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from collections.abc import Sequence

from qgather.cli.common import add_run_options, add_selection_options, refusing_in_one_line, selection_problem, usage
from qgather.cli.interrupts import load_torch, release_start_up
from qgather.model.known_issues import BaselineError, load
from qgather.model.report_folder import write_interrupted
from qgather.paths import checkout_root, suite_dir
from qgather.suite.options import gpu_problem, joined_impls, output_problem

USAGE_ERROR = 4  # pytest.ExitCode.USAGE_ERROR, without importing pytest for --help
NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
INTERRUPTED = 2  # pytest.ExitCode.INTERRUPTED
DEFAULT_REPORT_DIR = "reports"


@refusing_in_one_line("run")
def main(extra: Sequence[str]) -> int:
    """Run the suite; every argument qgather does not know goes to pytest. Interrupted at any point (start-up
    included: torch loading, the selection's check, pytest's own set-up), the report folder says so."""
    extra = list(extra)
    if "-h" in extra or "--help" in extra:
        return _help()
    started = time.time()
    try:
        release_start_up()  # a Ctrl-C since the command line started: the reports say so (below)
        rc = _run(extra)
    except KeyboardInterrupt:
        _say_interrupted(extra, started)
        raise
    if rc == INTERRUPTED:  # pytest's set-up was interrupted before its session could write the reports
        _say_interrupted(extra, started)
    return rc


def _say_interrupted(extra: list[str], started: float) -> None:
    """The report folder says the run was interrupted, unless the session wrote its reports (which say so)."""
    folder = _report_dir(extra)
    if folder:
        with contextlib.suppress(OSError):
            write_interrupted(folder, started, "interrupted before the first case ran")


def _report_dir(extra: list[str]) -> str:
    """The --report-dir the arguments name, as the options will read it (the default: DEFAULT_REPORT_DIR)."""
    for i, arg in enumerate(extra):
        if arg == "--report-dir" and i + 1 < len(extra):
            return extra[i + 1]
        if arg.startswith("--report-dir="):
            return arg.partition("=")[2]
    return DEFAULT_REPORT_DIR


def _run(extra: list[str]) -> int:
    args, _rest = _own_options().parse_known_args(extra)  # a bad value raises OptionRefused: one line
    # Reports by default (`--report-dir ''` turns them off): a CI run always has its summary and junit.xml.
    reports = [] if _given(extra, "--report-dir") else ["--report-dir", DEFAULT_REPORT_DIR]
    writes = not any(a in ("--collect-only", "--co") for a in extra)  # collecting writes no report
    problem = _input_problem(args, writes)
    if problem:
        return usage("run", problem)
    load_torch()  # past here, a Ctrl-C is a KeyboardInterrupt qgather handles (qgather.cli.interrupts)
    problem = _selection_problem(args)
    if problem:
        return usage("run", problem)
    # One -q by default; a user's -q must not stack to -qq, which drops pytest's final line.
    quiet = [] if any(a in ("-q", "--quiet") or a.startswith("-qq") for a in extra) else ["-q"]
    rc = _pytest([*suite_pytest_args(), *quiet, *default_markers(extra), "--qgather-summary", *reports, *extra])
    if rc == NO_TESTS_COLLECTED:  # the selection ran nothing (the user's -m or -k made it empty)
        return usage("run", "the selection collected no test (see -m / -k); nothing ran")
    return rc


def default_markers(extra: Sequence[str]) -> list[str]:
    """`-m "not slow"` (the default suite, what CI runs) unless the user chose markers (-m) or the
    full products (--exhaustive)."""
    chosen = any(a == "-m" or (a.startswith("-m") and not a.startswith("--")) for a in extra)
    return [] if chosen or "--exhaustive" in extra else ["-m", "not slow"]


def _own_options() -> argparse.ArgumentParser:
    """qgather's selection and run options, parsed as the plugin will parse them (pytest takes the rest), and
    the files a run reads or writes, read here to be checked before torch loads (`_input_problem`)."""
    parser = argparse.ArgumentParser(prog="qgather run", add_help=False, allow_abbrev=False)
    add_selection_options(parser)
    add_run_options(parser)
    parser.add_argument("--report-dir", default=DEFAULT_REPORT_DIR)
    parser.add_argument("--baseline")
    parser.add_argument("--junitxml", "--junit-xml", dest="junitxml")
    parser.add_argument("--qgather-json")
    return parser


def _input_problem(args: argparse.Namespace, writes: bool = True) -> str | None:
    """Why the run cannot start as asked, found without torch (None: nothing found): a GPU asked for on a
    host that has none, a baseline that does not load, an output that cannot be written (`writes`: the run
    writes its outputs, which --collect-only does not; each is created as the run would). The plugin checks
    the same again (plain pytest), with the same functions; here it is one line within a second."""
    problem = gpu_problem(args.device, args.backend)
    if problem:
        return problem
    if args.baseline:
        try:
            load(args.baseline, f"--baseline {args.baseline}")
        except BaselineError as exc:
            return str(exc)
    outputs = (("--report-dir", args.report_dir, True), ("--junitxml", args.junitxml, False),
               ("--qgather-json", args.qgather_json, False)) if writes else ()
    return next((p for flag, path, folder in outputs if path and (p := output_problem(flag, path, folder))), None)


def _given(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def _selection_problem(args: argparse.Namespace) -> str | None:
    """Why the selection does not say what runs (qgather.cli.common.selection_problem; None: it does).
    Checked here too: under xdist the plugin's own check cannot stop the session."""
    if not (args.formats or args.world_sizes or args.scenarios or args.impl):
        return None
    from qgather.suite.coverage import suite_cases  # deferred: the suite imports torch

    named = list(joined_impls(args.impl)) if args.impl else None
    cases, _ = suite_cases(list(joined_impls(args.impl)), args.formats, args.world_sizes, args.scenarios,
                           args.exhaustive, named=named, device=args.device, memo=True)
    return selection_problem(args, cases)


def suite_pytest_args() -> list[str]:
    """The suite and the options every pytest run of it gets, in a checkout or an install."""
    suite = suite_dir()
    # The plugin's pytest11 entry point is off under PYTEST_DISABLE_PLUGIN_AUTOLOAD: name it by that
    # entry point's name (a module name would register it twice). pytest marks an installed plugin's
    # package for assertion rewriting, too late for qgather, which this command has imported.
    args = [suite, "-p", "qgather", "-p", "no:cacheprovider",
            "-W", "ignore:Module already imported so cannot be rewritten; qgather:pytest.PytestAssertRewriteWarning"]
    if checkout_root() is None:
        # The packaged suite is its own root: node ids relative to it, no conftest.py or ini file
        # of the directories above site-packages.
        args += ["--rootdir", suite]
    return args


def _pytest(args: list[str]) -> int:
    import pytest  # deferred: pytest's import and its plugins' cost nothing to `qgather --help`

    return int(pytest.main(args))


def _help() -> int:
    """qgather's own options first, then where pytest's are."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        _pytest([*suite_pytest_args(), "--help"])
    lines = buffer.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("quantized all-gather harness")), None)
    print("usage: qgather run [qgather options] [pytest options]\n")
    print("Runs the case suite under pytest. qgather options:")
    if start is not None:
        for line in lines[start + 1:]:
            if line and not line.startswith(" "):
                break
            print(line)
    print("\nEvery other argument goes to pytest: see `python -m pytest --help` (e.g. -q, -x, -k EXPR, -n N).")
    return 0
