"""What a user meets in `qgather run`, `pytest cases` and the CLI: the default run is the default
suite, every selection value and output path is checked before a case runs, one exit-code
convention (pytest's: 0 ok, 1 failing verdicts, 2 interrupted, 4 usage error), every --help exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from qgather.cli import COMMANDS
from qgather.cli.run import default_markers
from qgather.model.case_record import CaseRecord
from qgather.pytest_plugin.results import RunResults
from qgather.pytest_plugin.summary import coverage_lines, coverage_of
from qgather.suite.coverage import Coverage, promise_lines
from tests.test_report_folder import _earlier_run, _left_of_the_earlier_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}


def qgather(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qgather", *args], capture_output=True, text=True, cwd=cwd,
                          env=ENV, timeout=300)


NEXT = "<<next pytest run>>"


def plain_pytest_runs(*argvs: tuple[str, ...]) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """`pytest cases -q -p no:cacheprovider <argv>` for each argv, by pytest.main (what `python -m pytest` runs)
    one after the other in one process of its own, which imports torch and the plugin once for all of them:
    each run's exit code, stdout and stderr."""
    code = ("import json, sys, pytest\n"
            "def next_run():\n"
            f"    print({NEXT!r}, flush=True); print({NEXT!r}, file=sys.stderr, flush=True)\n"
            "rcs = []\n"
            f"for argv in {[list(argv) for argv in argvs]!r}:\n"
            "    next_run(); rcs.append(int(pytest.main(['cases', '-q', '-p', 'no:cacheprovider', *argv])))\n"
            "    sys.stdout.flush(); sys.stderr.flush()\n"
            "next_run(); print(json.dumps(rcs))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=ENV,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    *outs, rcs = result.stdout.split(NEXT + "\n")[1:]
    errs = result.stderr.split(NEXT + "\n")[1:-1]
    return {argv: subprocess.CompletedProcess(["pytest", "cases", *argv], rc, out, err)
            for argv, rc, out, err in zip(argvs, json.loads(rcs), outs, errs, strict=True)}


# plain pytest refuses a bad selection value, an empty selection and an unwritable output before any case: one
# run of each, all made in one process (plain_pytest_runs); their tests share that worker (--dist loadgroup)
PLAIN_PYTEST = "plain_pytest_refusals"
NO_CASES = ("--formats", "nvfp4_1d", "--scenarios", "model")  # every name known, no case has both


@pytest.fixture(scope="module")
def plain_pytest_refusals() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    return plain_pytest_runs(("--formats", "fp7"), NO_CASES, ("--formats", "nvfp4_2d", "--report-dir", "/proc/x"))


def plain_pytest(request: pytest.FixtureRequest, *args: str) -> subprocess.CompletedProcess:
    """plain pytest's run of `args`, one of plain_pytest_refusals'."""
    return request.getfixturevalue(PLAIN_PYTEST)[args]


def one_line(result: subprocess.CompletedProcess, rc: int, *words: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == rc, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stdout + result.stderr
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------ 1. the default run is the default suite
@pytest.mark.parametrize("extra, markers", [
    ([], ["-m", "not slow"]),
    (["-q", "--formats", "nvfp4_2d"], ["-m", "not slow"]),
    (["-m", "slow"], []),
    (["-mslow"], []),
    (["--exhaustive"], []),
])
def test_the_default_run_deselects_slow_unless_asked(extra, markers):
    assert default_markers(extra) == markers


def test_a_run_ends_with_a_short_summary_and_where_the_reports_are(tmp_path):
    """Also: a user's -q does not stack on the run's own -q to -qq, which drops pytest's final line."""
    out = tmp_path / "reports"
    result = qgather("run", "-q", "--formats", "nvfp4_2d", "--world-sizes", "2", "--scenarios", "gather",
                     "--report-dir", str(out), cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:]
    summary = result.stdout.split("qgather verdicts", 1)[1].splitlines()[1:]
    assert len(summary) <= 15, summary
    last = [line for line in result.stdout.splitlines() if line.strip()][-1]
    assert " passed" in last and " in " in last, last  # pytest's final line, kept
    assert re.search(r"^coverage: (\d+)/\1 promised cells hit$", result.stdout, re.M), result.stdout[-2000:]
    assert f"reports written to {out}/: verdicts.md, verdicts.json, junit.xml, coverage.md" in result.stdout
    assert " deselected" in summary[-1]  # the slow cases: the default suite, not the full products
    assert (out / "coverage.md").read_text().startswith("# qgather coverage: ")
    assert json.loads((out / "verdicts.json").read_text())["incomplete"] is False


def test_broken_promises_are_listed_and_a_kept_one_is_one_line():
    key = ("nvfp4_2d", "data", "even", "gather", "default", 2)
    assert promise_lines(Coverage(promised={key}, hits={key: 1})) == ["coverage: 1/1 promised cells hit"]
    lines = promise_lines(Coverage(promised={key}))
    assert lines[0].startswith("coverage: 0/1 promised cells hit, 1 MISSING")
    assert lines[1] == "  MISSING nvfp4_2d data even at ws2 (gather, default)"


# ------------------------------------------------------------------ 2. selections and output paths, checked first
BAD_VALUES = [
    ("--scenarios", "explode", "unknown scenario 'explode'; known: gather"),
    ("--formats", "fp7", "unknown format 'fp7'; known: "),
    ("--world-sizes", "x", "--world-sizes takes comma-separated integers"),
    ("--world-sizes", "0", "--world-sizes: a world size must be >= 1"),
    ("--impl", "no_such_impl", "--impl"),
    ("--device", "tpu", "--device"),
]


# plain pytest parses with the same parsers (qgather.suite.options), through one code path: one of them there
@pytest.mark.parametrize("how, option, value, says", [
    *(("run", *bad) for bad in BAD_VALUES),
    pytest.param("pytest", *BAD_VALUES[1], marks=pytest.mark.xdist_group(PLAIN_PYTEST))])
def test_a_bad_selection_value_is_one_line_exit_4(request, how, option, value, says):
    result = qgather("run", option, value) if how == "run" else plain_pytest(request, option, value)
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert says in result.stderr and "Traceback" not in result.stderr + result.stdout
    assert " passed" not in result.stdout and " skipped" not in result.stdout


@pytest.mark.parametrize("how", ["run", pytest.param("pytest", marks=pytest.mark.xdist_group(PLAIN_PYTEST))])
def test_a_selection_without_cases_is_a_usage_error(request, how):
    if how == "run":
        one_line(qgather("run", *NO_CASES), 4, "--formats nvfp4_1d --scenarios model", "no case")
    else:
        result = plain_pytest(request, *NO_CASES)
        assert result.returncode == 4, result.stdout[-2000:]
        assert "--formats nvfp4_1d --scenarios model: no case of the suite matches" in result.stderr


@pytest.mark.parametrize("how, option, path", [
    ("run", "--report-dir", "/proc/x"), ("run", "--junitxml", "/proc/x.xml"), ("run", "--qgather-json", "/proc/x.json"),
    ("run", "--qgather-json", "/"),
    pytest.param("pytest", "--report-dir", "/proc/x", marks=pytest.mark.xdist_group(PLAIN_PYTEST)),
])
def test_an_unwritable_output_is_refused_before_any_case(request, how, option, path):
    args = ("--formats", "nvfp4_2d", option, path)
    result = qgather("run", *args) if how == "run" else plain_pytest(request, *args)
    line = one_line(result, 4, option, path)
    assert "passed" not in result.stdout and "cannot write" in line or "is a directory" in line


# ------------------------------------------------------------------ 3. exit codes and --help
@pytest.mark.parametrize("argv, says", [
    (["selftest", "no_such_mutant"], "unknown mutant 'no_such_mutant'"),
    (["no_such_command"], "no such command"),
    (["list", "--no-such-option"], ""),
    (["gpu-check", "--no-such-option"], ""),
    (["coverage", "--scenarios", "explode"], "unknown scenario"),
])
def test_bad_input_exits_4_in_every_command(argv, says):
    result = qgather(*argv)
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert says in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_help_prints_help_and_exits_0(command):
    result = qgather(command, "--help")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: qgather {command}"), result.stdout[:500]
    lines = result.stdout.splitlines()
    if command == "run":  # qgather's own options first, then where pytest's are
        assert any(line.strip().startswith("--world-sizes") for line in lines[:12]), lines[:12]
        assert "python -m pytest --help" in lines[-1], lines[-1]
    for i, line in enumerate(lines):  # argparse: an option without help stands alone on its line
        if re.match(r"^  -\S", line) and "  " not in line.strip():
            following = lines[i + 1] if i + 1 < len(lines) else ""
            assert following.startswith(" " * 5), f"{command}: no help line for {line.strip()!r}"


def test_the_usage_error_docstring_states_the_code():
    from qgather.errors import UsageError

    assert "Exit\n    code 4" in UsageError.__doc__


def _ctrl_c_as_a_terminal_gives_it() -> None:
    """A test suite started in the background by a non-interactive shell inherits SIGINT ignored,
    and Python keeps it so: the run under test gets SIGINT's default back, as a terminal's would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_exits_2_and_says_what_ran(tmp_path, signum):
    """The run is interrupted while a case is certainly running: after the reference's cases, an
    adapter's first case hangs until the signal (a run of quick cases alone once ended before it).
    The report folder holds an earlier run's files: none of them survives (test_report_folder's claim
    for an interrupt during the session, made here where the signal's moment is known)."""
    out, marks = tmp_path / "reports", tmp_path / "marks"
    marks.mkdir()
    _earlier_run(out)
    proc = subprocess.Popen([sys.executable, "-m", "qgather", "run", "--formats", "fp8_tensor", "--scenarios", "gather",
                             "--world-sizes", "2", "--impl", "reference,tests._hang_adapters:HangsInAdapter",
                             "--case-timeout", "600", "--report-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                            env={**ENV, "QGATHER_TEST_MARKER_DIR": str(marks), "QGATHER_HANG_DETAIL": "0"},
                            preexec_fn=_ctrl_c_as_a_terminal_gives_it)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and len(os.listdir(marks)) < 2:
        time.sleep(0.2)  # polling for the hang's markers with a deadline, not synchronizing by sleeping
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 2, (proc.returncode, stdout[-2000:], stderr[-2000:])
    match = re.search(r"qgather: interrupted after (\d+) of (\d+) cases", stdout + stderr)
    assert match and 3 <= int(match[1]) < int(match[2]), stdout[-3000:]
    data = json.loads((out / "verdicts.json").read_text())
    assert data["incomplete"] is True and len(data["cases"]) == int(match[1])
    assert sum(data["outcomes"].values()) == int(match[1])  # the cases that did not run are counted nowhere
    assert "**incomplete (interrupted)**" in (out / "verdicts.md").read_text()
    # a JUnit reader takes it: every testcase named (pytest writes a nameless one for the test cut short)
    assert all(case.get("name") for case in ET.parse(out / "junit.xml").getroot().iter("testcase"))
    assert "coverage: not judged, the run was interrupted after" in stdout and "promised cells hit" not in stdout
    assert _left_of_the_earlier_run(out) == [], sorted(os.listdir(out))


def test_an_interrupt_while_collecting_says_so_rather_than_a_count_of_cases(tmp_path):
    """pytest's collection-finish hook runs on an interrupt too, with the items collected so far, not yet
    deselected: a run interrupted there says so, not "after 0 of 13288 cases" of a suite of 2466."""
    out = tmp_path / "reports"
    _earlier_run(out)  # none of its files survives an interrupt during the collection either
    result = qgather("run", "--formats", "fp8_tensor", "--world-sizes", "2", "-p", "tests._interrupt_collection",
                     "--report-dir", str(out), cwd=str(tmp_path))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "qgather: interrupted while collecting the cases, before any ran" in result.stdout + result.stderr
    data = json.loads((out / "verdicts.json").read_text())
    assert data["incomplete"] is True and data["collected_cases"] is None and data["cases"] == []
    assert "**incomplete (interrupted)** while collecting the cases" in (out / "verdicts.md").read_text()
    assert _left_of_the_earlier_run(out) == [], sorted(os.listdir(out))


def test_a_marker_selection_that_collects_nothing_is_a_usage_error_and_leaves_the_last_reports(tmp_path):
    """A -m (or -k: the same exit of pytest's, 5) that collects nothing: one line, exit 4, and a run that ran
    nothing leaves the last reports as they were."""
    out = tmp_path / "reports"
    out.mkdir()
    for name in ("verdicts.json", "verdicts.md", "junit.xml"):
        (out / name).write_text("the last run's\n")
    result = qgather("run", "--formats", "fp8_tensor", "--world-sizes", "2", "-m", "no_such_marker",
                     "--report-dir", str(out), cwd=str(tmp_path))
    one_line(result, 4, "collected no test")
    assert "reports written" not in result.stdout
    assert sorted(os.listdir(out)) == ["junit.xml", "verdicts.json", "verdicts.md"]
    assert all((out / name).read_text() == "the last run's\n" for name in os.listdir(out))


def _record(case: str, verdict: str) -> CaseRecord:
    return CaseRecord.from_dict({"case": case, "verdict": verdict, "passed": verdict != "FAILED"})


def test_coverage_counts_only_cases_that_ran():
    skipped = RunResults(cases=(_record("reference:nvfp4_2d:128x64:bf16:ws2:gather:s0", "SKIPPED"),), also_ran=(),
                         rows={}, other_tests=0)
    assert coverage_of(skipped) is None
    assert coverage_lines(skipped, interrupted=False) == ["coverage: nothing hit, no case ran (every case was SKIPPED)"]
    ran = RunResults(cases=(_record("reference:nvfp4_2d:128x64:bf16:ws2:gather:s0", "EXACT"),), also_ran=(),
                     rows={}, other_tests=0)
    assert coverage_lines(ran, interrupted=False)[0].startswith("coverage: ")
    assert coverage_lines(ran, interrupted=True) == [
        "coverage: not judged, the run was interrupted after 1 cases ran (coverage.md: their cells)"]


def test_a_signal_during_the_pools_shutdown_does_not_kill_the_process(monkeypatch):
    """Ctrl-C after pytest's last line (while the pools shut down) ends the command with its status."""
    from qgather.cli import common

    stopped = []

    def shutdown_interrupted() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # delivered while the shutdown runs
        stopped.append(True)

    monkeypatch.setattr(common, "shutdown_pools", shutdown_interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc = common.with_cleanup_on_signals("run", lambda argv: 0, [])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stopped == [True] and rc == 2
