"""--report-dir (verdicts.md, verdicts.json, junit.xml) and the --baseline known-issues file: the
report's counts are pytest's own, every JUnit testcase carries its verdict, a listed failure is a
strict xfail, a listed case that passes fails the run, `qgather baseline update` round-trips."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from qgather.pytest_plugin import baseline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTANT = "mutant:unpadded_uneven"  # ERROR (would deadlock) on the uneven ws3 shapes, EXACT on the even ones
# Virtual worlds: no rank pools, so the whole selection runs in seconds.
SELECT = ["cases/test_virtual.py::test_virtual", "--formats", "fp8_tensor", "--world-sizes", "3", "--device", "cpu",
          "-p", "no:cacheprovider", "-q"]
FAILING = f"{MUTANT}:fp8_tensor:136x64:bf16:ws3:virtual:s0"
PASSING = f"{MUTANT}:fp8_tensor:3x1x64:bf16:ws3:virtual:s0"

# One xdist worker runs the whole module (`make test` uses --dist loadgroup): the xdist_run fixture runs once.
pytestmark = pytest.mark.xdist_group("reports")


def run(*args: str, module: str = "pytest") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)


def pytest_counts(stdout: str) -> dict[str, int]:
    """pytest's final line, e.g. '7 failed, 9 passed, 8 skipped in 2.75s'."""
    line = stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|xfailed|xpassed)", line)}


@pytest.fixture(scope="module")
def xdist_run(tmp_path_factory):
    """The selection with a failing mutant and an implementation skipped on CPU, under xdist."""
    out = tmp_path_factory.mktemp("reports")
    result = run(*SELECT, "--impl", f"reference,{MUTANT},te", "-n", "1", "--report-dir", str(out))
    return result, out


def test_matrix_counts_are_pytests_counts(xdist_run):
    result, out = xdist_run
    assert result.returncode == 1, result.stdout[-2000:]
    counts = pytest_counts(result.stdout)
    assert counts.get("failed") and counts.get("passed") and counts.get("skipped"), counts
    data = json.loads((out / "verdicts.json").read_text())
    assert {k: n for k, n in data["outcomes"].items() if n} == counts
    cases = sum(sum(row["verdicts"].values()) for row in data["matrix"])
    assert cases == len(data["cases"]) == len({c["case"] for c in data["cases"]}) == sum(counts.values())
    failed = {f["case"] for f in data["failures"]}
    assert FAILING in failed and len(failed) == counts["failed"]
    assert data["environment"]["torch"] and data["session"]["device"] == "cpu"
    markdown = (out / "verdicts.md").read_text()
    assert f"{counts['failed']} failed" in markdown and "| implementation | format | ws | shape class |" in markdown
    assert f"`{FAILING}` | ERROR |" in markdown and f"`qgather case {FAILING} --device cpu`" in markdown
    assert "aligned uneven zero-row" in markdown


def test_junit_testcases_carry_verdict_repro_and_report(xdist_run):
    _result, out = xdist_run
    testcases = ET.parse(out / "junit.xml").getroot().iter("testcase")
    seen = 0
    for testcase in testcases:
        props = {p.get("name"): p.get("value") for p in testcase.iter("property")}
        case = testcase.get("name").split("[", 1)[1].rstrip("]")
        assert set(props) == {"verdict", "repro", "report"}, props
        assert props["repro"] == f"qgather case {case} --device cpu"
        assert props["report"].startswith(f"{case}: {props['verdict']}")
        seen += 1
    assert seen == sum(pytest_counts(_result.stdout).values())


def write_baseline(path, *entries: tuple[str, str, str]) -> str:
    path.write_text(baseline.dumps([baseline.KnownIssue(*e) for e in entries]))
    return str(path)


BASELINE_SELECT = [*SELECT, "--impl", MUTANT, "-k", "136x64 or 3x1x64"]


def test_a_listed_failure_is_an_xfail_and_the_run_stays_green(tmp_path):
    known = write_baseline(tmp_path / "known.toml", (f"{MUTANT}:*:136x64:*", "pads nothing", "https://example/1"))
    result = run(*BASELINE_SELECT, "-rx", "--baseline", known, "--report-dir", str(tmp_path / "r"))
    assert result.returncode == 0, result.stdout[-2000:]
    assert pytest_counts(result.stdout) == {"passed": 1, "xfailed": 1}
    assert "known issue: pads nothing (https://example/1)" in result.stdout
    data = json.loads((tmp_path / "r" / "verdicts.json").read_text())
    assert [k["case"] for k in data["known_issues"]] == [FAILING]
    assert "Known issues from the baseline (1 xfailed)" in (tmp_path / "r" / "verdicts.md").read_text()


def test_a_listed_case_that_passes_fails_the_run(tmp_path):
    known = write_baseline(tmp_path / "known.toml", (FAILING, "pads nothing", ""), (PASSING, "was broken", ""))
    result = run(*BASELINE_SELECT, "--baseline", known)
    assert result.returncode == 1, result.stdout[-2000:]
    assert pytest_counts(result.stdout) == {"failed": 1, "xfailed": 1}
    assert f"{PASSING}: EXACT, which passes, but the baseline {known} lists it" in result.stdout
    assert "Update the baseline" in result.stdout


@pytest.mark.parametrize("command", ["pytest", "run"])
def test_a_bad_baseline_is_one_clear_line(tmp_path, command):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[issue]]\ncase = "x\n')
    if command == "pytest":
        result = run(*SELECT, "--baseline", str(bad))
        assert result.returncode == 4
    else:
        result = run("run", "--baseline", str(bad), "--formats", "fp8_tensor", module="qgather")
        assert result.returncode == 4
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"baseline {bad}: not valid TOML" in lines[0] and "line 2" in lines[0]


def test_a_baseline_entry_without_a_reason_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[issue]]\ncase = "x:*"\nlink = ""\n')
    with pytest.raises(baseline.BaselineError, match=r"issue #1: `reason` must be a non-empty string"):
        baseline.load(str(bad))


def record(case: str, verdict: str, reason: str = "") -> dict:
    return {"case": case, "verdict": verdict, "passed": verdict in ("EXACT", "SKIPPED"), "reason": reason}


def test_baseline_update_round_trip(tmp_path):
    known = write_baseline(
        tmp_path / "known.toml",
        ("impl:f:*:ws3:*", "uneven shards", "https://example/7"),  # still fails: reason and link kept
        ("impl:f:8x64:bf16:ws2:gather:s0", "fixed upstream", ""),  # passes now: dropped
        ("other:*", "not run this time", "https://example/9"),  # no case of the run: kept as is
    )
    run_json = tmp_path / "verdicts.json"
    run_json.write_text(json.dumps({"cases": [
        record("impl:f:5x64:bf16:ws3:gather:s0", "CRASH", "rank 2 killed by SIGABRT\nmore"),
        record("impl:f:8x64:bf16:ws2:gather:s0", "EXACT"),
        record("impl:f:4x64:bf16:ws2:gather:s0", "SILENT_MISMATCH", "rows differ\n  detail"),
        record("te:f:4x64:bf16:ws2:gather:s0", "SKIPPED", "no GPU"),
    ]}))
    result = run("baseline", "update", "--from", str(run_json), "--file", known, module="qgather")
    assert result.returncode == 0, result.stderr
    assert "3 entries (1 new, 1 kept, 1 dropped as passing, 1 not covered by this run)" in result.stdout
    assert {i.case: (i.reason, i.link) for i in baseline.load(known)} == {
        "impl:f:5x64:bf16:ws3:gather:s0": ("uneven shards", "https://example/7"),
        "impl:f:4x64:bf16:ws2:gather:s0": ("SILENT_MISMATCH: rows differ", ""),
        "other:*": ("not run this time", "https://example/9"),
    }
    before = open(known).read()
    assert run("baseline", "update", "--from", str(run_json), "--file", known, module="qgather").returncode == 0
    assert open(known).read() == before  # a second update from the same run changes nothing


def test_baseline_update_from_a_file_that_is_not_a_run_is_one_line(tmp_path):
    (tmp_path / "x.json").write_text('{"what": 1}')
    result = run("baseline", "update", "--from", str(tmp_path / "x.json"), "--file", str(tmp_path / "k.toml"),
                 module="qgather")
    assert result.returncode == 4 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "not a qgather verdicts.json" in result.stderr


def test_exact_ids_with_glob_characters_match_only_themselves():
    case = "pkg.mod:Adapter[v2]:f:4x64:bf16:ws2:gather:s0"
    issue = baseline.KnownIssue(baseline.escape(case), "r")
    assert issue.matches(case) and not issue.matches(case.replace("[v2]", "v"))
