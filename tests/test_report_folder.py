"""One run, one report folder: everything a run writes lands in its --report-dir (junit.xml too when
--junitxml names another path), an earlier run's files do not survive beside the new ones, and a run
interrupted at any point, start-up included, leaves reports that say incomplete (during the session:
test_cli_ux's interrupted runs, whose folders hold an earlier run's files). About 20 s on 2 cores: one short
run, and one interrupted at start-up (isolated: its signal is timed, which a loaded neighbour delays)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from qgather.model.report_folder import REPORT_FILES, remove_older, write_interrupted

REPO = Path(__file__).resolve().parent.parent
ENV = {**{k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")},
       "PYTHONPATH": str(REPO / "harness")}
OLD = "the last run's\n"


def _earlier_run(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in REPORT_FILES:
        (folder / name).write_text(OLD)
    past = time.time() - 60
    for name in REPORT_FILES:
        os.utime(folder / name, (past, past))


def _left_of_the_earlier_run(folder: Path) -> list[str]:
    return [name for name in os.listdir(folder) if (folder / name).read_text() == OLD]


def test_an_interrupted_start_is_written_and_an_earlier_runs_files_go(tmp_path):
    folder = tmp_path / "rep"
    _earlier_run(folder)
    started = time.time()
    assert write_interrupted(str(folder), started, "interrupted before the first case ran")
    assert sorted(os.listdir(folder)) == ["junit.xml", "verdicts.json", "verdicts.md"]
    assert json.loads((folder / "verdicts.json").read_text())["incomplete"] is True
    assert "incomplete (interrupted)" in (folder / "verdicts.md").read_text()
    props = {p.get("name"): p.get("value") for p in ET.parse(folder / "junit.xml").getroot().iter("property")}
    assert props == {"incomplete": "interrupted before the first case ran"}
    # the session's own reports, once written, are never replaced by these
    assert not write_interrupted(str(folder), started, "again")
    (folder / "coverage.md").write_text("this run's\n")
    os.utime(folder / "coverage.md", (started - 60, started - 60))
    assert remove_older(str(folder), started) == ["coverage.md"]


def test_the_folder_holds_this_runs_files_only_with_junitxml_elsewhere(tmp_path):
    folder, elsewhere = tmp_path / "rep", tmp_path / "ci" / "junit-elsewhere.xml"
    _earlier_run(folder)
    (folder / "verdicts.json.partial").write_text(OLD)
    run = subprocess.run([sys.executable, "-m", "qgather", "run", "--formats", "fp8_tensor", "--world-sizes", "2",
                          "--scenarios", "gather", "-k", "test_alignment and 128x64", "--report-dir", str(folder),
                          "--junitxml", str(elsewhere)], capture_output=True, text=True, cwd=tmp_path, env=ENV,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert _left_of_the_earlier_run(folder) == [] and "verdicts.json.partial" not in os.listdir(folder)
    assert (folder / "junit.xml").read_bytes() == elsewhere.read_bytes()
    assert "reports written to" in run.stdout and "junit.xml" in run.stdout.split("reports written to")[1]


def _ctrl_c_as_a_terminal_gives_it() -> None:
    """A background shell's children inherit SIGINT ignored: the run gets a terminal's default back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.isolated
@pytest.mark.parametrize("after_s", [1])
def test_an_interrupt_at_any_point_leaves_reports_that_say_incomplete(tmp_path, after_s):
    """Ctrl-C at 1 s (torch still loading: no session yet): exit 2, and the folder's reports say incomplete,
    none of them the earlier run's. The signal's time is the experiment (a point of the run's life), not a
    wait for something to happen. The same during the session, collecting and running, without a timer
    (this test's 20 s point once): test_cli_ux's test_an_interrupt_while_collecting_says_so_rather_than_a_
    count_of_cases and test_an_interrupted_run_exits_2_and_says_what_ran, whose folders hold an earlier run."""
    folder = tmp_path / "rep"
    _earlier_run(folder)
    proc = subprocess.Popen([sys.executable, "-m", "qgather", "run", "--formats", "fp8_tensor,nvfp4_2d",
                             "--world-sizes", "2,4", "--report-dir", str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=ENV,
                            preexec_fn=_ctrl_c_as_a_terminal_gives_it)
    try:
        proc.communicate(timeout=after_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, (proc.returncode, stdout[-2000:], stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    data = json.loads((folder / "verdicts.json").read_text())
    assert data["incomplete"] is True, data
    assert "incomplete (interrupted)" in (folder / "verdicts.md").read_text()
    assert _left_of_the_earlier_run(folder) == [], os.listdir(folder)


INTERRUPTED_WHILE_THE_COMMAND_LINE_LOADS = """
import importlib.abc, signal, sys

class CtrlC(importlib.abc.MetaPathFinder):  # Ctrl-C the moment qgather.cli's own modules load
    def find_spec(self, name, path, target=None):
        if name == "qgather.cli.common":
            signal.raise_signal(signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["qgather", "run", "--report-dir", "rep"]
from qgather.__main__ import main
sys.exit(main())
"""


def test_an_interrupt_while_the_command_line_loads_leaves_reports_that_say_incomplete(tmp_path):
    """The `qgather` script's first line holds Ctrl-C back until `qgather run` can say it was interrupted:
    loading the command line takes 0.2 s, over 3 s on a loaded 2-core host, and a Ctrl-C in it ended
    the process by the signal or in a bare traceback, without reports. Deterministic: the signal is raised
    while qgather.cli loads, not timed."""
    _earlier_run(tmp_path / "rep")
    run = subprocess.run([sys.executable, "-c", INTERRUPTED_WHILE_THE_COMMAND_LINE_LOADS], capture_output=True,
                         text=True, cwd=tmp_path, env=ENV, timeout=120, preexec_fn=_ctrl_c_as_a_terminal_gives_it)
    assert run.returncode == 2 and run.stderr.strip() == "qgather run: interrupted", (run.returncode, run.stderr)
    data = json.loads((tmp_path / "rep" / "verdicts.json").read_text())
    assert data["incomplete"] is True and data["cases"] == []
    assert _left_of_the_earlier_run(tmp_path / "rep") == []


def test_a_signal_while_torch_loads_is_delivered_once_it_has_loaded():
    """The interrupts held back during torch's import (qgather.cli.interrupts) arrive after it, once each:
    inside the block the signal raises nothing, after it the process's own handler sees it."""
    from qgather.cli.interrupts import signals_held_back

    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))
    # Ctrl-C's handler as a terminal's Python has it: a process started in the background by a non-interactive
    # shell (or an xdist worker of one) inherits SIGINT ignored, and nothing would be raised to hold back.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_held_back():
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGTERM)
                assert seen == []
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
