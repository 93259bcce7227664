"""pytest-xdist's worker status line where the output is no terminal (CI logs, `make run | tee`).

There xdist cannot rewrite its status line in place, so it writes it as a new line at each phase; under
`-q` (as `qgather run` passes) the line is always "bringing up nodes...", so a run's log began with it
twice. The reporting process keeps xdist's line but never writes the same one twice in a row.
"""

from __future__ import annotations

import pytest

XDIST_REPORTER = "terminaldistreporter"  # the name pytest-xdist registers its terminal reporter under


def once_per_status(config: pytest.Config) -> None:
    """Wrap xdist's terminal reporter (when xdist distributes this session) so that a status line equal
    to the last one it wrote is not written again."""
    reporter = config.pluginmanager.get_plugin(XDIST_REPORTER)
    if reporter is None or not hasattr(reporter, "ensure_show_status"):
        return
    show = reporter.ensure_show_status
    last: list[str] = []  # the status written last (one at most)

    def ensure_show_status() -> None:
        status = reporter.getstatus()
        if last == [status]:
            return
        last[:] = [status]
        show()

    reporter.ensure_show_status = ensure_show_status
