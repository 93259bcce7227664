"""`qgather sweep`: explore, group, shrink; exit codes; progress output."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import time

import pytest

from qgather.cli.sweep import main as sweep_main
from qgather.engine.run import RunOptions
from qgather.formats import FORMATS
from qgather.impls import available
from qgather.model.case import CaseSpec
from qgather.model.policy import expectation
from qgather.model.report import CaseReport
from qgather.model.verdict import Verdict
from qgather.runtime import shutdown_pools
from qgather.tools import exploration as sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FMT = "nvfp4_2d"


def _misaligned_shard_mutant() -> str:
    """The zoo's mutant whose bug is a shard that starts inside a scale block."""
    from qgather.impls.mutants import MUTANTS

    if "mutant:misaligned_shard" in available():
        return "mutant:misaligned_shard"
    return next(m.name for m in MUTANTS if m.bug_class == 1)


def _smallest_misaligned_rows(world_size: int, cols: int) -> int:
    """The fewest rows whose shards split a scale block while the format holds the weight and every
    shard (NVFP4 needs an even row count): 4 rows at 2 ranks, shards of 2 rows."""
    fmt = FORMATS[FMT]
    for rows in range(1, 10 * fmt.row_block):
        spec = CaseSpec("reference", FMT, (rows, cols), "bf16", world_size, "steps", 0)
        shard = math.ceil(rows / world_size)
        try:
            fmt.check((rows, cols))
            fmt.check((shard, cols))
        except ValueError:
            continue
        if not expectation(spec).aligned:
            return rows
    raise AssertionError("no misaligned row count")


@pytest.fixture(autouse=True)
def _keep_the_forkserver(monkeypatch: pytest.MonkeyPatch) -> None:
    """sweep_main ends as the command does, stopping its pools and the forkserver; in this process the
    next sweep would restart the forkserver (torch preloaded, ~4 s). The pools still stop; it stays."""
    from qgather.runtime import registry

    monkeypatch.setattr(registry, "stop_helpers", lambda: None)


def _sweep(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = sweep_main(list(argv), stream=out)
    return rc, out.getvalue()


def _groups(out: str) -> list[tuple[str, CaseSpec]]:
    """(verdict, minimal case) of every failure group the sweep printed."""
    groups, verdict = [], None
    for line in out.splitlines():
        if line.startswith("[") and "] " in line:
            verdict = line.split("] ")[1].split()[0]
        elif line.strip().startswith("minimal: "):
            groups.append((verdict, CaseSpec.parse(line.split("minimal: ")[1].split()[0])))
    return groups


def test_mutant_sweep_reports_the_minimal_misaligned_case():
    impl = _misaligned_shard_mutant()
    started = time.monotonic()
    rc, out = _sweep("--impl", impl, "--format", FMT, "--world-sizes", "1,2,3", "--max-rows", "36",
                     "--budget-s", "45")
    print(f"sweep of {impl} on {FMT}: {time.monotonic() - started:.1f}s\n{out}")
    assert rc == 1, out
    silent = [case for verdict, case in _groups(out) if verdict == "SILENT_MISMATCH"]
    assert silent, out
    case = silent[0]
    assert case.world_size == 2
    assert case.shape[0] == _smallest_misaligned_rows(2, case.shape[1])
    assert f"reproduce: qgather case {case.id}" in out


def test_shrink_goes_from_a_large_case_to_the_minimal_one():
    impl = _misaligned_shard_mutant()
    fmt = FORMATS[FMT]
    lattice = sweep.Lattice(sweep.candidate_rows(fmt.row_block, [1, 2, 4, 8], 144), [64], [1, 2, 4, 8],
                            fmt.k_multiple)
    runner = sweep.Runner(impl, FMT, "bf16", 0, "steps", RunOptions())
    start = sweep.Point(8, 144, 64)  # 18-row shards at 8 ranks: the zoo's catching case
    try:
        report = runner.run(start, "steps")
        key = sweep.group_key(report)
        assert key is not None and key[0] == "SILENT_MISMATCH", report.render()
        group = sweep.Group(key, "steps", [start])
        sweep.shrink(runner, lattice, group, sweep.Deadline(60))
    finally:
        shutdown_pools(keep_helpers=True)
    minimal = group.minimal.spec
    assert group.shrink_complete
    assert minimal.scenario == "steps" and sweep.group_key(group.minimal) == key
    assert minimal.world_size == 2
    assert minimal.shape[0] == _smallest_misaligned_rows(2, minimal.shape[1])
    assert minimal.shape[1] < 64  # the cols shrank too


def test_reference_small_sweep_has_no_failure_groups():
    rc, out = _sweep("--impl", "reference", "--format", FMT, "--world-sizes", "1,2", "--max-rows", "18")
    assert rc == 0, out
    assert "no failure groups" in out


@pytest.mark.parametrize("argv, says", [
    (["--impl", "no_such_impl", "--format", FMT], "unknown implementation"),
    (["--impl", "reference", "--format", "fp3"], "unknown format"),
    (["--impl", "reference", "--format", FMT, "--world-sizes", "2,x"], "--world-sizes"),
    (["--impl", "reference", "--format", FMT, "--world-sizes", "0"], "--world-sizes"),
    (["--impl", "reference", "--format", FMT, "--max-rows", "-3"], "--max-rows"),
    (["--impl", "reference", "--format", FMT, "--budget-s", "nan"], "--budget-s"),
    (["--impl", "reference", "--format", FMT, "--dtype", "int8"], "--dtype"),
])
def test_bad_input_exits_4_with_one_line(argv, says, capsys):
    rc, out = _sweep(*argv)
    err = capsys.readouterr().err.strip()
    assert rc == 4
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("qgather sweep: ") and says in err


def test_cli_dispatches_sweep_and_exits_4_on_bad_input():
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-m", "qgather", "sweep", "--impl", "reference", "--format", "fp3"],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert result.returncode == 4
    lines = [line for line in result.stderr.splitlines() if line.startswith("qgather sweep: ")]
    assert len(lines) == 1 and "unknown format" in lines[0]


def test_budget_stops_exploration():
    started = time.monotonic()
    rc, out = _sweep("--impl", "reference", "--format", FMT, "--world-sizes", "1,2,3,4,8", "--budget-s", "1e-6")
    assert time.monotonic() - started < 30
    explored = next(line for line in out.splitlines() if line.startswith("explored: "))
    assert "(budget reached)" in explored
    done, total = explored.split("virtual ")[1].split(",")[0].split("/")
    assert int(done) < int(total)
    assert rc == 0


def test_non_tty_progress_is_plain_lines():
    out = io.StringIO()
    progress = sweep.Progress(out, every=3, seconds=3600)
    progress.start("virtual", 7)
    for verdict in ("EXACT", "EXACT", "REJECTED", "EXACT", "EXACT", "EXACT", "SILENT_MISMATCH"):
        progress.update(verdict)
    progress.finish()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0].startswith("sweep: virtual 3/7") and "EXACT 2, REJECTED 1" in lines[0]
    assert len(lines) == 3 and lines[-1].startswith("sweep: virtual 7/7") and "SILENT_MISMATCH 1" in lines[-1]


def test_sweep_output_without_tty_has_no_carriage_returns():
    rc, out = _sweep("--impl", "reference", "--format", FMT, "--world-sizes", "1", "--max-rows", "4")
    assert rc == 0, out
    assert "\r" not in out
    assert any(line.startswith("sweep: virtual ") for line in out.splitlines())


def test_tty_progress_is_a_bar_with_eta_and_counts():
    out = io.StringIO()
    progress = sweep.Progress(out, tty=True)
    progress.start("steps", 4)
    progress.update("EXACT")
    progress.update("ERROR")
    text = out.getvalue()
    assert text.startswith("\r[") and "steps 2/4" in text and "ETA" in text and "ERROR 1, EXACT 1" in text
    assert "\n" not in text and "\x1b" not in text  # plain text: no terminal escapes
    progress.finish()
    assert out.getvalue().endswith("\n")


def _failed_at(stage: str, finding: str, scenario: str) -> CaseReport:
    spec = CaseSpec("reference", "nvfp4_2d", (136, 64), "bf16", 3, scenario, 0)
    return CaseReport(spec, Verdict.SILENT_MISMATCH, f"{stage}: {finding}", stage=stage)


def test_signature_reads_the_stage_field_masks_numbers_and_groups_the_virtual_stage_with_the_first_unshard():
    real = _failed_at("unshard 1", "rowwise_data: 10 of 32 valid elements differ", "gather")
    virtual = _failed_at("virtual gather", "rowwise_data: 7 of 64 valid elements differ", "virtual")
    assert sweep.signature(real) == sweep.signature(virtual) == "unshard #: rowwise_data: # of # valid elements differ"
    assert virtual.finding == "rowwise_data: 7 of 64 valid elements differ"
    # the field, not the text: a reason that merely starts like the virtual stage is not that stage
    error = CaseReport(real.spec, Verdict.ERROR, "virtual gather: rank 0 raised ValueError: 3 rows")
    assert sweep.signature(error) == "virtual gather: rank # raised ValueError: # rows"


def test_candidate_rows_cover_block_edges_and_small_rows():
    rows = sweep.candidate_rows(16, [1, 2, 8], 140)
    for r in (1, 2, 3, 7, 15, 16, 17, 31, 33, 136, 128, 130):
        assert r in rows
    assert max(rows) <= 140


def test_the_engine_reports_the_stage_a_failure_was_found_at():
    from qgather.engine.run import run_case

    virtual = run_case(CaseSpec.parse("mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:virtual:s0"))
    assert virtual.verdict is Verdict.SILENT_MISMATCH and virtual.stage == "virtual gather"
    assert virtual.reason == f"virtual gather: {virtual.finding}" and virtual.finding.startswith("rowwise_data: ")
    assert run_case(CaseSpec.parse("reference:nvfp4_2d:128x64:bf16:ws2:virtual:s0")).stage == ""
