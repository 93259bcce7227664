"""A gating run in which an implementation named with --impl had every case skipped tested nothing
of it: the run is red, with the skip reason, not green. The checked-in known-issues.toml gates the GPU
runs recorded in tests/data (every failing case matched, no passing one), links every finding to its
report or an existing docs/findings.md section, and is in the layout `qgather baseline update` writes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from qgather.pytest_plugin.baseline import dumps, load, load_findings, match
from tests._shared_runs import ALIGNMENT_GROUP, ALIGNMENT_RUN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNOWN_ISSUES = os.path.join(REPO, "known-issues.toml")
# One H100, TE 2.20.2: `make test-multigpu`'s te and te:delayed gates at 1 and 2 ranks (cases that ran).
GPU_GATES = ["gate-te-h100.json", "gate-te-delayed-h100.json"]
SELECT = ALIGNMENT_RUN


SKIPS_ALL = "tests._skip_adapters:SkipsEverything"


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", *SELECT, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_an_implementation_with_every_case_skipped_fails_the_run():
    # the adapter skips every case it declares (its library is missing): it tested nothing
    result = pytest_run("--impl", f"reference,{SKIPS_ALL}")
    assert result.returncode == 1, result.stdout[-2000:]
    assert f"every {SKIPS_ALL} case was skipped" in result.stdout, result.stdout[-2000:]
    assert "this adapter's library is not installed here" in result.stdout
    assert "passed" in result.stdout.splitlines()[-1]  # the reference cases themselves passed


def test_an_implementation_of_another_device_is_refused_before_anything_runs():
    # te runs on CUDA only: on --device cpu it has no case, which is bad input, not a run of skips
    result = pytest_run("--impl", "reference,te")
    assert result.returncode == 4, result.stdout[-2000:]
    assert "--impl te: no case of the selection (te runs on cuda only, and this run's device is cpu)" in result.stderr


@pytest.mark.xdist_group(ALIGNMENT_GROUP)
def test_the_default_selection_is_not_affected(alignment_run):
    """SELECT, without --impl: the shared run (tests/_shared_runs.py, also test_coverage's)."""
    assert alignment_run.returncode == 0, alignment_run.stdout[-2000:]
    assert "was skipped" not in alignment_run.stdout


@pytest.mark.parametrize("name", GPU_GATES)
def test_the_baseline_gates_the_recorded_gpu_runs(name):
    with open(os.path.join(REPO, "tests", "data", name)) as fh:
        run = json.load(fh)
    issues = load(KNOWN_ISSUES)
    assert run["failing"] and run["passing"]
    assert [case for case in run["failing"] if match(issues, case) is None] == []
    assert {case: match(issues, case).case for case in run["passing"] if match(issues, case)} == {}


def test_every_finding_links_to_its_report_or_an_existing_findings_section():
    with open(os.path.join(REPO, "docs", "findings.md")) as fh:
        anchors = set(re.findall(r'<a id="([^"]+)"></a>', fh.read()))
    findings = load_findings(KNOWN_ISSUES)
    assert len({f.title for f in findings}) == len(findings)  # one entry per defect
    for finding in findings:
        link = finding.link
        if link.startswith("docs/findings.md#"):
            assert link.split("#", 1)[1] in anchors, f"{finding.title}: {link} names no anchor of docs/findings.md"
        elif link.startswith("docs/upstream/"):  # a draft not yet filed upstream (qgather.tools.standalone)
            assert os.path.isfile(os.path.join(REPO, link)), f"{finding.title}: no draft {link}"
        else:  # an upstream report: one issue or pull request, not a project's issue list
            assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+", link), (finding.title, link)
    assert "placeholder" not in open(KNOWN_ISSUES).read()


def test_the_baseline_is_in_the_layout_an_update_writes():
    # So that `qgather baseline update` changes only what it must (a minimal diff).
    with open(KNOWN_ISSUES) as fh:
        assert dumps(load_findings(KNOWN_ISSUES)) == fh.read()
