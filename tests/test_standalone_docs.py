"""The findings' standalone scripts and upstream drafts are what the generator writes, and are linked
from their findings (docs/findings.md) and from known-issues.toml (`make repro-docs` regenerates)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

from qgather.pytest_plugin.baseline import load, load_findings, match
from qgather.tools.standalone.docs import expected_files as _expected_files
from qgather.tools.standalone.docs import stale_files
from qgather.tools.standalone.findings import FINDINGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
expected_files = functools.lru_cache(maxsize=1)(_expected_files)  # rendered once for the tests below


def test_checked_in_scripts_and_drafts_match_the_generator():
    assert stale_files(REPO) == [], "run `make repro-docs`"


def test_check_names_a_stale_file_and_fails(tmp_path, capsys):
    """`python -m qgather.tools.standalone --check` as `make repro-docs`'s check runs it, once in a process of
    its own (its exit status); the writing and the checks after it through its main in this process."""
    from qgather.tools.standalone.__main__ import main

    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "harness")}
    command = [sys.executable, "-m", "qgather.tools.standalone", "--check", "--root", str(tmp_path)]
    missing = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 1 and f"docs/repro/{FINDINGS[0].name}.py" in missing.stderr
    assert main(["--root", str(tmp_path)]) == 0, capsys.readouterr().err
    assert main(["--check", "--root", str(tmp_path)]) == 0, capsys.readouterr().err
    edited = f"docs/repro/{FINDINGS[0].name}.py"
    (tmp_path / edited).write_text("# edited by hand\n")
    capsys.readouterr()
    assert main(["--check", "--root", str(tmp_path)]) == 1
    stale = capsys.readouterr().err.splitlines()
    assert len(stale) == 1 and edited in stale[0], stale


def test_every_script_and_draft_is_linked_from_its_finding_and_the_baseline():
    with open(os.path.join(REPO, "docs", "findings.md"), encoding="utf-8") as fh:
        findings = fh.read()
    issues = load(os.path.join(REPO, "known-issues.toml"))
    links = {entry.link for entry in load_findings(os.path.join(REPO, "known-issues.toml"))}
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', findings))
    matched, files = 0, expected_files()
    for finding in FINDINGS:
        assert finding.anchor in anchors, finding.name
        section = findings.split(f'<a id="{finding.anchor}"></a>', 1)[1].split("<a id=", 1)[0]
        assert f"docs/repro/{finding.name}.py" in section and f"upstream/{finding.name}.md" in section, finding.name
        draft = f"docs/upstream/{finding.name}.md"
        assert draft in files
        entry = match(issues, finding.case_id) if finding.case_id else None  # None: no gated suite runs it
        assert entry is None or entry.link == draft, (finding.name, entry)
        matched += entry is not None and draft in links
    assert matched >= 11  # the gated suites' findings link their drafts from the baseline


def test_findings_ship_enough_scripts_and_drafts():
    """Issue 43's floor: at least 18 scripts and 18 drafts, and every finding section either links its
    script or says why none can exist."""
    files = expected_files()
    assert sum(path.endswith(".py") for path in files) >= 18 and sum(path.endswith(".md") for path in files) >= 18
    with open(os.path.join(REPO, "docs", "findings.md"), encoding="utf-8") as fh:
        sections = re.split(r"\n#{2,3} ", fh.read())[1:]
    for section in sections:
        title = section.splitlines()[0]
        if title.startswith(("TransformerEngine 2.20.2 on its own", "TE on FSDP2 configurations", "Not yet triaged",
                             "Which releases show which finding", "Not findings")):
            continue  # an overview, the version matrix or what is no library's defect: not a finding
        assert "docs/repro/" in section or "**Standalone**: none" in section, title


def test_every_findings_script_is_short():
    """Each finding's script stays within 200 lines (the reference's limit counts what precedes SOURCES)."""
    for path, text in expected_files().items():
        if path.endswith(".py"):
            assert len(text.splitlines()) <= 200, (path, len(text.splitlines()))


def test_gpu_runner_runs_every_te_script():
    """docs/repro/run-gpu.sh names every TransformerEngine script, each under its own timeout."""
    runner = expected_files()["docs/repro/run-gpu.sh"]
    for finding in FINDINGS:
        te = finding.library == "TransformerEngine"
        assert (f"docs/repro/{finding.name}.py" in runner) == te, finding.name
    assert 'timeout -k 5 "$PER_SCRIPT_S"' in runner
    assert subprocess.run(["bash", "-n"], input=runner, text=True, timeout=30).returncode == 0
