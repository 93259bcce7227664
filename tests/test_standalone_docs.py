"""The findings' standalone scripts and upstream drafts are what the generator writes, and are linked
from their findings (docs/findings.md) and from known-issues.toml (`make repro-docs` regenerates)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from qgather.model.case import CaseSpec
from qgather.pytest_plugin.baseline import load, load_findings, match
from qgather.tools.standalone.docs import expected_files, stale_files
from qgather.tools.standalone.findings import FINDINGS
from qgather.tools.standalone.generate import MAX_LINES, readable_lines, template_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_checked_in_scripts_and_drafts_match_the_generator():
    assert stale_files(REPO) == [], "run `make repro-docs`"


def test_check_names_a_stale_file_and_fails(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "harness")}
    command = [sys.executable, "-m", "qgather.tools.standalone", "--check", "--root", str(tmp_path)]
    missing = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 1 and f"docs/repro/{FINDINGS[0].name}.py" in missing.stderr
    written = subprocess.run(command[:-3] + ["--root", str(tmp_path)], capture_output=True, text=True, env=env,
                             timeout=120)
    assert written.returncode == 0, written.stderr
    assert subprocess.run(command, capture_output=True, env=env, timeout=120).returncode == 0
    (tmp_path / "docs" / "repro" / f"{FINDINGS[0].name}.py").write_text("# edited by hand\n")
    assert subprocess.run(command, capture_output=True, env=env, timeout=120).returncode == 1


def test_every_script_and_draft_is_linked_from_its_finding_and_the_baseline():
    with open(os.path.join(REPO, "docs", "findings.md"), encoding="utf-8") as fh:
        findings = fh.read()
    issues = load(os.path.join(REPO, "known-issues.toml"))
    links = {entry.link for entry in load_findings(os.path.join(REPO, "known-issues.toml"))}
    linked = 0
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', findings))
    for finding in FINDINGS:
        assert finding.anchor in anchors, finding.name
        section = findings.split(f'<a id="{finding.anchor}"></a>', 1)[1].split("<a id=", 1)[0]
        assert f"docs/repro/{finding.name}.py" in section and f"upstream/{finding.name}.md" in section, finding.name
        draft = f"docs/upstream/{finding.name}.md"
        entry = match(issues, finding.case_id)  # None: a shape of no gated suite (the entry covers the suite's)
        assert entry is None or entry.link == draft, (finding.name, entry)
        assert draft in expected_files()
        linked += draft in links
    # every one but the precompute hang and TE's Shard(1) case, which no gated suite runs
    assert linked == len(FINDINGS) - 2


def test_every_findings_script_is_short():
    """What a maintainer reads of each finding's script stays within its library's limit."""
    files = expected_files()
    for finding in FINDINGS:
        text = files[f"docs/repro/{finding.name}.py"]
        limit = MAX_LINES[template_for(CaseSpec.parse(finding.case_id)).library]
        assert readable_lines(text) <= limit, (finding.name, readable_lines(text), limit)
