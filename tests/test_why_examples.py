"""Every example of issue 8's "Why", with the verdict it must get now (and the one it used to get,
in the comment). The adapters are in tests/_why_adapters.py; real cases run on gloo rank pools."""

from __future__ import annotations

import pytest

from qgather.engine.classify import classify_errors
from qgather.engine.run import RunOptions, run_case
from qgather.impls.rejections import DeclaredRejections
from qgather.model.case import CaseSpec
from qgather.model.verdict import Verdict
from qgather.runtime import RankError, shutdown_pools

A = "tests._why_adapters:"
CPU = RunOptions("gloo", "cpu", 60.0)


@pytest.fixture(scope="module", autouse=True)
def _stop_pools_after_module():
    yield
    shutdown_pools(keep_helpers=True)  # the next module's pools fork from the same warm forkserver


def run(case_id: str):
    return run_case(CaseSpec.parse(case_id), CPU)


@pytest.mark.parametrize("scenario", ["gather", "virtual"])
def test_wrong_bytes_are_judged_although_the_forward_raises(scenario):
    # was REJECTED: the gather's diffs were thrown away with the forward's exception
    report = run(f"{A}WrongBytesThenRaisingForward:nvfp4_2d:128x64:bf16:ws2:{scenario}:s0")
    assert report.verdict is Verdict.SILENT_MISMATCH, report.render()
    assert any("the forward then raised RuntimeError: GEMM needs M % 16 == 0" in d for d in report.details)


@pytest.mark.parametrize(("adapter", "evidence"), [
    ("WrongBytesThenRaisingDequantize", "qgather: the gathered buffers against the golden: rowwise_data: "),
    ("RaisingDequantize", "qgather: the gathered buffers against the golden: every buffer bit-identical"),
])
def test_a_library_dequantize_that_raises_still_reports_the_gathered_bytes(adapter, evidence):
    # issue 41: TE's dequantize of a gathered Float8BlockwiseQTensor raised and the report held only TE's error
    report = run(f"{A}{adapter}:nvfp4_2d:128x64:bf16:ws2:gather:s0")
    assert report.verdict is Verdict.ERROR and "(in the inspection)" in report.reason, report.render()
    assert evidence in report.render(), report.render()


@pytest.mark.parametrize("adapter", ["AlwaysRaisingMakeParam", "OutOfMemory"])
def test_an_error_that_names_no_declared_constraint_is_an_error(adapter):
    # was REJECTED on every misaligned case (here 68-row shards of a 16-row block format)
    report = run(f"{A}{adapter}:nvfp4_2d:136x64:bf16:ws2:gather:s0")
    assert report.verdict is Verdict.ERROR and not report.passed, report.render()


def test_a_pre_hook_fsdp2_cannot_call_is_an_error():
    # was REJECTED: the same error on every rank
    report = run(f"{A}PreHookSignatureFSDP2Refuses:nvfp4_2d:128x64:bf16:ws2:gather:s0")
    assert report.verdict is Verdict.ERROR and not report.passed, report.render()


def test_a_wrong_output_on_one_rank_is_seen():
    # was EXACT: only the first rank's output was judged
    report = run(f"{A}WrongOutputOnRank1:nvfp4_2d:128x64:bf16:ws2:gather:s0")
    assert report.verdict is Verdict.RANK_DIVERGENCE, report.render()
    assert "layer outputs" in report.reason


@pytest.mark.parametrize("scenario", ["gather", "virtual"])
def test_a_pre_hook_checking_only_its_own_shard_would_deadlock(scenario):
    # was REJECTED virtually and ERROR on real ranks: 128 + 127 rows, rank 1 refuses, rank 0 gathers
    report = run(f"{A}ChecksOnlyItsOwnShard:fp8_block:255x128:bf16:ws2:{scenario}:s0")
    assert report.verdict is Verdict.ERROR, report.render()
    assert report.reason.startswith("rank 1 raised ValueError")
    assert any("ranks 0 did not raise" in d for d in report.details)


def test_the_harness_padded_size_rule_is_never_a_rejection():
    from qgather.scenarios.emulation import PaddedSizeRule

    errors = {r: PaddedSizeRule("fsdp_pre_all_gather must return all-gather inputs with the padded size")
              for r in (0, 1)}
    for error in errors.values():
        error.qgather_phase = "pre-all-gather hook"
    errors = {r: RankError.from_exception(r, e) for r, e in errors.items()}
    found = classify_errors(errors, 2, DeclaredRejections.of(("PaddedSizeRule", "HarnessFault")).problem)
    verdict, details = found.verdict, found.details
    assert verdict is Verdict.ERROR and any("internal fault" in d for d in details)


def test_a_rank_reaching_the_same_rejection_later_is_still_a_rejection():
    # was ERROR ("would wait in the collective"): a 0.4 s timer decided
    report = run(f"{A}LateRejectionOnRank1:nvfp4_2d:136x64:bf16:ws2:gather:s0")
    assert report.verdict is Verdict.REJECTED and report.passed, report.render()


def test_its_own_quantizer_is_the_golden_and_its_drift_a_quantizer_mismatch():
    # was SILENT_MISMATCH (blaming the gather): the golden was always the reference format
    report = run(f"{A}DriftingQuantizer:fp8_tensor:128x64:bf16:ws2:gather:s0")
    assert report.verdict is Verdict.QUANTIZER_MISMATCH, report.render()
    assert any("scale_inv" in d for d in report.details)


def test_a_high_precision_wire_is_degraded_whatever_its_dtype_label():
    # was EXACT: DEGRADED was read from the dtype labels (uint8 here), not from the bytes moved
    report = run(f"{A}GathersBf16Bytes:fp8_tensor:128x64:bf16:ws2:gather:s0")
    assert report.verdict is Verdict.DEGRADED, report.render()
    assert "bytes moved per rank, 2.00x the format's packed shard" in report.reason
