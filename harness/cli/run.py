"""`qgather run`: the case suite under pytest, in this process, with qgather's options checked first
(by the plugin's own parsers) and reports written by default."""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Sequence

from qgather.cli.common import add_run_options, add_selection_options, refusing_in_one_line, usage
from qgather.paths import checkout_root, suite_dir

PYTEST_USAGE_ERROR = 4  # pytest.ExitCode.USAGE_ERROR, without importing pytest for --help


@refusing_in_one_line("run")
def main(extra: Sequence[str]) -> int:
    """Run the suite; every argument qgather does not know goes to pytest."""
    extra = list(extra)
    if "-h" in extra or "--help" in extra:
        return _help()
    args, _rest = _own_options().parse_known_args(extra)  # a bad value raises OptionRefused: one line
    problem = _world_sizes_problem(args.world_sizes)
    if problem:
        return usage("run", problem)
    # One -q by default; a user's -q must not stack to -qq, which drops pytest's final line.
    quiet = [] if any(a in ("-q", "--quiet") or a.startswith("-qq") for a in extra) else ["-q"]
    # Reports by default (`--report-dir ''` turns them off): a CI run always has its summary and junit.xml.
    reports = [] if _given(extra, "--report-dir") else ["--report-dir", "reports"]
    rc = _pytest([*suite_pytest_args(), *quiet, "--qgather-summary", *reports, *extra])
    return 2 if rc == PYTEST_USAGE_ERROR else rc


def _own_options() -> argparse.ArgumentParser:
    """qgather's selection and run options, parsed as the plugin will parse them (pytest takes the rest)."""
    parser = argparse.ArgumentParser(prog="qgather run", add_help=False, allow_abbrev=False)
    add_selection_options(parser)
    add_run_options(parser)
    return parser


def _given(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def _world_sizes_problem(sizes: tuple[int, ...] | None) -> str | None:
    """--world-sizes that no sweep of the suite has (checked here too: under xdist pytest cannot say so)."""
    if not sizes:
        return None
    from qgather.suite.modules import suite_sweeps  # deferred: the suite imports torch

    if any(set(sizes) & set(sweep.world_sizes) for _m, sweep, _i in suite_sweeps()):
        return None
    return f"--world-sizes {','.join(map(str, sorted(sizes)))}: no case in the selected suite has that world size"


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
