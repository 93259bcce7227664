"""Which role this process plays in the session, asked of the config and the launcher (never of the
environment: a subprocess started by a test inherits PYTEST_XDIST_WORKER from the worker that runs
the test, but it is a session of its own).

    Role.REPORTER       the process that reports: the only one, or xdist's controller, or rank 0 of
                        a launched job: keeps the Recorder, writes the reports
    Role.XDIST_WORKER   runs tests; its reports carry the case records to the controller
    Role.QUIET_RANK     a launched job's rank other than 0: runs the same cases, reports nothing
                        but its own failures, to stderr (rank 0 reports the shared verdicts)
"""

from __future__ import annotations

import enum

import pytest

from qgather.runtime.launch import detect_launch


class Role(enum.Enum):
    """What this process does in the session (see the module docstring)."""

    REPORTER = "reporter"
    XDIST_WORKER = "xdist worker"
    QUIET_RANK = "quiet rank"


def role(config: pytest.Config) -> Role:
    """This process's role in the session `config` belongs to."""
    if hasattr(config, "workerinput"):  # how pytest-xdist marks a worker's config
        return Role.XDIST_WORKER
    launch = detect_launch()
    return Role.QUIET_RANK if launch is not None and launch.rank != 0 else Role.REPORTER
