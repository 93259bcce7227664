"""`qgather compare BEFORE AFTER` on small recorded runs made here (verdicts.json as a run writes it): a
regression exits 1, a fix alone 0, a changed verdict and changed evidence are told apart, id sets that
differ are reported, bad input is one line and exit 4 before torch loads. In-process, no case runs: a
second or two in all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qgather.cli import main

REPO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harness")
ID = "torchao:fp8_tensor:{shape}:bf16:ws{ws}:gather:s0"
A, B, C = ID.format(shape="128x64", ws=2), ID.format(shape="136x64", ws=2), ID.format(shape="128x64", ws=4)


def record(case: str, verdict: str = "EXACT", passed: bool = True, reason: str = "", details=()) -> dict:
    """A case record as CaseRecord.to_dict writes it (the fields compare reads, and a few it must ignore)."""
    ws = int(case.split(":ws")[1].split(":")[0])
    head = f"{case}: {verdict}" + (f" - {reason}" if reason else "")
    report = "\n".join([head, *(f"  {d}" for d in details), f"  reproduce: qgather case {case}"])
    return {"case": case, "implementation": "torchao", "format": "fp8_tensor", "world_size": ws,
            "shape_class": "aligned", "scenario": "gather", "fsdp_config": "default", "configuration": "gather",
            "verdict": verdict, "passed": passed, "reason": reason, "repro": f"qgather case {case}",
            "report": report, "seconds": 0.5, "step_seconds": {}, "placement": "", "ran_on": "gloo/cpu",
            "checked": True, "outcome": "passed" if passed else "failed", "known_issue": None}


def write_run(folder, *records: dict, torchao: str = "0.18.0") -> str:
    """A report folder holding a verdicts.json of these records; its path."""
    os.makedirs(folder, exist_ok=True)
    data = {"qgather_version": "0.1.0", "session": {"device": "cpu", "backend": "gloo"},
            "environment": {"python": "3.11.7", "torch": "2.13.0+cpu", "torchao": torchao,
                            "transformer_engine": "not installed", "gpus": "no GPU"},
            "cases": list(records)}
    with open(os.path.join(folder, "verdicts.json"), "w") as fh:
        json.dump(data, fh)
    return str(folder)


MISMATCH = record(B, "SILENT_MISMATCH", False, "unshard 1: rowwise_data differs",
                  ["rowwise_data: 12 of 8704 valid elements differ (first at [0, 3])"])


def compared(tmp_path, before: list[dict], after: list[dict], *options: str) -> tuple[int, dict]:
    """Run `qgather compare` on two runs of these records: its exit status and compare.json."""
    out = tmp_path / "out"
    rc = main(["compare", write_run(tmp_path / "before", *before, torchao="0.17.0"),
               write_run(tmp_path / "after", *after), "--report-dir", str(out), *options])
    with open(out / "compare.json") as fh:
        return rc, json.load(fh)


def changes(data: dict) -> dict[str, str]:
    return {c["case"]: c["change"] for c in data["cases"]}


def test_a_regression_exits_1_and_is_named(tmp_path, capsys):
    rc, data = compared(tmp_path, [record(A), record(B), record(C)], [record(A), MISMATCH, record(C)])
    assert rc == 1 and changes(data) == {A: "unchanged", B: "regressed", C: "unchanged"}
    out = capsys.readouterr().out
    assert f"{B}: EXACT -> SILENT_MISMATCH: unshard 1: rowwise_data differs" in out
    torchao = next(line.split() for line in out.splitlines() if line.strip().startswith("torchao "))
    assert torchao == ["torchao", "0.17.0", "0.18.0", "(changed)"]  # the environments side by side
    assert "torchao fp8_tensor ws2 " in out and "torchao fp8_tensor ws4" not in out  # no change there
    assert out.rstrip().endswith("FAILED: 1 case id with a change --fail-on regressed names")
    markdown = (tmp_path / "out" / "compare.md").read_text()
    assert "### regressed (1)" in markdown and "| torchao | fp8_tensor | 2 | 0 | 1 |" in markdown
    assert "| torchao | fp8_tensor | 4 | 0 | 0 | 0 | 0 | 1 |" in markdown  # every group, changed or not


def test_a_fix_alone_exits_0(tmp_path, capsys):
    rc, data = compared(tmp_path, [record(A), MISMATCH], [record(A), record(B)])
    assert rc == 0 and changes(data) == {A: "unchanged", B: "fixed"}
    assert data["counts"]["fixed"] == 1 and data["exit_status"] == 0
    assert "passed: no case id with a change --fail-on regressed names" in capsys.readouterr().out


def test_a_changed_verdict_and_changed_evidence_are_told_apart(tmp_path, capsys):
    error = record(B, "ERROR", False, "rank 1 raised RuntimeError: shape mismatch")
    fewer = record(A.replace("128x64", "136x64").replace("ws2", "ws4"), "SILENT_MISMATCH", False,
                   "unshard 1: rowwise_data differs", ["rowwise_data: 12 of 8704 valid elements differ"])
    more = {**fewer, "report": fewer["report"].replace("12 of", "40 of")}
    rc, data = compared(tmp_path, [MISMATCH, fewer], [error, more])
    assert rc == 0  # still failing, differently: neither a fix nor a regression
    assert changes(data) == {B: "verdict-changed", fewer["case"]: "evidence-changed"}
    out = capsys.readouterr().out
    assert "rowwise_data: 12 of 8704 valid elements differ -> rowwise_data: 40 of 8704" in out
    rc, _ = compared(tmp_path, [MISMATCH, fewer], [error, more], "--fail-on", "regressed,evidence-changed")
    assert rc == 1


def test_run_specific_text_is_not_evidence(tmp_path, capsys):
    """Two runs of one crash in different venvs: what the others raised after it, sockets, stacks (or none:
    a rank sampled between Python frames) and traceback lines differ, its evidence does not; the bytes a
    rank sent are evidence."""
    def crash(venv: str, port: int, waiting_in: str, line: int, sent: int = 2944) -> dict:
        return record(B, "CRASH", False, f"CRASH: rank 2 killed by SIGABRT (then ranks 0,1 raised RuntimeError: "
                                          f"Read error [127.0.0.1]:{port}: Connection reset by peer)", [
            f"rank 0: all-gather: {sent} bytes from this rank",
            f"rank 0: main thread at: {waiting_in}",
            "rank 1 traceback (last lines):",
            f"  File \"/x/{venv}/lib/python3.11/site-packages/torchao/float8/fsdp_utils.py\", line {line}, in f",
            "rank 2 stack (innermost first):", f"  {waiting_in}", "took 1.25 s"])
    two = record(C, "CRASH", False, "CRASH: rank 3 killed by SIGABRT; rank 1 killed by SIGABRT")
    swapped = {**two, "reason": "CRASH: rank 1 killed by SIGABRT; rank 3 killed by SIGABRT"}
    rc, data = compared(tmp_path, [two], [swapped])
    assert changes(data) == {C: "unchanged"}  # which dying rank was noticed first is timing
    assert "all 1 groups unchanged throughout (1 case id)" in capsys.readouterr().out
    before = crash(".venv-torchao-0.17.0", 25502, "_recv (connection.py:395)", 65)
    rc, data = compared(tmp_path, [before], [crash(".venv-torchao-0.18.0", 31337, "loop (whereabouts.py:58)", 71)])
    assert rc == 0 and changes(data) == {B: "unchanged"}
    stackless = crash(".venv-torchao-0.18.0", 31337, "loop (whereabouts.py:58)", 71)
    stackless["report"] = stackless["report"].replace("rank 2 stack (innermost first):\n    loop (whereabouts.py:58)",
                                                      "rank 2: no Python stack")
    assert "rank 2: no Python stack" in stackless["report"]
    rc, data = compared(tmp_path, [before], [stackless])  # sampled between frames: timing too
    assert rc == 0 and changes(data) == {B: "unchanged"}
    rc, data = compared(tmp_path, [before], [crash(".venv-torchao-0.17.0", 25502, "_recv (connection.py:395)", 65,
                                                   sent=1472)])
    assert rc == 0 and changes(data) == {B: "evidence-changed"}


def test_a_compiled_case_reusing_warm_graphs_is_unchanged(tmp_path):
    """How many graphs a compiled case compiles itself depends on what ran before it on the same pool (the
    reference suite on torch 2.13.0 and 2.15.0 differed so in 3 case ids): not evidence; the output is."""
    def compiled(graphs: int, output: str = "output: EXACT") -> dict:
        note = (f"compiled forward: torch.compile backend aot_eager, {graphs} graph(s) compiled for the case "
                "(others warm), FSDP2 hooks eager")
        return record(C, details=[note, output])
    rc, data = compared(tmp_path, [compiled(1)], [compiled(0)])
    assert rc == 0 and changes(data) == {C: "unchanged"}
    rc, data = compared(tmp_path, [compiled(1)], [compiled(1, "output: 3 of 8192 elements differ")])
    assert changes(data) == {C: "evidence-changed"}


def test_different_selections_compare_on_common_ids(tmp_path, capsys):
    rc, data = compared(tmp_path, [record(A), record(B)], [record(A), record(C)])
    assert rc == 0 and changes(data) == {A: "unchanged", B: "only-before", C: "only-after"}
    assert data["common"] == 1
    assert ("1 case id in both runs: 0 fixed, 0 regressed, 0 verdict changed, 0 evidence changed, 1 unchanged; "
            "2 left out of the comparison: 1 only before, 1 only after") in capsys.readouterr().out
    rc, _ = compared(tmp_path, [record(A), record(B)], [record(A), record(C)], "--fail-on", "regressed,only-before")
    assert rc == 1


def test_a_case_that_was_skipped_and_now_fails_is_a_regression(tmp_path):
    skipped = record(B, "SKIPPED", True, "torchao 0.15 has no such format")
    rc, data = compared(tmp_path, [skipped], [MISMATCH])
    assert rc == 1 and changes(data) == {B: "regressed"}
    rc, data = compared(tmp_path, [MISMATCH], [skipped])
    assert rc == 0 and changes(data) == {B: "verdict-changed"}  # no longer tested is not a fix


def _bad_inputs(tmp_path) -> list[tuple[list[str], str]]:
    good = write_run(tmp_path / "good", record(A))
    other = write_run(tmp_path / "other", record(C))
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text('{"cases": [')
    (tmp_path / "list.json").write_text(json.dumps({"rows": {}}))
    interrupted = tmp_path / "interrupted.json"
    interrupted.write_text(json.dumps({"cases": [record(A)], "incomplete": True, "collected_cases": 9}))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"cases": [{**record(A), "verdict": "FINE"}]}))
    twice = tmp_path / "twice.json"
    twice.write_text(json.dumps({"cases": [record(A), record(A)]}))
    return [([str(tmp_path / "nowhere"), good], "no such file or folder"),
            ([str(tmp_path / "empty"), good], "has no verdicts.json"),
            ([str(tmp_path / "bad.json"), good], "not JSON"),
            ([good, str(tmp_path / "list.json")], "not a qgather verdicts.json"),
            ([str(interrupted), good], "an interrupted run (1 of 9 cases)"),
            ([good, str(unknown)], "no verdict qgather knows ('FINE')"),
            ([good, str(twice)], "is listed twice"),
            ([good, other], "no case id in common"),
            ([good, good, "--fail-on", "regresed"], "regresed is not a change"),
            ([good], "required: AFTER"),
            ([good, good, "--report-dir", str(tmp_path / "bad.json" / "out")], "cannot write there")]


def test_bad_input_is_one_line_and_exit_4(tmp_path, capsys):
    for argv, why in _bad_inputs(tmp_path):
        assert main(["compare", *argv]) == 4, argv
        captured = capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("qgather compare: ") and why in lines[0], (argv, lines)
        assert captured.out == "", argv


@pytest.mark.parametrize("argv", [["before", "after"], ["--help"]])
def test_compare_never_imports_torch(tmp_path, argv):
    """A comparison, and its refusal, answer without torch: well under a second on a loaded host
    (checked deterministically in the process, rather than timed)."""
    runs = [write_run(tmp_path / name, record(A)) for name in argv if not name.startswith("-")]
    args = [*runs, *[a for a in argv if a.startswith("-")], "--report-dir", str(tmp_path / "out")]
    code = ("import sys; from qgather.cli import main\n"
            "try:\n    rc = main(['compare', *sys.argv[1:]])\nexcept SystemExit as exc:\n    rc = exc.code\n"
            "print(rc, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.stdout.strip().splitlines()[-1] == "0 False", result.stdout + result.stderr
