"""--report-dir (verdicts.md, verdicts.json, junit.xml) and the --baseline known-issues file: the
report's counts are pytest's own, every JUnit testcase carries its verdict, a listed failure is a
strict xfail, a listed case that passes fails the run, `qgather baseline update` changes only what it must
(no port or mid-word cut in a reason it writes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from qgather.pytest_plugin import baseline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTANT = "mutant:unpadded_uneven"  # ERROR (would deadlock) on the uneven ws3 shapes, EXACT on the even ones
# Virtual worlds: no rank pools, so the whole selection runs in seconds.
SELECT = ["cases/test_virtual.py::test_virtual", "--formats", "fp8_tensor", "--world-sizes", "3", "--device", "cpu",
          "-p", "no:cacheprovider", "-q"]
FAILING = f"{MUTANT}:fp8_tensor:136x64:bf16:ws3:virtual:s0"
PASSING = f"{MUTANT}:fp8_tensor:3x16:bf16:ws3:virtual:s0"
SKIPS = "tests._skip_adapters:SkipsUnevenShards"  # SKIPPED on the uneven ws3 shapes, for a reason of its own

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
    """The selection with a failing mutant and an adapter that skips some cases, under xdist."""
    out = tmp_path_factory.mktemp("reports")
    result = run(*SELECT, "--impl", f"reference,{MUTANT},{SKIPS}", "-n", "1", "--report-dir", str(out))
    return result, out


def test_xdist_s_status_line_is_written_once_where_the_output_is_no_terminal(xdist_run):
    result, _ = xdist_run  # captured, as in CI or `make run | tee`: xdist wrote it once per phase
    assert result.stdout.count("bringing up nodes...") == 1, result.stdout[:500]


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


BASELINE_SELECT = [*SELECT, "--impl", MUTANT, "-k", "136x64 or 3x16"]


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


def write_findings(path, *findings: baseline.Finding) -> str:
    path.write_text(baseline.dumps(findings, path.name))
    return str(path)


UNEVEN = baseline.Finding("lib: uneven shards", ("impl:f:5x64:*:ws3:*", "impl:f:8x64:bf16:ws2:*"), "short rank",
                          "https://github.com/o/lib/issues/7")
ZERO = baseline.Finding("lib: zero rows", ("impl:f:1x16:*",), link="docs/findings.md#zero")


@dataclass(frozen=True)
class Updated:
    """What `qgather baseline update` printed: its stdout and stderr."""

    stdout: str
    stderr: str


@pytest.fixture
def baseline_update(capsys) -> Callable[..., Updated]:
    """`qgather baseline update ARGS` through the command line's own main, in this process (the update's
    logic does not depend on a fresh process; the exit code and one-line refusal of a real process are
    test_baseline_update_from_a_file_that_is_not_a_run_is_one_line's); asserts exit 0."""
    from qgather.cli import main

    def update(*args: str) -> Updated:
        capsys.readouterr()
        rc = main(["baseline", "update", *args])
        out, err = capsys.readouterr()
        assert rc == 0, err
        return Updated(out, err)

    return update


def update_file(tmp_path, baseline_update, findings, cases: list[dict]) -> tuple[str, str, Updated]:
    """(the file before, after, the command's output) of `qgather baseline update` from a run of these cases."""
    known = write_findings(tmp_path / "known.toml", *findings)
    before = open(known).read()
    run_json = tmp_path / "verdicts.json"
    run_json.write_text(json.dumps({"cases": cases}))
    result = baseline_update("--from", str(run_json), "--file", known)
    return before, open(known).read(), result


def test_baseline_update_with_every_failure_covered_changes_nothing(tmp_path, baseline_update):
    before, after, result = update_file(tmp_path, baseline_update, [UNEVEN, ZERO], [
        record("impl:f:5x64:bf16:ws3:gather:s0", "CRASH", "rank 2 killed by SIGABRT"),
        record("impl:f:5x64:fp32:ws3:steps:s0:dcp-ws1", "CRASH", "a configured variant"),  # new, covered
        record("impl:f:8x64:bf16:ws2:gather:s0", "ERROR", "raised"),
        record("impl:f:4x64:bf16:ws2:gather:s0", "EXACT"),
        record("te:f:4x64:bf16:ws2:gather:s0", "SKIPPED", "no GPU"),  # ZERO matched no case: kept
    ])
    assert after == before
    assert ("3 failing cases already covered, 0 filed under their finding, 0 added as untriaged, "
            "0 stale patterns removed") in result.stdout


def test_baseline_update_removes_only_a_stale_pattern(tmp_path, baseline_update):
    before, after, result = update_file(tmp_path, baseline_update, [UNEVEN, ZERO], [
        record("impl:f:5x64:bf16:ws3:gather:s0", "CRASH", "rank 2 killed by SIGABRT"),
        record("impl:f:8x64:bf16:ws2:gather:s0", "EXACT"),  # fixed upstream: its pattern matched only passing cases
    ])
    assert [line for line in before.splitlines() if line not in after.splitlines()] == ['    "impl:f:8x64:bf16:ws2:*",']
    assert len(after.splitlines()) == len(before.splitlines()) - 1
    assert 'stale: impl:f:8x64:bf16:ws2:* ("lib: uneven shards") matched only passing cases: removed' in result.stdout
    findings = baseline.load_findings(str(tmp_path / "known.toml"))
    assert findings == [replace(UNEVEN, cases=UNEVEN.cases[:1]), ZERO]


def test_baseline_update_adds_an_uncovered_failure_to_an_untriaged_group_at_the_end(tmp_path, baseline_update):
    port_reason = ("CRASH: rank 2 killed by SIGABRT (then ranks 0,1 raised RuntimeError: Read error [127.0.0.1]:19852: "
                   "Connection reset by peer) in the collective after the all-gather of the padded shard began on pid "
                   "4242 with the store at localhost:29500\n  rank 2 traceback")
    before, after, result = update_file(tmp_path, baseline_update, [UNEVEN, ZERO], [
        record("impl:f:5x64:bf16:ws3:gather:s0", "CRASH", "covered"),
        record("impl:g:46x64:bf16:ws3:gather:s0", "CRASH", port_reason),
        record("impl:g:46x64:bf16:ws3:steps:s0", "CRASH", port_reason.replace("19852", "41007")),
        record("impl:g:4x64:bf16:ws2:gather:s0", "SILENT_MISMATCH", "rows differ\n  detail"),
    ])
    assert after.startswith(before)  # the old entries as they were, in their order
    added = baseline.load_findings(str(tmp_path / "known.toml"))[2:]
    assert [(f.cases, f.link) for f in added] == [
        (("impl:g:46x64:bf16:ws3:gather:s0", "impl:g:46x64:bf16:ws3:steps:s0"), "docs/findings.md#not-yet-triaged"),
        (("impl:g:4x64:bf16:ws2:gather:s0",), "docs/findings.md#not-yet-triaged"),
    ]
    assert added[1].title == "Not yet triaged: SILENT_MISMATCH: rows differ"
    crash = added[0].title
    # Two ports, one group: no address, port or pid is written, and the cut is at a word boundary.
    assert not re.search(r"127\.0\.0\.1|19852|41007|4242|29500", crash), crash
    assert crash.startswith("Not yet triaged: CRASH: CRASH: rank 2 killed by SIGABRT (then ranks 0,1 raised "
                            "RuntimeError: Read error <address>: Connection reset by peer)")
    reason = crash.split(": ", 2)[2]
    assert reason.endswith("...") and len(reason) <= baseline.REASON_LIMIT
    assert port_reason.startswith(reason[:-3].replace("<address>", "[127.0.0.1]:19852") + " ")  # a whole word ends it
    assert "added: impl:g:46x64:bf16:ws3:gather:s0" in result.stdout
    # A second update from the same run changes nothing.
    baseline_update("--from", str(tmp_path / "verdicts.json"), "--file", str(tmp_path / "known.toml"))
    assert open(tmp_path / "known.toml").read() == after


def test_baseline_update_files_a_known_failure_at_a_new_world_size_under_its_finding(tmp_path, baseline_update):
    _, after, result = update_file(tmp_path, baseline_update, [UNEVEN, ZERO], [
        record("impl:f:8x64:bf16:ws2:gather:s0", "ERROR", "raised"),
        record("impl:f:8x64:bf16:ws3:gather:s0", "ERROR", "raised at 3 ranks"),  # same failure, new size
        record("impl:f:8x64:bf16:ws4:gather:s0", "SILENT_MISMATCH", "rows differ"),  # another failure
        record("impl:f:9x64:bf16:ws3:gather:s0", "ERROR", "raised"),  # another shape: not this finding's
    ])
    findings = baseline.load_findings(str(tmp_path / "known.toml"))
    assert findings[0].cases == ("impl:f:5x64:*:ws3:*", "impl:f:8x64:bf16:ws[23]:*")  # the glob widened
    assert [f.cases for f in findings[2:]] == [("impl:f:8x64:bf16:ws4:gather:s0",),
                                              ("impl:f:9x64:bf16:ws3:gather:s0",)]
    assert 'filed: impl:f:8x64:bf16:ws3:gather:s0 (under "lib: uneven shards"' in result.stdout
    assert "1 filed under their finding, 2 added as untriaged" in result.stdout


def test_a_glob_is_not_widened_over_a_passing_case(tmp_path, baseline_update):
    _, _, result = update_file(tmp_path, baseline_update, [UNEVEN], [
        record("impl:f:8x64:bf16:ws2:gather:s0", "ERROR", "raised"),
        record("impl:f:8x64:bf16:ws3:gather:s0", "ERROR", "raised at 3 ranks"),
        record("impl:f:8x64:bf16:ws3:steps:s0", "EXACT"),  # ws[23] would list it: the exact id instead
    ])
    findings = baseline.load_findings(str(tmp_path / "known.toml"))
    assert findings[0].cases == (*UNEVEN.cases, "impl:f:8x64:bf16:ws3:gather:s0")


def test_a_glob_is_not_widened_over_a_failure_of_another_verdict(tmp_path, baseline_update):
    _, _, result = update_file(tmp_path, baseline_update, [UNEVEN], [
        record("impl:f:8x64:bf16:ws2:gather:s0", "ERROR", "raised"),
        record("impl:f:8x64:bf16:ws3:gather:s0", "ERROR", "raised at 3 ranks"),  # filed first, in id order
        record("impl:f:8x64:bf16:ws3:steps:s0", "SILENT_MISMATCH", "rows differ"),  # ws[23] would swallow it
    ])
    findings = baseline.load_findings(str(tmp_path / "known.toml"))
    assert findings[0].cases == (*UNEVEN.cases, "impl:f:8x64:bf16:ws3:gather:s0")
    assert [f.cases for f in findings[1:]] == [("impl:f:8x64:bf16:ws3:steps:s0",)]
    assert findings[1].title == "Not yet triaged: SILENT_MISMATCH: rows differ"
    assert "1 filed under their finding, 1 added as untriaged" in result.stdout


HAND_WRITTEN = """# our known issues (kept as written: a header, comments, one-line arrays, single quotes)
[[issue]]
title = 'lib: uneven shards'
link = "https://github.com/o/lib/issues/7"
cases = ["impl:f:5x64:*:ws3:*", "impl:f:8x64:bf16:ws2:*"]  # both variants

[[issue]]
title = "lib: zero rows"
cases = ["impl:f:1x16:*"]
"""


def _update_hand_written(tmp_path, baseline_update, cases: list[dict]) -> tuple[str, Updated]:
    known = tmp_path / "my.toml"
    known.write_text(HAND_WRITTEN)
    (tmp_path / "verdicts.json").write_text(json.dumps({"cases": cases}))
    result = baseline_update("--from", str(tmp_path / "verdicts.json"), "--file", str(known))
    return known.read_text(), result


def test_baseline_update_changes_only_the_entries_that_changed(tmp_path, baseline_update):
    failing = record("impl:f:5x64:bf16:ws3:gather:s0", "CRASH", "short rank")
    after, _ = _update_hand_written(tmp_path, baseline_update, [
        failing, record("impl:f:8x64:bf16:ws2:gather:s0", "ERROR", "x")])
    assert after == HAND_WRITTEN  # nothing changed: the file is not rewritten
    after, _ = _update_hand_written(tmp_path, baseline_update, [
        failing, record("impl:f:8x64:bf16:ws2:gather:s0", "EXACT")])
    assert after == HAND_WRITTEN.replace(', "impl:f:8x64:bf16:ws2:*"]', "]")  # one element out, nothing else
    after, _ = _update_hand_written(tmp_path, baseline_update, [
        failing, record("impl:g:4x64:bf16:ws2:gather:s0", "ERROR", "boom")])
    assert after.startswith(HAND_WRITTEN) and after.count("[[issue]]") == 3  # a new group appended at the end
    assert baseline.findings_of_text(after)[2].cases == ("impl:g:4x64:bf16:ws2:gather:s0",)


def test_a_reason_is_cut_at_a_word_boundary():
    text = "word " * 40 + "tail"
    cut = baseline.clean_reason(text, limit=32)
    assert cut == "word word word word word word..."
    assert baseline.clean_reason("short: [::1]:4000 and 10.0.0.2:12345, port 29500, pid=77") == (
        "short: <address> and <address>, port <n>, pid=<n>")


def test_the_old_one_case_form_is_read_as_a_finding_of_one_pattern(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text('[[issue]]\ncase = "impl:f:*"\nreason = "pads nothing"\nlink = "https://example/1"\n')
    assert baseline.load_findings(str(old)) == [baseline.Finding("pads nothing", ("impl:f:*",), "", "https://example/1")]
    assert baseline.load(str(old)) == [baseline.KnownIssue("impl:f:*", "pads nothing", "https://example/1")]


@pytest.mark.parametrize("entry, message", [
    ('cases = ["x:*"]', "issue #1: `title` must be a non-empty string"),
    ('title = "t"\ncases = []', "issue #1: `cases` must be a non-empty list"),
    ('title = "t"\ncases = "x:*"', "issue #1: `cases` must be a non-empty list"),
    ('title = "t"\ncases = ["x:*"]\nurl = "u"', "issue #1: unknown key 'url'"),
])
def test_a_bad_finding_is_refused_in_one_line(tmp_path, entry, message):
    bad = tmp_path / "bad.toml"
    bad.write_text(f"[[issue]]\n{entry}\n")
    with pytest.raises(baseline.BaselineError, match=re.escape(message)):
        baseline.load(str(bad))


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


def test_a_case_test_is_one_whose_parameter_reads_as_a_case_id():
    from qgather.pytest_plugin.recorder import is_case_test

    assert is_case_test(f"cases/test_virtual.py::test_virtual[{FAILING}]")
    assert is_case_test("cases/test_x.py::test_x[pkg.mod:Impl:fp8_tensor:128x64:bf16:ws2:gather:s0:dcp-ws4]")
    assert not is_case_test("cases/test_dispatch_ops.py::test_chunk[reference:nvfp4_2d]")
    assert not is_case_test("tests/test_x.py::test_x[a:b:c:d:ws2:e:seed]")
    assert not is_case_test("tests/test_x.py::test_x")
