"""qgather's pytest plugin, registered through the `qgather` pytest11 entry point: this module only
gathers the hooks and the fixture of its parts, which pytest finds here by name.

    options     every option, declared once and parsed where declared; `Settings`
    collection  a case module's SWEEP -> the `case` parametrization
    fixture     the documented `qgather` fixture (QgatherFixture): runs, records, checks a case
    affinity    the GPU job's xdist scheduling: a worker keeps to one world size
    lookahead   the GPU job's pools start ahead of the cases queued for a worker
    role        this process's role: reporter, xdist worker, or a launched job's quiet rank
    session     configure/unconfigure per role; the pools' shutdown
    recorder    the session's records on config.stash (the reporting process only)
    results     what every report counts, reconciled with pytest's final line
    summary     the terminal summary;  reports: verdicts.json / verdicts.md;  baseline: --baseline
    xdist_status  xdist's status line once per status where the output is no terminal
"""

from __future__ import annotations

from qgather.quiet import quiet_torchao

quiet_torchao()  # before torchao is first imported (the imports below reach it)

from qgather.pytest_plugin.affinity import pytest_xdist_make_scheduler  # noqa: E402
from qgather.pytest_plugin.collection import (  # noqa: E402
    pytest_collection_finish,
    pytest_collection_modifyitems,
    pytest_generate_tests,
)
from qgather.pytest_plugin.fixture import QgatherFixture, qgather  # noqa: E402
from qgather.pytest_plugin.lookahead import pytest_runtest_protocol  # noqa: E402
from qgather.pytest_plugin.options import pytest_addoption  # noqa: E402
from qgather.pytest_plugin.session import (  # noqa: E402
    pytest_configure,
    pytest_report_header,
    pytest_runtest_teardown,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_terminal_summary,
    pytest_unconfigure,
)

__all__ = [
    "QgatherFixture",
    "pytest_addoption",
    "pytest_collection_finish",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_report_header",
    "pytest_runtest_protocol",
    "pytest_runtest_teardown",
    "pytest_sessionfinish",
    "pytest_sessionstart",
    "pytest_terminal_summary",
    "pytest_unconfigure",
    "pytest_xdist_make_scheduler",
    "qgather",
]
