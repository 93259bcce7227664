"""Every report of one run counts the same thing: a small mixed selection under xdist, with every
report on (--qgather-summary, --report-dir, --junitxml, --qgather-json), and the terminal summary,
pytest's final line, verdicts.json, verdicts.md, junit.xml and the JSON file all agree.

The selection: passing cases of two implementations, failing ones (mutants), configured ids
(`...:s0:mp-bf16`), a baseline xfail, a baseline entry whose case passes (stale: fails), a skipped
case, a case id two tests check, and tests that are not one case each (one runs three cases
without checking them, the baseline xfail among them; one runs none).
"""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest

from qgather.model.case_record import CaseRecord, KnownIssue, Outcome, RecordError
from qgather.model.verdict import Verdict
from qgather.pytest_plugin.baseline import dumps

pytest_plugins = ["pytester"]

UNEVEN = "mutant:unpadded_uneven"  # ERROR on uneven ws3 shapes, EXACT on even ones
PASSING = "reference:fp8_tensor:128x64:bf16:ws2:virtual:s0"
CONFIGURED = "reference:fp8_tensor:128x64:bf16:ws2:gather:s0:mp-bf16"
CONFIGURED_FAILING = "mutant:nibble_swap:nvfp4_1d:128x64:bf16:ws2:gather:s0:mp-bf16"  # SILENT_MISMATCH
FAILING = f"{UNEVEN}:fp8_tensor:136x64:bf16:ws3:virtual:s0"
KNOWN = f"{UNEVEN}:fp8_tensor:4x64:bf16:ws3:virtual:s0"  # fails, listed: xfailed
STALE = f"{UNEVEN}:fp8_tensor:3x1x64:bf16:ws3:virtual:s0"  # passes, listed: fails
SKIPPED = "te:fp8_tensor:128x64:bf16:ws2:virtual:s0"  # te runs no virtual scenario
CHECKED = [PASSING, CONFIGURED, CONFIGURED_FAILING, FAILING, KNOWN, STALE, SKIPPED]
RUN_ONLY = FAILING.replace("136x64", "46x64")  # run, not checked, by a test that is not one case
IMPLEMENTATIONS = {"reference", UNEVEN, "mutant:nibble_swap", "te"}

TEST_FILE = f"""
import pytest

CHECKED = {CHECKED!r}


@pytest.mark.parametrize("case", CHECKED, ids=CHECKED)
def test_one_case(case, qgather):
    qgather.check(case)


def test_the_passing_case_again(qgather):
    qgather.check({PASSING!r})


def test_cases_run_not_checked(qgather):
    # KNOWN again: a baseline xfail that another test also runs is a known issue, never "not as expected"
    assert qgather.run({PASSING!r}).passed and not qgather.run({RUN_ONLY!r}).passed
    assert not qgather.run({KNOWN!r}).passed


def test_no_case():
    pass
"""

# The cases' outcomes; pytest's adds the repeated check (passed) and the two other tests (passed).
EXPECTED_CASES = {"passed": 2, "failed": 3, "xfailed": 1, "skipped": 1}
EXPECTED_PYTEST = {"failed": 3, "passed": 5, "skipped": 1, "xfailed": 1}


def test_every_report_agrees(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mixed=textwrap.dedent(TEST_FILE))
    pytester.path.joinpath("known.toml").write_text(dumps([KnownIssue(KNOWN, "pads nothing", "https://example/1"),
                                                         KnownIssue(STALE, "was broken", "")]))
    result = pytester.runpytest_subprocess(
        "-n", "2", "-p", "no:cacheprovider", "-q", "--device", "cpu", "--qgather-summary", "--baseline", "known.toml",
        "--report-dir", "reports", "--junitxml", "junit.xml", "--qgather-json", "cases.json", "test_mixed.py",
        timeout=300)
    out = result.stdout.str()
    assert result.ret == 1, out[-3000:] + result.stderr.str()[-3000:]
    counts = result.parseoutcomes()
    assert counts == EXPECTED_PYTEST, out[-3000:]
    data = json.loads(pytester.path.joinpath("reports", "verdicts.json").read_text())
    _check_json(data, counts)
    _check_terminal(out, data, counts)
    _check_markdown(pytester.path.joinpath("reports", "verdicts.md").read_text(), counts)
    _check_junit(ET.parse(pytester.path / "junit.xml").getroot(), data, counts)
    assert json.loads(pytester.path.joinpath("cases.json").read_text()) == data["cases"]


def _check_json(data: dict, counts: dict[str, int]) -> None:
    cases = [CaseRecord.from_dict(c) for c in data["cases"]]
    assert sorted(c.case for c in cases) == sorted(CHECKED)
    assert {k: n for k, n in data["outcomes"].items() if n} == EXPECTED_CASES
    assert {k: n for k, n in data["pytest"].items() if n} == counts
    rows = data["rows"]
    assert sum(rows["cases"].values()) == len(CHECKED)
    assert rows["repeats"] == {"passed": 1} and rows["other"] == {"passed": 2} and data["other_tests"] == 2
    assert {c["case"] for c in data["also_ran"]} == {RUN_ONLY}
    assert sorted(f["case"] for f in data["failures"]) == sorted([CONFIGURED_FAILING, FAILING, STALE])
    assert [k["case"] for k in data["known_issues"]] == [KNOWN]
    by_id = {c.case: c for c in cases}
    assert by_id[CONFIGURED].implementation == "reference" and by_id[CONFIGURED].fsdp_config == "mp-bf16"
    assert by_id[CONFIGURED_FAILING].implementation == "mutant:nibble_swap"
    assert by_id[STALE].known_issue is not None and by_id[STALE].outcome.value == "failed"
    assert {r["implementation"] for r in data["matrix"]} == IMPLEMENTATIONS


def _check_terminal(out: str, data: dict, counts: dict[str, int]) -> None:
    assert ("7 cases (unique ids): 2 as expected, 3 not as expected, 1 known issues (--baseline), 1 skipped"
            in out), out[-3000:]
    # what ran besides the cases, in words a new user reads once
    assert "2 other tests each check something that is not one case" in out, out[-3000:]
    assert "they ran 1 more case, not counted above, which pass or fail with their test" in out, out[-3000:]
    lines = out.split("qgather verdicts", 1)[1].splitlines()
    assert {line.split()[0] for line in lines[2:6]} == IMPLEMENTATIONS, lines[:8]
    pytest_row = next(line.split() for line in lines if line.strip().startswith("pytest's final line "))
    assert pytest_row[3:] == [*(str(n) for n in counts.values()), str(sum(counts.values()))], pytest_row
    for failure in data["failures"]:
        assert f"reproduce: {failure['repro']}" in out


def _check_markdown(markdown: str, counts: dict[str, int]) -> None:
    assert "**red**: 7 cases - 2 passed, 3 failed, 1 skipped, 1 xfailed" in markdown
    row = " | ".join(f"**{n}**" for n in counts.values())
    assert f"| **pytest's final line** | {row} | **{sum(counts.values())}** |" in markdown
    assert "### Failures (3)" in markdown and "Known issues from the baseline (1 xfailed)" in markdown
    assert f"`{STALE}` | EXACT (baseline stale)" in markdown


def _check_junit(root: ET.Element, data: dict, counts: dict[str, int]) -> None:
    testcases = list(root.iter("testcase"))
    assert len(testcases) == sum(counts.values())
    assert sum(1 for t in testcases if t.find("failure") is not None) == counts["failed"]
    checked: dict[str, int] = {}
    for testcase in testcases:
        props = {p.get("name"): p.get("value") for p in testcase.iter("property")}
        if "verdict" in props:
            case = props["report"].split(": ", 1)[0]
            checked[case] = checked.get(case, 0) + 1
            assert props["repro"] == f"qgather case {case} --device cpu"
    assert sorted(checked) == sorted(c["case"] for c in data["cases"])
    assert sum(checked.values()) == len(CHECKED) + sum(data["rows"]["repeats"].values())


def test_a_case_record_survives_its_dict_exactly() -> None:
    record = CaseRecord(
        case=CONFIGURED, implementation="reference", format="fp8_tensor", world_size=2, shape_class="aligned",
        scenario="gather", fsdp_config="mp-bf16", configuration="gather mp-bf16 cpu/gloo", verdict=Verdict.EXACT,
        passed=True, reason="", repro=f"qgather case {CONFIGURED}", report=f"{CONFIGURED}: EXACT", seconds=1.25,
        placement="intra-node", checked=True, outcome=Outcome.XFAILED, known_issue=KnownIssue(CONFIGURED, "r", "l"))
    data = record.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain JSON types: it crosses xdist and into verdicts.json
    assert CaseRecord.from_dict(data) == record and CaseRecord.from_dict(data).to_dict() == data
    bare = replace(record, outcome=None, known_issue=None)
    assert CaseRecord.from_dict(bare.to_dict()) == bare
    with pytest.raises(RecordError, match="unknown field 'verdicts'"):
        CaseRecord.from_dict({**data, "verdicts": 1})
    with pytest.raises(RecordError, match="'NOPE' is not a valid Verdict"):
        CaseRecord.from_dict({**data, "verdict": "NOPE"})
