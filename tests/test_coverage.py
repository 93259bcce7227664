"""`qgather coverage` (the Markdown matrix of a selection) and its one line at the end of a suite session."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qgather.cli import coverage as coverage_cli
from qgather.model.case import CaseSpec
from qgather.suite import coverage, shape_space
from tests._shared_runs import ALIGNMENT_GROUP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_matrix_of_a_selection_is_markdown_with_every_promised_cell_hit(capsys):
    rc = coverage_cli.main(["--formats", "nvfp4_2d", "--world-sizes", "8", "--scenarios", "gather,steps"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("# qgather coverage: ") and " 0 missing" in out.splitlines()[0]
    assert "## scenario gather, configuration default" in out and "## scenario steps, configuration default" in out
    assert "| format | buffer | regime | ws8 |" in out
    assert "| nvfp4_2d | columnwise_scale_inv | rows:split |" in out
    assert "MISSING" not in out


def test_a_missing_cell_is_marked_and_exits_1(capsys, monkeypatch):
    monkeypatch.setattr(shape_space, "cover", lambda fmt, ws, keep=(): keep)  # the hand-picked shapes only
    rc = coverage_cli.main(["--formats", "mxfp8", "--world-sizes", "8", "--scenarios", "gather"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "| mxfp8 | rowwise_scale_inv | rows:pad-filled | MISSING |" in out


def test_bad_selection_is_a_usage_error(capsys):
    assert coverage_cli.main(["--formats", "nope"]) == 4
    assert "unknown format 'nope'" in capsys.readouterr().err
    assert coverage_cli.main(["--world-sizes", "5"]) == 4


def test_configurations_are_a_dimension_and_only_the_first_is_promised():
    from qgather.model.config import FsdpConfig

    spec = CaseSpec("reference", "nvfp4_2d", (136, 64), "bf16", 8, "gather")
    other = CaseSpec("reference", "nvfp4_2d", (136, 64), "bf16", 8, "gather", 0, FsdpConfig(compile=True))
    cov = coverage.measure([spec, other])
    assert ("nvfp4_2d", "columnwise_scale_inv", "rows:split", "gather", "compile", 8) in cov.hits
    assert {k[4] for k in cov.promised} == {"default"}
    assert cov.missing  # two cases cannot hit every regime of the space at 8 ranks
    lines = coverage.summary_lines(cov)
    assert any("MISSING" in line for line in lines)


def _suite(*args: str) -> subprocess.CompletedProcess:
    """pytest over a selection of the case suite on the CPU, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q", "--device", "cpu"],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, timeout=300)


@pytest.mark.xdist_group(ALIGNMENT_GROUP)
def test_the_suite_summary_prints_the_coverage(alignment_run):
    """Plain pytest over one module of the suite (the run tests/conftest.py shares with test_gate)."""
    result = alignment_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    out = result.stdout
    # one line when no promise is broken; the matrix goes to the report directory (none here)
    line = next(line for line in out.splitlines() if line.startswith("coverage: "))
    hit, promised = line.split()[1].split("/")
    assert hit == promised and int(hit) > 0 and line.endswith("promised cells hit"), line
    assert "MISSING" not in out and "cells hit, 0/0" not in out, out[-2000:]


def test_a_configuration_run_prints_its_pair_promise():
    """A run of one format's whole FSDP2-configuration design ends with its pairs promised and hit."""
    result = _suite("cases/test_fsdp_configs.py", "--formats", "fp8_tensor_e5m2", "--impl", "reference")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    line = next(line for line in result.stdout.splitlines() if "configuration pairs" in line)
    hit, promised = line.split()[1].split("/")
    assert line == f"coverage: {hit}/{promised} promised configuration pairs hit" and hit == promised != "0", line


def test_bench_suite_prints_cases_per_second():
    env = {**os.environ, "PYTHONPATH": REPO, "QGATHER_BENCH_WORKERS": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "qgather.tools.bench.suite_bench", "-k", "test_gather and not fp32",
         "--formats", "nvfp4_2d", "--world-sizes", "2", "--scenarios", "gather"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("suite: ") and "cases/s (0 workers)" in line, line
    assert int(line.split()[1]) > 0
