"""qgather.pytest_plugin.xdist_status: xdist's status line on a non-terminal, written once per status."""

from __future__ import annotations

from types import SimpleNamespace

from qgather.pytest_plugin.xdist_status import XDIST_REPORTER, once_per_status


class StatusReporter:
    """xdist's TerminalDistReporter as far as the wrapper uses it: on a non-terminal, every
    ensure_show_status writes the current status as a new line."""

    def __init__(self) -> None:
        self.status = "bringing up nodes..."
        self.lines: list[str] = []

    def getstatus(self) -> str:
        return self.status

    def ensure_show_status(self) -> None:
        self.lines.append(self.getstatus())


def _config(plugins: dict) -> SimpleNamespace:
    return SimpleNamespace(pluginmanager=SimpleNamespace(get_plugin=plugins.get))


def test_a_status_equal_to_the_last_written_is_not_written_again():
    reporter = StatusReporter()
    once_per_status(_config({XDIST_REPORTER: reporter}))
    reporter.ensure_show_status()  # the workers are set up
    reporter.ensure_show_status()  # their collection is done: under -q the same line
    reporter.status = "2 workers [10 items]"
    reporter.ensure_show_status()
    reporter.ensure_show_status()
    assert reporter.lines == ["bringing up nodes...", "2 workers [10 items]"]


def test_a_session_without_xdist_is_left_alone():
    once_per_status(_config({}))  # no reporter registered: nothing to wrap, no error
