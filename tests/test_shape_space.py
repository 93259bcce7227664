"""qgather.suite.shape_space: layout facts probed from the formats, regimes, the generated cover, and the
promise that the default run hits every regime the space holds (a broken generator must fail it)."""

from __future__ import annotations

import math

import pytest

from qgather.formats import FORMATS, FormatError
from qgather.formats.base import flat_dims
from qgather.model.case import ShardLayout
from qgather.suite import coverage, shape_space
from qgather.suite.modules import suite_sweeps
from qgather.suite.sweeps import (
    CPU_WORLD_SIZES,
    RULE_SHAPES,
    CaseSet,
    SuiteSweep,
    Sweep,
    alignment_shapes,
    core_shapes,
    narrow,
)

Axis = shape_space.Axis


def _facts(fmt):
    return {b.name: (b.rows, b.cols) for b in shape_space.buffer_facts(fmt)}


def test_layout_facts_are_the_formats_documented_ones():
    mx = _facts("mxfp8")
    assert mx["rowwise_scale_inv"] == (Axis(1, 128), Axis(32, 4))  # (round_up(M, 128), round_up(K/32, 4))
    assert mx["columnwise_scale_inv"] == (Axis(32, 4), Axis(1, 128))  # (round_up(M/32, 4), round_up(K, 128))
    nv = _facts("nvfp4_1d")
    assert nv["columnwise_data"] == (Axis(2, 1), Axis(1, 1))  # (K, M/2): two rows per byte
    assert nv["rowwise_data"] == (Axis(1, 1), Axis(2, 1))
    assert _facts("fp8_block")["columnwise_scale_inv"] == (Axis(128, 4), Axis(128, 1))
    assert _facts("fp8_block_1x128")["rowwise_scale_inv"] == (Axis(1, 4), Axis(128, 1))  # (ceil(K/128), round_up(M, 4))
    assert set(_facts("fp8_tensor")) == {"data"}  # scale_inv (1,) is per tensor: no regimes


def _brute(fmt, shape, ws):
    """The regimes from every rank's row range, one by one (the module computes them in closed form)."""
    try:
        FORMATS[fmt].check(shape)
    except FormatError:
        return frozenset({("*", "unholdable")})
    layout = ShardLayout(shape[0], ws, math.prod(shape[1:-1]))
    shards = [r for r in (layout.row_range(i) for i in range(ws)) if r[1] > r[0]]
    cells = {("*", "even" if shape[0] % ws == 0 else "uneven")}
    cells |= {("*", n) for n, hit in (("zero-row", len(shards) < ws), ("m<ws", shape[0] < ws),
                                      ("3d", len(shape) == 3)) if hit}
    m, k = flat_dims(shape)
    for buf in shape_space.buffer_facts(fmt):
        if buf.rows and buf.rows.unit > 1:
            u = buf.rows.unit
            cells.add((buf.name, "rows:split" if any(s % u for s, _ in shards) else "rows:aligned"))
            cells.add((buf.name, "rows:tail-partial" if m % u else "rows:tail-whole"))
        if buf.rows and buf.rows.pad > 1:
            u, p = buf.rows.unit, buf.rows.pad
            filled = len(shards) == ws and all(math.ceil((e - s) / u) % p == 0 for s, e in shards)
            cells.add((buf.name, "rows:pad-filled" if filled else "rows:pad-padded"))
        if buf.cols and buf.cols.unit > 1:
            cells.add((buf.name, "cols:tail-partial" if k % buf.cols.unit else "cols:tail-whole"))
        if buf.cols and buf.cols.pad > 1:
            padded = math.ceil(k / buf.cols.unit) % buf.cols.pad
            cells.add((buf.name, "cols:pad-padded" if padded else "cols:pad-filled"))
    return frozenset(cells)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4_1d", "fp8_block", "fp8_block_1x128"])
@pytest.mark.parametrize("ws", [1, 3, 8])
def test_closed_form_regimes_equal_the_rank_by_rank_ones(fmt, ws):
    for shape in shape_space.candidates(fmt, ws):
        assert shape_space.regimes(fmt, shape, ws) == _brute(fmt, shape, ws), shape


def test_known_shapes_land_in_their_regimes():
    # 136x64 at 8 ranks for NVFP4: 17-row shards split the 16-row scale blocks of columnwise_scale_inv
    cells = shape_space.regimes("nvfp4_2d", (136, 64), 8)
    assert ("columnwise_scale_inv", "rows:split") in cells and ("*", "even") in cells
    assert ("columnwise_scale_inv", "rows:tail-partial") in cells  # 136 = 8.5 blocks
    assert shape_space.regimes("mxfp8", (256, 48), 2) == {("*", "unholdable")}
    assert {("*", "zero-row"), ("*", "m<ws"), ("*", "3d")} <= shape_space.regimes("mxfp8", (4, 32, 64), 8)
    assert ("rowwise_scale_inv", "rows:pad-filled") in shape_space.regimes("mxfp8", (1024, 64), 8)
    assert ("rowwise_scale_inv", "rows:pad-padded") in shape_space.regimes("mxfp8", (256, 64), 8)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_world_size_promises_the_dim0_regimes(fmt):
    for ws in CPU_WORLD_SIZES[1:]:
        promised = shape_space.promised(fmt, ws)
        assert {("*", r) for r in ("even", "uneven", "zero-row", "m<ws", "3d")} <= promised, ws
        for buf in shape_space.buffer_facts(fmt):
            if buf.rows and buf.rows.unit > 1:
                assert {(buf.name, "rows:split"), (buf.name, "rows:aligned")} <= promised, (ws, buf)
            if buf.rows and buf.rows.pad > 1:
                assert {(buf.name, "rows:pad-filled"), (buf.name, "rows:pad-padded")} <= promised, (ws, buf)
            if buf.cols and buf.cols.pad > 1:
                assert {(buf.name, "cols:pad-filled"), (buf.name, "cols:pad-padded")} <= promised, (ws, buf)
    if FORMATS[fmt].k_multiple > 1:
        assert ("*", "unholdable") in shape_space.promised(fmt, 2)


def test_the_cover_keeps_the_hand_picked_shapes_and_hits_every_promised_cell():
    for fmt in FORMATS:
        for ws in (*CPU_WORLD_SIZES, 64, 1024):
            keep = tuple(alignment_shapes(fmt))
            shapes = shape_space.cover(fmt, ws, keep)
            assert shapes[: len(keep)] == keep
            assert shape_space.hit_cells(fmt, shapes, ws) == shape_space.promised(fmt, ws), (fmt, ws)
            assert all(math.prod(s) <= shape_space.MAX_ELEMENTS for s in shapes[len(keep):])


def _default_run(impls=("reference",)):
    cases, primary = coverage.suite_cases(list(impls))
    return coverage.measure(cases, primary)


def test_the_default_run_hits_every_promised_cell():
    """`make test` fails here if the suite's default run misses a cell the generator promises."""
    cov = _default_run()
    assert cov.promised and not cov.missing, coverage.summary_lines(cov)
    scenarios = {k[3] for k in cov.promised}
    assert scenarios == {"gather", "steps", "reshard", "hooks", "virtual"}
    for scenario in ("steps", "reshard"):
        assert {k[5] for k in cov.promised if k[3] == scenario} == set(CPU_WORLD_SIZES)


def test_a_broken_generator_fails_the_check(monkeypatch):
    real_cover = shape_space.cover
    # drops the last generated shape of every (format, world size)
    monkeypatch.setattr(shape_space, "cover", lambda fmt, ws, keep=(): real_cover(fmt, ws, keep)[:-1])
    assert _default_run().missing
    # the hand-picked shapes alone
    monkeypatch.setattr(shape_space, "cover", lambda fmt, ws, keep=(): keep)
    missing = _default_run().missing
    assert ("mxfp8", "rowwise_scale_inv", "rows:pad-filled", "gather", "default", 8) in missing


def test_steps_and_reshard_run_two_seeds_at_every_world_size():
    """Pairwise: each seed with each world size and with each format, in each scenario."""
    sweep = next(s for m, s, _ in suite_sweeps() if m == "test_scenarios")
    cases = sweep.cases(["reference"])
    for scenario in ("steps", "reshard"):
        for ws in CPU_WORLD_SIZES:
            assert {c.seed for c in cases if (c.world_size, c.scenario) == (ws, scenario)} == {0, 1}, (ws, scenario)
        for fmt in FORMATS:
            assert {c.seed for c in cases if (c.fmt, c.scenario) == (fmt, scenario)} == {0, 1}, (fmt, scenario)


def test_hand_picked_ids_keep_their_meaning():
    """Baselines and docs name hand-picked shapes with seed 0: each such id is still in the default run
    (the gathers of every hand-picked shape; steps, reshard and hooks of the four core shapes, their
    other hand-picked shapes' regimes held by the generated ones: qgather.suite.sweeps.LEAN_SHAPES)."""
    ids = {c.id for _m, s, fixed in suite_sweeps() for c in s.cases(fixed or ["torchao"])}
    for ws in (1, 2, 3):
        for shape in alignment_shapes("fp8_tensor"):
            assert f"torchao:fp8_tensor:{'x'.join(map(str, shape))}:bf16:ws{ws}:gather:s0" in ids
        for shape in core_shapes("fp8_tensor"):
            for scenario in ("steps", "reshard", "hooks"):
                assert f"torchao:fp8_tensor:{'x'.join(map(str, shape))}:bf16:ws{ws}:{scenario}:s0" in ids


def test_pairwise_default_run_and_exhaustive_product():
    sweep = Sweep(scenarios=("gather", "steps"), formats=("nvfp4_2d", "mxfp8"), world_sizes=(2, 3),
                  seeds=(0, 1, 2), dtypes=("bf16", "fp32"))
    default, full = sweep.cases(["reference"]), sweep.cases(["reference"], exhaustive=True)
    assert {c.id for c in default} < {c.id for c in full}
    assert len(full) == len(sweep.rows(["reference"])) * 6
    rows = {(c.fmt, c.shape, c.world_size, c.scenario) for c in default}
    assert rows == {(f, s, w, sc) for _i, f, s, w, sc in sweep.rows(["reference"])}  # every row runs
    labels = lambda c: {("fmt", c.fmt), ("ws", c.world_size), ("scenario", c.scenario), ("dtype", c.dtype),
                        ("seed", c.seed)}
    seen = {frozenset((a, b)) for c in default for a in labels(c) for b in labels(c) if a != b}
    values = {("fmt", f) for f in ("nvfp4_2d", "mxfp8")} | {("ws", 2), ("ws", 3)} | {
        ("scenario", "gather"), ("scenario", "steps"), ("dtype", "bf16"), ("dtype", "fp32")} | {
        ("seed", s) for s in (0, 1, 2)}
    wanted = {frozenset((a, b)) for a in values for b in values if a[0] != b[0]}
    assert wanted <= seen, wanted - seen


def test_a_shapes_callable_without_world_sizes_still_crosses_every_world_size():
    sweep = Sweep(scenarios=("gather",), formats=("nvfp4_2d",), world_sizes=(1, 2), dtypes=("bf16",),
                  shapes=lambda fmt: [(128, 64), (136, 64)])
    assert len(sweep.cases(["reference"])) == 4
    assert RULE_SHAPES("nvfp4_2d") == alignment_shapes("nvfp4_2d")


def test_a_narrowed_selection_runs_the_same_ids():
    """The design is made over the whole sweep: --formats/--world-sizes/--scenarios/--impl only narrow it,
    so a baseline written from a narrowed run names cases of the full run."""
    sweep = next(s for m, s, _ in suite_sweeps() if m == "test_scenarios")
    full = {c.id for c in sweep.cases(["torchao"])}
    narrow = sweep.cases(["torchao"], formats=["fp8_tensor"], world_sizes=[2, 8], scenarios=["steps"])
    assert narrow and {c.id for c in narrow} <= full
    assert {c.id.removeprefix("reference") for c in sweep.cases(["reference"])} == {
        i.removeprefix("torchao") for i in full}


def test_every_suite_sweep_answers_the_protocol():
    sweeps = suite_sweeps()
    for module, sweep, _impls in sweeps:
        assert isinstance(sweep, SuiteSweep), module
    assert {type(sweep).__name__ for _m, sweep, _i in sweeps} >= {"Sweep", "ConfigSweep"}
    assert isinstance(CaseSet([]), SuiteSweep)
    assert not isinstance(object(), SuiteSweep)


def test_narrow_keeps_the_selected_values_in_their_order():
    assert narrow((3, 1, 2), None) == [3, 1, 2]
    assert narrow((3, 1, 2), [2, 3, 9]) == [3, 2]
    assert narrow(("ws2", "ws4", "hsdp-2x2"), [4], key=lambda m: 4 if m != "ws2" else 2) == ["ws4", "hsdp-2x2"]
