"""The configuration designs (qgather.suite.config_sweep): configuration tokens crossed with the shape
regimes per format. The regimes follow the configuration's layout; every achievable pair is in the
default run (a property over each design); the promise breaks when a case goes; the pairs that cannot
occur say why; a component added to a design's table enters it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from qgather.cli import coverage as coverage_cli
from qgather.formats import FORMATS
from qgather.model.case import CaseSpec
from qgather.model.fsdp_rules import fsdp_skip_reason
from qgather.suite import config_coverage, config_space, config_sweep, coverage
from qgather.suite.config_regimes import REGIMES, case_regimes
from qgather.suite.config_space import REGIME, Component, achievable, impossible, pairs_of, rows, universe
from qgather.suite.config_sweep import CHECKPOINT, DESIGNS, FSDP, STEP_PATHS, ConfigSweep, covering_rows
from qgather.suite.covering import cover_pairs


def _regimes(case_id: str) -> set[str]:
    return set(case_regimes(CaseSpec.parse(case_id)))


def test_regimes_are_judged_where_the_configuration_splits_the_weight():
    assert _regimes("reference:nvfp4_2d:128x64:bf16:ws2:gather:s0") == {"aligned"}
    assert _regimes("reference:nvfp4_2d:3x16x64:bf16:ws4:gather:s0") == {"3d", "zero-row", "m<ws"}
    # HSDP: the shard mesh of 2 ranks, not the world of 4: one expert short, nobody empty
    assert _regimes("reference:nvfp4_2d:3x16x64:bf16:ws4:gather:s0:hsdp-2x2") == {"3d", "uneven"}
    assert _regimes("reference:nvfp4_2d:3x16x64:bf16:ws2:gather:s0:hsdp-2x1") == {"3d", "aligned"}
    # dim1: along K (16-column shards of a 32-column block), whatever M does
    assert _regimes("reference:mxfp8:128x64:bf16:ws4:gather:s0:dim1") == {"split"}
    assert _regimes("reference:fp8_block:1024x256:bf16:ws2:gather:s0:dim1") == {"aligned"}
    # a checkpoint: where it was saved (342-row shards at 3 ranks split the 128-row tiles) and where it loads
    assert _regimes("reference:fp8_block:1024x64:bf16:ws2:gather:s0:dcp-ws3") == {"split", "uneven"}
    assert _regimes("reference:fp8_tensor:1x16:bf16:ws3:gather:s0:dcp-ws1") == {"zero-row", "m<ws"}
    assert _regimes("reference:nvfp4_2d:136x64:bf16:ws4:gather:s0") == {"split", "tail-partial"}


@pytest.mark.parametrize("design", DESIGNS, ids=lambda d: d.name)
def test_the_default_run_holds_every_achievable_pair_of_every_format(design):
    for fmt in FORMATS:
        space, chosen = rows(design, fmt), covering_rows(design, fmt)
        assert set(chosen) <= set(space), fmt
        assert len(chosen) < len(space) / 5, (fmt, len(chosen), len(space))  # a design, not the product
        held = {pair for row in chosen for pair in pairs_of(row.labels)}
        assert held == achievable(design, fmt), fmt
        # every (token, regime) pair the format's rules allow, per format
        for component in design.components:
            for token in component.values:
                for regime in REGIMES:
                    pair = next(pairs_of(frozenset({(component.name, token), (REGIME, regime)})))
                    assert (pair in held) != (pair in impossible(design, fmt)), (fmt, pair)
        for row in chosen:  # a case FSDP2 runs, on a shape with the regime its row asked for
            assert fsdp_skip_reason(row.spec) is None and row.spec.config.check_world_size(row.spec.world_size) is None
            assert row.regime in case_regimes(row.spec)
            assert row.spec.config.param_dtype != row.spec.dtype  # a policy that casts, or none
        # deepened: every (scenario, token) pair on three shapes of different regimes (or all it can have)
        shapes: dict = {}
        regimes: dict = {}
        for row in space:
            for pair in config_sweep.scenario_tokens(design, row):
                regimes.setdefault(pair, set()).add(row.regime)
        for row in chosen:
            for pair in config_sweep.scenario_tokens(design, row):
                shapes.setdefault(pair, set()).add(row.spec.shape)
        thin = {p: len(shapes.get(p, ())) for p in regimes if len(shapes.get(p, ())) < min(3, len(regimes[p]))}
        assert not thin, (fmt, thin)
        assert len({row.spec.id for row in chosen}) == len(chosen), fmt  # two rows of one case: one case


def test_the_step_paths_design_crosses_compile_and_checkpoints_with_every_other_token():
    held = {pair for fmt in ("fp8_tensor", "nvfp4_2d") for row in covering_rows(STEP_PATHS, fmt)
            for pair in pairs_of(row.labels)}
    others = [("mp", "mp-bf16"), ("mp", "mp-fp32"), ("raf", "raf-no"), ("hsdp", "hsdp-2x2"), ("dim", "dim1"),
              ("dcp", "dcp-ws2"), ("dcp", "dcp-ws4")]
    for label in others:
        assert next(pairs_of(frozenset({("compile", "compile"), label}))) in held, label
    for scenario in ("steps", "reshard"):
        for label in (("hsdp", "hsdp-2x2"), ("dcp", "dcp-ws2"), ("compile", "compile"), ("mp", "mp-bf16")):
            assert next(pairs_of(frozenset({("scenario", scenario), label}))) in held, (scenario, label)


def test_every_pair_of_the_universe_is_achievable_or_explained():
    for design in DESIGNS:
        for fmt in FORMATS:
            explained = impossible(design, fmt)
            assert set(explained) | achievable(design, fmt) == universe(design)
            for pair, why in explained.items():
                assert why and "no shape of the space" not in why and "no row of the design" not in why, (pair, why)


def test_a_compiled_row_runs_at_up_to_two_ranks_or_its_hsdp_mesh():
    """Every rank traces the compiled graph: a compiled row runs at 1-2 ranks, or at the 4 hsdp-2x2 needs."""
    for design in (CHECKPOINT, STEP_PATHS):
        for fmt in ("fp8_tensor", "nvfp4_2d"):
            compiled = [row.spec for row in rows(design, fmt) if row.spec.config.compile]
            assert compiled and {s.world_size for s in compiled} & {1, 2}
            assert all(s.world_size <= 2 or s.config.hsdp is not None for s in compiled), design.name
    assert any(s.world_size == 4 for s in (row.spec for row in rows(STEP_PATHS, "fp8_tensor"))
               if s.config.compile and s.config.hsdp is not None)
    assert "each rank traces the same graph" in _why(CHECKPOINT, "mxfp8", ("compile", "compile"), ("ws", 4))


def _why(design, fmt, a, b) -> str:
    return impossible(design, fmt)[next(pairs_of(frozenset({a, b})))]


def test_impossible_pairs_say_why_from_the_rules():
    assert "evenly or not at all" in _why(FSDP, "nvfp4_2d", ("dim", "dim1"), (REGIME, "uneven"))
    assert "2-D weights only" in _why(FSDP, "mxfp8", ("dim", "dim1"), (REGIME, "3d"))
    assert "sharded over 1 rank" in _why(FSDP, "fp8_block", ("hsdp", "hsdp-2x1"), (REGIME, "split"))
    assert "needs 4 ranks, the case has 2" in _why(FSDP, "fp8_tensor", ("hsdp", "hsdp-2x2"), ("ws", 2))
    assert "casts nothing" in _why(FSDP, "fp8_tensor", ("mp", "mp-bf16"), ("dtype", "bf16"))
    assert "divides the shard world size 2" in _why(FSDP, "fp8_tensor", ("raf", "raf-4"), ("ws", 2))
    assert "has no scale block" in _why(FSDP, "fp8_tensor", ("mp", ""), (REGIME, "split"))
    assert "multiples of its 32-element block" in _why(FSDP, "mxfp8", ("mp", ""), (REGIME, "tail-partial"))
    assert "default configuration belongs to the shape sweeps" in _why(CHECKPOINT, "mxfp8", ("dcp", ""),
                                                                        ("compile", ""))
    assert not impossible(CHECKPOINT, "nvfp4_2d").keys() & {
        next(pairs_of(frozenset({("dcp", t), (REGIME, r)}))) for t in ("dcp-ws1", "dcp-ws3") for r in REGIMES}


def _default_run():
    cases, primary = coverage.suite_cases(["reference"])
    return coverage.measure(cases, primary)


def test_the_default_run_keeps_every_pair_promise():
    """`make test` fails here if the default run misses a pair its designs promise."""
    pairs = _default_run().pairs
    assert not pairs.missing, config_coverage.promise_lines(pairs)
    assert {k[:2] for k in pairs.promised} == {(d.name, f) for d in DESIGNS for f in FORMATS}
    assert not pairs.not_promised


def test_a_case_removed_from_the_design_breaks_the_promise(monkeypatch, capsys):
    chosen = covering_rows(FSDP, "mxfp8")
    held = [set(pairs_of(row.labels)) for row in chosen]
    # a case holding a pair of configuration tokens no other case of the design holds
    drop = next(i for i, mine in enumerate(held)
                if any(all(v for _, v in p) for p in mine - set().union(*held[:i], *held[i + 1:])))
    real = config_sweep.covering_rows
    monkeypatch.setattr(config_sweep, "covering_rows", lambda design, fmt: tuple(
        r for i, r in enumerate(real(design, fmt)) if (design, fmt, i) != (FSDP, "mxfp8", drop)))
    pairs = _default_run().pairs
    assert pairs.missing and {k[:2] for k in pairs.missing} == {("fsdp", "mxfp8")}
    assert {k[2] for k in pairs.missing} <= held[drop]
    assert coverage_cli.main(["--formats", "mxfp8"]) == 1
    section = capsys.readouterr().out.split("## fsdp design, mxfp8: ")[1].split("\n## ")[0]
    assert section.startswith(f"{len(achievable(FSDP, 'mxfp8')) - len(pairs.missing)}/") and "MISSING" in section


def test_a_narrowed_selection_promises_no_pairs_of_the_designs_it_cuts(capsys):
    assert coverage_cli.main(["--formats", "nvfp4_2d", "--world-sizes", "2", "--scenarios", "gather"]) == 0
    out = capsys.readouterr().out
    assert "## fsdp design, nvfp4_2d: 0/0 promised pairs hit (not promised: the run has no configured case at" in out
    assert "Pairs that cannot occur:" in out


def test_the_pairs_report_shows_tokens_by_regime_and_why_pairs_cannot_occur(capsys):
    assert coverage_cli.main(["--formats", "fp8_tensor"]) == 0
    out = capsys.readouterr().out
    section = out.split("## fsdp design, fp8_tensor: ")[1].split("\n## ")[0]
    assert section.startswith(f"{len(achievable(FSDP, 'fp8_tensor'))}/{len(achievable(FSDP, 'fp8_tensor'))} ")
    assert "| token | " + " | ".join(REGIMES) + " |" in section
    assert "| dim1 | " in section and "| hsdp-2x1 | " in section and "- mp x raf: 40/40" in section
    assert "- (hsdp-2x1, zero-row): hsdp-2x1: the weight is sharded over 1 rank, which holds all of it" in section
    assert "## checkpoint design, fp8_tensor: " in out


def test_a_component_added_to_the_table_enters_the_design():
    """What a tensor-parallel token will do: one more row of a design's table, nothing else."""
    grown = replace(FSDP, components=(*FSDP.components, Component("compile", ("", "compile"))))
    chosen = covering_rows(grown, "nvfp4_2d")
    held = {pair for row in chosen for pair in pairs_of(row.labels)}
    for regime in REGIMES:
        assert next(pairs_of(frozenset({("compile", "compile"), (REGIME, regime)}))) in held, regime
    cases = ConfigSweep(grown).cases(["reference"], formats=["nvfp4_2d"])
    assert any(c.config.compile and c.config.param_dtype for c in cases)


def test_cover_pairs_is_a_deterministic_cover():
    candidates = [frozenset({("a", i % 3), ("b", i % 2), ("c", i % 5), ("r", i % 4), ("r", (i + 1) % 4)})
                  for i in range(60)]
    chosen = cover_pairs(candidates)
    wanted = {p for c in candidates for p in pairs_of(c)}
    assert {p for i in chosen for p in pairs_of(candidates[i])} == wanted
    assert chosen == sorted(chosen) == cover_pairs(candidates) and len(chosen) < len(candidates)
    assert all(a[0] != b[0] for p in wanted for a, b in [p])


def test_a_design_expresses_only_its_own_tokens():
    assert FSDP.tokens(CaseSpec.parse("reference:mxfp8:128x64:bf16:ws4:gather:s0:mp-bf16+hsdp-2x2").config) == (
        "mp-bf16", "", "hsdp-2x2", "")
    assert FSDP.tokens(CaseSpec.parse("reference:mxfp8:128x64:bf16:ws2:gather:s0:dcp-ws3").config) is None
    assert config_space.case_labels(CHECKPOINT, CaseSpec.parse("reference:mxfp8:128x64:bf16:ws2:gather:s0")) is None


def test_broken_pair_promises_are_listed():
    key = ("fsdp", "mxfp8", ((REGIME, "zero-row"), ("mp", "mp-bf16")))
    kept = config_coverage.PairCoverage(promised={key})
    kept.hits[key] = 2
    assert config_coverage.promise_lines(kept) == ["coverage: 1/1 promised configuration pairs hit"]
    lines = config_coverage.promise_lines(config_coverage.PairCoverage(promised={key}))
    assert lines == ["coverage: 0/1 promised configuration pairs hit, 1 MISSING (`qgather coverage` lists the pairs)",
                     "  MISSING mxfp8 (zero-row, mp-bf16) in the fsdp design"]
    assert config_coverage.promise_lines(config_coverage.PairCoverage()) == []


@pytest.mark.parametrize("design", (FSDP, STEP_PATHS), ids=lambda d: d.name)
def test_the_full_product_holds_each_case_once(design):
    # Two rows of the space ask for two regimes of one shape: one case. Twice, pytest would run it twice
    # under ids suffixed one by one (quadratic: ~6 s of every collection of the slow product).
    ids = [case.id for case in ConfigSweep(design, product=True).cases(["reference"], formats=["fp8_tensor"])]
    space = rows(design, "fp8_tensor")
    assert len(ids) == len(set(ids)) < len(space)
