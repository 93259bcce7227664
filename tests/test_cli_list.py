"""`qgather list`: what the harness knows, and the case ids a selection would run."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

from qgather.model.case import CaseSpec, CaseSpecError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qgather(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "qgather", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


def test_list_all_sections(capsys):
    from qgather.cli import main

    assert main(["list"]) == 0  # in this process: the listing's words (a process's exit and stderr: the next tests)
    out = capsys.readouterr().out
    for section in ("impls:", "formats:", "scenarios:", "mutants:"):
        assert section in out
    assert "nvfp4_2d             row block 16" in out
    assert "mutant:per_rank_amax" in out and "bug class 6  expected RANK_DIVERGENCE" in out
    te = next(line for line in out.splitlines() if line.strip().startswith("te "))
    assert "available" in te
    import torch

    if not torch.cuda.is_available():
        assert "unavailable here" in te and "no GPU" in te


def _collected(selection: list[str], cache_dir) -> list[str]:
    env = {**os.environ, "PYTHONPATH": REPO, "QGATHER_CACHE_DIR": str(cache_dir)}
    collect = subprocess.run(
        [sys.executable, "-m", "pytest", "cases", "--collect-only", "-q", "-p", "no:cacheprovider", *selection],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert collect.returncode == 0, collect.stdout[-2000:] + collect.stderr[-2000:]
    params = [line.split("[", 1)[1].rstrip("]") for line in collect.stdout.splitlines() if "[" in line]
    return sorted(p for p in params if _is_case_id(p))  # case ids, not other tests' parameters


def test_list_cases_matches_pytest_collection_which_keeps_the_cases_for_the_next_one(tmp_path, capsys):
    """`list --cases` (in this process) lists what pytest's collection (a process of its own) collects; that
    collection keeps the generated cases for the next one: each xdist worker of `qgather run` generates the
    covering designs (~5 s on 2 cores for a large selection) unless an earlier process of the same source kept
    them (qgather.suite.memo). One pair of collections for both claims (they once spent a third)."""
    from qgather.cli import main

    selection = ["--formats", "nvfp4_2d", "--world-sizes", "8", "--scenarios", "gather,virtual"]
    assert main(["list", "--cases", *selection]) == 0
    listed = sorted(capsys.readouterr().out.split())
    assert listed and all(":ws8:" in c and ":nvfp4_2d:" in c for c in listed)
    assert {CaseSpec.parse(c).scenario for c in listed} == {"gather", "virtual"}
    cold = _collected(selection, tmp_path)
    assert listed == cold
    (memo_file,) = tmp_path.glob("cases-*.pickle")
    with open(memo_file, "rb") as fh:
        entries = pickle.load(fh)
    assert any(key.startswith("('test_alignment'") for key in entries)
    kept = {case.id for cases in entries.values() for case in cases}
    assert set(cold) <= kept
    assert _collected(selection, tmp_path) == cold


def _is_case_id(param: str) -> bool:
    try:
        CaseSpec.parse(param)
    except CaseSpecError:
        return False
    return True


def test_list_cases_empty_selection_is_a_usage_error():
    # a process of its own: the exit status and the one stderr line a user's shell sees
    result = qgather("list", "--cases", "--world-sizes", "5")
    assert result.returncode == 4 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.strip() == "qgather list: --world-sizes 5: no case of the suite matches this selection"


def test_a_listed_value_that_matches_no_case_is_refused_even_beside_one_that_does(capsys):
    # the same refusal path as the subprocess above, so through main in this process
    from qgather.cli import main

    assert main(["list", "--cases", "--world-sizes", "2,5"]) == 4
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "qgather list: --world-sizes 5: no case of the selection has world size 5"
    assert main(["list", "--cases", "--impl", "torchao", "--formats", "fp8_tensor,nvfp4_2d"]) == 4
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "qgather list: --formats nvfp4_2d: no case of the selection has format nvfp4_2d"
    assert main(["list", "--cases", "--impl", "reference", "--scenarios", "model"]) == 4  # te's scenario only
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--scenarios model" in err, err
    assert "(reference declares formats fp8_tensor," in err and "scenarios gather," in err


def test_a_named_implementation_runs_alone_in_what_it_declares(capsys):
    from qgather.cli import main

    assert main(["list", "--cases", "--impl", "reference", "--formats", "fp8_tensor,nvfp4_2d",
                 "--world-sizes", "2,4"]) == 0
    ids = capsys.readouterr().out.split()
    assert ids and {CaseSpec.parse(c).impl for c in ids} == {"reference"}  # no torchao companion rows
    assert not [c for c in ids if ":model:" in c]  # reference declares no model scenario: not collected
    assert main(["list", "--cases", "--formats", "fp8_tensor", "--world-sizes", "2"]) == 0
    default = {CaseSpec.parse(c).impl for c in capsys.readouterr().out.split()}
    assert {"reference", "torchao", "torchao:precompute"} <= default  # the default run keeps them


def test_a_closed_pipe_ends_the_listing_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "qgather", "list", "--cases", "--impl", "reference"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()[-2000:]


def test_list_cases_lists_what_run_runs_and_exhaustive_adds_the_slow_sweeps(capsys):
    from qgather.cli import main

    selection = ["list", "--cases", "--impl", "reference", "--formats", "fp8_tensor", "--world-sizes", "2"]
    assert main(selection) == 0
    default = set(capsys.readouterr().out.split())
    assert main([*selection, "--exhaustive"]) == 0
    exhaustive = set(capsys.readouterr().out.split())
    assert default and default < exhaustive  # the full products (marked slow) only with --exhaustive
