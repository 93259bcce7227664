"""Tensor parallel + FSDP2 (`tp-DxT`, `tp-DxT-row`): the configuration and its layouts, the golden cut
to a TP piece, the verdict judged piece by piece, the 2-D ("dp", "tp") mesh a case really runs on,
and the failures only tensor parallelism shows: caught, never silent."""

from __future__ import annotations

import pytest
import torch

from qgather.check.golden import golden_for, tensor_parallel_piece
from qgather.engine.classify import classify_results
from qgather.engine.run import RunOptions, run_case
from qgather.formats import FORMATS
from qgather.impls import get_impl
from qgather.model.case import CaseSpec, CaseSpecError, ShardLayout, TensorParallelLayout, shard_layout
from qgather.model.config import ConfigError, FsdpConfig
from qgather.model.policy import expectation
from qgather.model.records import BufferDiff, Comparison, DiffProblem, RankResult, Stage
from qgather.model.verdict import Verdict
from qgather.runtime import OutcomeStatus, PoolSpec, get_pool
from qgather.scenarios import fsdp_setup
from qgather.suite import coverage, shape_space
from qgather.suite.tp_sweep import MESHES, TensorParallelAlignment, TensorParallelSweep, TensorParallelVirtual

CPU = RunOptions(backend="gloo", device="cpu")
BASE = "reference:nvfp4_2d:128x64:bf16:ws4:gather:s0"


# ------------------------------------------------------------------ the configuration
@pytest.mark.parametrize("token, tp, style", [("tp-2x2", (2, 2), "col"), ("tp-2x2-row", (2, 2), "row"),
                                              ("tp-1x4", (1, 4), "col"), ("tp-4x1-row", (4, 1), "row")])
def test_tp_tokens_round_trip_through_the_case_id(token, tp, style):
    spec = CaseSpec.parse(f"{BASE}:{token}")
    assert (spec.config.tp, spec.config.tp_style) == (tp, style)
    assert spec.id == f"{BASE}:{token}"


@pytest.mark.parametrize("case_id, message", [
    (f"{BASE}:tp-2x4", "tp-2x4 needs 8 ranks \\(dp x tp\\), the case has 4"),
    (f"{BASE}:tp-0x4", "needs positive sizes"),
    (f"{BASE}:tp-2x2-col", "is not one of"),
    (f"{BASE}:tp-2x2+hsdp-2x2", "one of them per case"),
    (f"{BASE}:tp-2x2+dim1", "dim1 is not combined with tp"),
    ("reference:nvfp4_2d:128x64:bf16:ws8:gather:s0:tp-2x4+dcp-ws6", "must be a multiple of it"),
])
def test_bad_tp_configurations_name_the_problem(case_id, message):
    with pytest.raises(CaseSpecError, match=message):
        CaseSpec.parse(case_id)


def test_a_rowwise_style_needs_a_tp_mesh():
    with pytest.raises(ConfigError, match="needs a tensor-parallel mesh"):
        FsdpConfig(tp_style="row")


def test_a_checkpoint_under_tp_is_saved_with_the_same_tp_split_at_another_dp_size():
    config = FsdpConfig.parse("mp-bf16+tp-4x2-row+dcp-ws4")
    assert config.saved_config.token == "mp-bf16+tp-2x2-row"


# ------------------------------------------------------------------ layouts and the policy
def test_the_layouts_are_a_tp_piece_sharded_over_dp():
    col = CaseSpec.parse("reference:nvfp4_2d:128x64:bf16:ws8:gather:s0:tp-2x4")
    assert shard_layout(col) == ShardLayout(32, 2, 1)  # 128 / 4 rows per piece over 2 dp ranks
    row = CaseSpec.parse("reference:nvfp4_2d:128x64:bf16:ws8:gather:s0:tp-4x2-row")
    assert shard_layout(row) == ShardLayout(128, 4, 1)  # every row, 32 columns per piece, over 4 dp ranks
    tp = TensorParallelLayout((128, 64), 2, 1)
    assert tp.piece_range(1) == (32, 64) and tp.piece_shape(1) == (128, 32)
    assert tp.label(1) == "tp rank 1 of 2: columns [32, 64)"


@pytest.mark.parametrize("case_id, words", [
    ("reference:nvfp4_2d:48x64:bf16:ws4:gather:s0:tp-2x2", "tp rank 1's piece starts at row 24"),
    ("reference:nvfp4_2d:32x64:bf16:ws4:gather:s0:tp-2x2", "dp rank 1's shard of each tp piece starts at row 8"),
    ("reference:mxfp8:256x32:bf16:ws4:gather:s0:tp-2x2-row", "starts at column 16, not a multiple of the 32"),
    ("reference:fp8_block:128x256:bf16:ws4:gather:s0:tp-2x2-row", "dp rank 1's shard"),
    ("reference:nvfp4_2d:64x64:bf16:ws4:gather:s0:tp-2x2+dcp-ws8", "where the checkpoint was saved"),
])
def test_misaligned_tp_x_dp_splits_may_only_be_rejected_with_the_reason(case_id, words):
    wanted = expectation(CaseSpec.parse(case_id))
    assert not wanted.aligned and words in wanted.reason, wanted


def test_aligned_tp_cases_must_be_exact():
    for case_id in ("reference:nvfp4_2d:128x64:bf16:ws4:gather:s0:tp-2x2",
                    "reference:mxfp8:256x64:bf16:ws8:gather:s0:tp-4x2-row",
                    "reference:fp8_tensor:46x64:bf16:ws4:gather:s0:tp-2x2"):  # per-tensor: no block to cut
        assert expectation(CaseSpec.parse(case_id)).aligned, case_id


@pytest.mark.parametrize("case_id, words", [
    ("reference:nvfp4_2d:4x16x64:bf16:ws4:gather:s0:tp-2x2", "3-D expert weight"),
    ("reference:nvfp4_2d:126x64:bf16:ws8:gather:s0:tp-2x4", "M=126 is not a multiple of the tp size 4"),
    ("reference:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2+compile", "torch.compile"),
    ("reference:fp8_tensor:128x64:bf16:ws4:hooks:s0:tp-2x2", "without fully_shard"),
    ("reference:fp8_tensor:128x64:bf16:ws4:virtual:s0:mp-bf16+tp-2x2", "without fully_shard"),
])
def test_tp_cases_that_cannot_run_are_skipped_with_the_reason(case_id, words):
    reason = fsdp_setup.skip_reason(CaseSpec.parse(case_id), get_impl("reference"))
    assert reason and words in reason, reason


def test_the_virtual_scenario_runs_tp_alone():
    assert fsdp_setup.skip_reason(CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws4:virtual:s0:tp-2x2"),
                                  get_impl("reference")) is None


# ------------------------------------------------------------------ the golden of a piece
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("shape, size, dim", [((512, 256), 2, 0), ((256, 512), 4, 1)])
def test_the_golden_of_a_piece_is_the_piece_quantized_with_the_whole_weights_amax(fmt_name, shape, size, dim):
    """Cut from the full golden (row layout), each aligned piece equals the format's own quantization
    of the piece scaled by the whole weight's amax: the one-device quantization, sliced."""
    fmt = FORMATS[fmt_name]
    weight = (torch.randn(shape, generator=torch.Generator().manual_seed(3))
              * torch.exp2(torch.linspace(-6, 6, shape[0]))[:, None]).to(torch.bfloat16)
    tp = TensorParallelLayout(shape, size, dim)
    golden = golden_for(fmt, weight)
    for rank in range(size):
        start, end = tp.piece_range(rank)
        piece = weight.narrow(dim, start, end - start)
        want = fmt.quantize(piece, amax=weight.float().abs().amax()) if fmt.per_tensor else fmt.quantize(piece)
        got = tensor_parallel_piece(golden, tp, rank).q
        assert got.bitwise_equal(want, valid_only=True), got.mismatches(want, valid_only=True)


def test_a_piece_that_cuts_a_scale_block_has_no_golden():
    golden = golden_for(FORMATS["nvfp4_2d"], torch.randn(48, 64))
    piece = tensor_parallel_piece(golden, TensorParallelLayout((48, 64), 2, 0), 1)
    assert piece.q is None and "cuts nvfp4_2d's 16-row scale blocks" in piece.error


# ------------------------------------------------------------------ the verdict, piece by piece
def _stage(piece: str, digest: str, diffs: tuple[BufferDiff, ...] = ()) -> Stage:
    output = Comparison(True)
    return Stage("unshard 1", digest=digest, buffer_diffs=diffs, dequantized=Comparison(not diffs), output=output,
                 output_digest=digest, piece=piece)


def test_ranks_of_different_tp_pieces_may_differ_ranks_of_one_piece_may_not():
    a, b = "tp rank 0 of 2: rows [0, 64)", "tp rank 1 of 2: rows [64, 128)"
    pieces = [RankResult(r, (_stage(p, p),)) for r, p in enumerate((a, b, a, b))]
    assert classify_results(pieces).verdict is Verdict.EXACT
    split = [RankResult(r, (_stage(p, p + str(r == 2)),)) for r, p in enumerate((a, b, a, b))]
    found = classify_results(split)
    assert found.verdict is Verdict.RANK_DIVERGENCE and "of one tp piece" in found.reason, found


def test_a_wrong_second_piece_is_caught_although_rank_0s_piece_is_right():
    a, b = "tp rank 0 of 2: rows [0, 64)", "tp rank 1 of 2: rows [64, 128)"
    wrong = (BufferDiff("data", DiffProblem.BITS, 3, 4096),)
    results = [RankResult(r, (_stage(p, p, wrong if p == b else ()),)) for r, p in enumerate((a, b, a, b))]
    found = classify_results(results)
    assert found.verdict is Verdict.SILENT_MISMATCH and found.reason.startswith(f"unshard 1: {b}: data"), found


# ------------------------------------------------------------------ on the rank pools
def test_the_case_runs_on_a_dp_x_tp_mesh_with_torchs_placements():
    """tp-2x2 (colwise): FSDP2 shards each TP piece over dp (a strided shard of dim 0 beside TP's
    Shard(0)); after the unshard the weight is a DTensor on "tp" holding this rank's piece."""
    outcome = get_pool(PoolSpec("gloo", 4, "cpu")).run(
        __import__("tests._tp_adapters", fromlist=["x"]).sharded_placements,
        "reference:nvfp4_2d:128x64:bf16:ws4:gather:s0:tp-2x2", timeout=60)
    assert outcome.status is OutcomeStatus.OK, outcome.headline()
    by_rank = outcome.results
    assert {r["mesh"] for r in by_rank} == {("dp", "tp")}
    assert {r["sharded"] for r in by_rank} == {(("_StridedShard", 0, 2), ("Shard", 0, None))}
    assert {r["local"] for r in by_rank} == {(32, 64)} and {r["piece"] for r in by_rank} == {(64, 64)}
    assert {r["unsharded"] for r in by_rank} == {(("Shard", 0, None),)}
    assert {r["global"] for r in by_rank} == {(128, 64)}
    assert [(r["dp"], r["tp"]) for r in by_rank] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("case_id", [
    "reference:fp8_tensor:128x64:bf16:ws4:steps:s0:tp-2x2",
    "reference:nvfp4_2d:128x64:bf16:ws4:reshard:s0:tp-2x2-row",
    "reference:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2+dcp-ws2",
])
def test_the_reference_is_exact_under_tp(case_id):
    report = run_case(CaseSpec.parse(case_id), CPU)
    assert report.verdict is Verdict.EXACT, report.render()


def test_a_misaligned_tp_split_is_rejected_naming_the_block():
    report = run_case(CaseSpec.parse("reference:nvfp4_2d:48x64:bf16:ws4:gather:s0:tp-2x2"), CPU)
    assert report.verdict is Verdict.REJECTED and "16-row scale block" in report.reason, report.render()
    assert report.passed


def test_a_whole_weight_gathered_where_a_tp_piece_belongs_is_caught():
    """An own route that ignores tensor parallelism gathers the full weight on every rank."""
    report = run_case(CaseSpec.parse(
        "tests._tp_adapters:IgnoresTensorParallel:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2"), CPU)
    assert report.verdict is Verdict.SILENT_MISMATCH and "tp rank 0 of 2" in report.reason, report.render()
    assert "shape" in report.reason, report.render()


@pytest.mark.parametrize("token", ["", ":hsdp-2x2"])
def test_an_amax_reduced_over_dp_only_is_exact_without_tp(token):
    report = run_case(CaseSpec.parse(f"mutant:amax_over_dp_only:fp8_tensor:128x64:bf16:ws4:steps:s0{token}"), CPU)
    assert report.verdict is Verdict.EXACT, report.render()


def test_an_amax_reduced_over_dp_only_is_caught_under_tp():
    report = run_case(CaseSpec.parse("mutant:amax_over_dp_only:fp8_tensor:128x64:bf16:ws4:steps:s0:tp-2x2"), CPU)
    assert report.verdict is Verdict.SILENT_MISMATCH, report.render()
    assert report.reason.startswith("unshard 2 (after step 1): tp rank 0 of 2: rows [0, 64): data:"), report.reason


@pytest.mark.parametrize("case_id", [
    "reference:nvfp4_2d:128x64:bf16:ws4:gather:s0:tp-2x2-row",
    "reference:nvfp4_2d:48x64:bf16:ws4:gather:s0:tp-2x2",
    "mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws4:gather:s0:tp-2x2",
])
def test_the_virtual_tp_world_gives_the_real_verdict(case_id):
    real = CaseSpec.parse(case_id)
    virtual = CaseSpec(real.impl, real.fmt, real.shape, real.dtype, real.world_size, "virtual", real.seed, real.config)
    a, b = run_case(real, CPU), run_case(virtual, CPU)
    assert a.verdict is b.verdict, f"real:\n{a.render()}\nvirtual:\n{b.render()}"


def test_torchao_scales_each_tp_piece_by_its_own_amax_unless_the_scale_is_precomputed():
    """docs/findings.md, "torchao float8 under FSDP2 + TP": its pre-hook reduces the amax over the
    "dp" mesh FSDP2 hands it; precompute_float8_dynamic_scale_for_fsdp reduces over both dimensions."""
    pytest.importorskip("torchao")
    plain = run_case(CaseSpec.parse("torchao:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2"), CPU)
    assert plain.verdict is Verdict.SILENT_MISMATCH, plain.render()
    assert plain.reason.startswith("unshard 1: tp rank 0 of 2: rows [0, 64): data:"), plain.reason
    assert "scale_inv: 1 of 1 valid elements differ" in plain.reason, plain.reason
    precomputed = run_case(CaseSpec.parse("torchao:precompute:fp8_tensor:128x64:bf16:ws4:steps:s0:tp-2x2-row"), CPU)
    assert precomputed.verdict is Verdict.EXACT, precomputed.render()


def test_te_under_tp_is_skipped_with_tes_own_reason_without_it():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure is what the skip must say
        report = run_case(CaseSpec.parse("te:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2"), CPU)
        assert report.verdict is Verdict.SKIPPED and "transformer_engine unavailable" in report.reason, report.render()
    else:
        pytest.skip("TransformerEngine is installed here: the te route runs (tests/gpu)")


# ------------------------------------------------------------------ the sweeps
def test_the_tp_sweep_covers_every_mesh_scenario_and_format():
    cases = TensorParallelSweep().cases(["reference"])
    assert {c.config.token for c in cases} >= set(MESHES)
    assert {c.scenario for c in cases} == {"gather", "steps", "reshard"}
    assert {c.fmt for c in cases} == set(FORMATS)
    assert {c.impl for c in cases} == {"reference", "torchao:precompute"}
    assert any(c.config.saved_at_world_size for c in cases)
    assert all(expectation(c).aligned for c in cases), [c.id for c in cases if not expectation(c).aligned]
    narrowed = {c.id for c in TensorParallelSweep().cases(["reference"], world_sizes=[4], formats=["mxfp8"])}
    assert narrowed and narrowed <= {c.id for c in cases}
    assert len(TensorParallelSweep().cases(["reference"], exhaustive=True)) > 4 * len(cases)


def test_the_alignment_sweep_splits_tp_pieces_and_their_dp_shards():
    cases = TensorParallelAlignment().cases(["reference"])
    blocked = [c for c in cases if FORMATS[c.fmt].row_block > 1]
    assert blocked and not any(expectation(c).aligned for c in blocked)
    assert {expectation(c).reason.split("'")[0] for c in blocked} == {"tp rank 1", "dp rank 1"}
    assert {c.config.tp_style for c in cases} == {"col", "row"}


def test_the_virtual_sweep_has_large_dp_x_tp_worlds():
    sizes = {c.config.tp for c in TensorParallelVirtual().cases(["reference"])}
    assert {(32, 8), (128, 8)} <= sizes


def test_coverage_reads_a_tp_case_as_its_piece_over_dp():
    spec = CaseSpec.parse("reference:nvfp4_2d:128x64:bf16:ws8:gather:s0:tp-2x4")
    hits = coverage.measure([spec]).hits
    assert {(b, r) for (_, b, r, *_rest) in hits} == set(shape_space.regimes("nvfp4_2d", (32, 64), 2))
