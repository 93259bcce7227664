"""One run, one report folder: the files a run writes to `--report-dir`, what is left of an earlier run
(removed, so that a folder a CI job uploads never mixes two runs), and the reports of a run interrupted
before its session wrote any, written without torch (the command line's interrupt handler can).

    remove_stale("reports", written=("verdicts.md", "verdicts.json", "junit.xml"))   # an old timings.md goes
    remove_older("reports", started)        # what a run started at `started` did not write
    write_interrupted("reports", started, "interrupted before the first case ran")
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from xml.sax.saxutils import quoteattr

#: every file a run writes to its report folder (qgather.pytest_plugin.reports and recorder)
REPORT_FILES = ("verdicts.md", "verdicts.json", "junit.xml", "coverage.md", "timings.md")
PARTIAL = ".partial"  # a file being replaced whole (qgather.pytest_plugin.reports.write_text)


def remove_stale(directory: str, written: Iterable[str]) -> list[str]:
    """Remove the report files an earlier run left in `directory` that this run did not write (and any
    half-written one); the names removed."""
    keep = set(written)
    gone = []
    for name in REPORT_FILES:
        for candidate in (name, name + PARTIAL):
            path = os.path.join(directory, candidate)
            if candidate not in keep and os.path.isfile(path):
                os.remove(path)
                gone.append(candidate)
    return gone


def remove_older(directory: str, started: float) -> list[str]:
    """Remove the report files in `directory` that a run started at `started` (time.time()) did not write:
    an earlier run's (`remove_stale` with this run's files kept); the names removed."""
    mine = []
    for name in REPORT_FILES:
        try:
            if os.path.getmtime(os.path.join(directory, name)) >= started:
                mine.append(name)
        except OSError:
            continue
    return remove_stale(directory, mine)


def written_since(directory: str, started: float) -> bool:
    """Whether this run (started at `started`, time.time()) has written its verdicts into `directory`."""
    try:
        return os.path.getmtime(os.path.join(directory, "verdicts.json")) >= started
    except OSError:
        return False


def write_interrupted(directory: str, started: float, what: str) -> bool:
    """The reports of a run interrupted before its session wrote any (`what` says when): verdicts.json with
    `"incomplete": true` and no case, verdicts.md and junit.xml saying so, the earlier run's files removed.
    Nothing when this run wrote its own already (they say incomplete themselves); whether it wrote."""
    if written_since(directory, started):
        return False
    os.makedirs(directory, exist_ok=True)
    data = {"incomplete": True, "interrupted": what, "collected_cases": 0, "cases": [], "outcomes": {}}
    files = {
        "verdicts.json": json.dumps(data, indent=1) + "\n",
        "verdicts.md": f"# qgather verdicts\n\n**incomplete (interrupted)**: {what}; no case ran.\n",
        "junit.xml": ('<?xml version="1.0" encoding="utf-8"?>\n<testsuites><testsuite name="qgather" tests="0" '
                      'errors="0" failures="0" skipped="0"><properties><property name="incomplete" '
                      f'value={quoteattr(what)} /></properties></testsuite></testsuites>\n'),
    }
    for name, text in files.items():
        partial = os.path.join(directory, name + PARTIAL)
        with open(partial, "w") as fh:
            fh.write(text)
        os.replace(partial, os.path.join(directory, name))
    remove_stale(directory, files)
    return True
