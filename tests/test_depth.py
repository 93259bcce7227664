"""The depth of the default run's cells (qgather.suite.depth, `qgather coverage`): every promised
(family, format) cell holds >= 10 cases over >= 3 shape classes (or all its family reaches) and 2
world sizes, block, layers and compile meet mp, raf and hsdp on every format, and a shallower
selection is refused. Generation only (the memo'd suite), no case runs."""

from __future__ import annotations

from functools import cache

from qgather.cli import coverage as coverage_cli
from qgather.formats import FORMATS
from qgather.model.case import CaseSpec
from qgather.suite import depth
from qgather.suite.coverage import suite_cases


@cache
def _default_run() -> tuple[CaseSpec, ...]:
    cases, _ = suite_cases(["reference"], memo=True)
    return tuple(cases)


def test_the_default_run_keeps_its_depth_promise():
    measured = depth.measure(_default_run())
    assert not measured.short_cells() and not measured.missing_crosses()
    for family in ("gather", "steps", "reshard", "block", "layers", "mp", "raf", "hsdp", "dcp", "compile"):
        for fmt in FORMATS:
            cell = measured.cells[(family, fmt)]
            assert cell.cases >= depth.MIN_CASES and len(cell.world_sizes) >= 2, (family, fmt)
    assert measured.minimum()[0] >= depth.MIN_CASES


def test_a_shallow_cell_and_a_missing_cross_are_refused():
    cases = [c for c in _default_run() if not (c.scenario == "block" and c.fmt == "mxfp8" and c.world_size == 3)]
    cases = [c for c in cases if not (c.scenario == "layers" and c.fmt == "nvfp4_2d" and c.config.hsdp)]
    measured = depth.measure(cases)
    assert ("block", "mxfp8") in {(f, fmt) for f, fmt, _ in measured.short_cells()}
    assert ("layers", "hsdp", "nvfp4_2d") in measured.missing_crosses()
    assert measured.broken and "SHALLOW block x mxfp8" in depth.markdown(measured)
    assert not depth.measure(cases, promised=False).broken  # a narrowed selection promises nothing


def test_families_and_shape_classes_of_a_case():
    spec = CaseSpec.parse("reference:nvfp4_2d:136x64:fp32:ws8:steps:s0:mp-bf16+raf-no+compile+dcp-ws2")
    assert depth.families(spec) == {"steps", "mp", "raf", "compile", "dcp"}
    assert depth.shape_classes(CaseSpec.parse("reference:nvfp4_2d:128x64:bf16:ws8:gather:s0")) == {"aligned"}
    assert depth.shape_classes(CaseSpec.parse("reference:nvfp4_2d:136x64:bf16:ws8:gather:s0")) == {"misaligned"}
    assert "zero-row" in depth.shape_classes(CaseSpec.parse("reference:fp8_tensor:4x64:bf16:ws8:gather:s0"))
    assert depth.reachable("gather", "fp8_tensor") == 3 and depth.reachable("dim1", "fp8_tensor") == 1


def test_qgather_coverage_prints_the_minimum_depth(capsys):
    assert coverage_cli.main(["--formats", "mxfp8"]) == 0
    out = capsys.readouterr().out
    assert "# qgather depth" in out and "minimum depth: " in out and "| block x dcp | n/a |" in out
