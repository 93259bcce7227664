"""The tests' own fixtures: a guard that no test writes into the checkout's reports/ (a user's last
`make run`); tests that run the suite give it a tmp --report-dir or cwd; a run of the case suite that
several tests check (each marks itself with its xdist_group, so that one worker makes it once)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests._shared_runs import run_alignment

REPORTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reports")


def _listing() -> dict[str, float]:
    if not os.path.isdir(REPORTS):
        return {}
    return {name: os.stat(os.path.join(REPORTS, name)).st_mtime_ns for name in sorted(os.listdir(REPORTS))}


@pytest.fixture(scope="session", autouse=True)
def checkout_reports_untouched():
    """Fail the session's last test when the checkout's reports/ changed while the tests ran."""
    before = _listing()
    yield
    assert _listing() == before, "a test wrote into the checkout's reports/: give it a tmp --report-dir or cwd"


@pytest.fixture(scope="session")
def alignment_run() -> subprocess.CompletedProcess:
    """tests._shared_runs.ALIGNMENT_RUN, made once per worker (its tests share ALIGNMENT_GROUP: once in all)."""
    return run_alignment()
