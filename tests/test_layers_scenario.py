"""The layers scenario (a module of several quantized weights): the weights a case derives, the
verdict policy for a refused weight, a wrong gather of one weight alone, external adapters."""

from __future__ import annotations

import pytest

from qgather.cases.test_layers import SWEEP, TORCHAO
from qgather.engine.classify import classify_results
from qgather.engine.run import RunOptions, run_case
from qgather.impls import get_impl
from qgather.model.case import CaseSpec, shard_layout
from qgather.model.layers import layer_weights
from qgather.model.layout import alignment_problem
from qgather.model.policy import expectation, refusal_accepted
from qgather.model.records import BufferDiff, Comparison, DiffProblem, RankResult, Stage, WireSummary
from qgather.model.verdict import Verdict
from qgather.scenarios import fsdp_setup
from qgather.suite import coverage

CPU = RunOptions(backend="gloo", device="cpu")
ADAPTERS = "tests._layers_adapters"


def _run(case_id: str):
    return run_case(CaseSpec.parse(case_id), CPU)


# ------------------------------------------------------------------ the weights, the policy, the suite
def test_a_case_derives_three_weights_of_different_shapes_from_its_first():
    spec = CaseSpec.parse("reference:nvfp4_2d:18x64:bf16:ws2:layers:s0")
    first, aligned, experts = layer_weights(spec)
    assert (first.spec.shape, aligned.spec.shape, experts.spec.shape) == ((18, 64), (64, 64), (4, 16, 64))
    assert first.spec.seed == spec.seed and len({first.spec.seed, aligned.spec.seed, experts.spec.seed}) == 3
    assert len({w.scale for w in (first, aligned, experts)}) == 3
    assert alignment_problem(first.spec) and not alignment_problem(aligned.spec) and not alignment_problem(experts.spec)
    # a first weight equal to a derived one moves the derived one to another multiple of the row unit
    clash = layer_weights(CaseSpec.parse("reference:nvfp4_2d:64x64:bf16:ws2:layers:s0"))
    assert len({w.spec.shape for w in clash}) == 3
    # under HSDP the weights are derived from the shard mesh's ranks
    hsdp = layer_weights(CaseSpec.parse("reference:nvfp4_2d:18x64:bf16:ws4:layers:s0:hsdp-2x2"))
    assert hsdp[1].spec.shape == (64, 64) and shard_layout(hsdp[1].spec).world_size == 2


def test_the_policy_reads_every_weight_of_the_module():
    split = CaseSpec.parse("reference:nvfp4_2d:18x64:bf16:ws2:layers:s0")
    assert not expectation(split).aligned and "weight first 18x64" in expectation(split).reason
    assert expectation(split).accepts(Verdict.REJECTED)
    first, aligned, _ = layer_weights(split)
    assert refusal_accepted(first.spec) and not refusal_accepted(aligned.spec)
    uneven = CaseSpec.parse("reference:fp8_tensor:17x64:bf16:ws2:layers:s0")
    assert expectation(uneven).aligned and not expectation(uneven).accepts(Verdict.REJECTED)


def test_the_suite_runs_uneven_and_split_first_weights_and_torchao_even_ones():
    cases = SWEEP.cases(["reference"])
    assert {c.scenario for c in cases} == {"layers"} and {c.world_size for c in cases} == {1, 2, 3, 4}
    assert {c.config.token for c in cases} == {"", "compile", "raf-no", "mp-bf16", "hsdp-2x2"}
    assert any(not expectation(c).aligned for c in cases) and any(expectation(c).aligned for c in cases)
    for fmt in ("fp8_tensor", "fp8_block", "nvfp4_1d"):  # an uneven first weight whose shards stay aligned
        assert any(c.fmt == fmt and c.world_size > 1 and expectation(c).aligned
                   and c.shape[0] % shard_layout(c).world_size for c in cases), fmt
    torchao = TORCHAO.cases(["torchao"])
    assert torchao and all(c.shape[0] % c.world_size == 0 for c in torchao)


def test_layers_cases_hit_every_weights_regimes_and_promise_none():
    spec = CaseSpec.parse("reference:nvfp4_2d:18x64:bf16:ws2:layers:s0")
    cov = coverage.measure([spec])
    assert not cov.promised
    assert {k[2] for k in cov.hits} >= {"3d", "rows:split", "rows:aligned"}


@pytest.mark.parametrize("case_id, reason", [
    ("reference:nvfp4_2d:18x64:bf16:ws2:layers:s0:dim1", "dim1"),
    ("reference:nvfp4_2d:32x64:bf16:ws2:layers:s0:dcp-ws4", "dcp-wsA"),
])
def test_configurations_the_layers_scenario_does_not_run_are_skipped(case_id, reason):
    report = _run(case_id)
    assert report.verdict is Verdict.SKIPPED and report.reason.startswith(reason), report.render()
    assert fsdp_setup.skip_reason(CaseSpec.parse(case_id), get_impl("reference"))


# ------------------------------------------------------------------ the classification of a refused weight
def _stage(label: str, **kw) -> Stage:
    return Stage(label, digest="d", output=Comparison(True), output_digest="o", **kw)


def _results(*stages: Stage, world_size: int = 2, **kw) -> list[RankResult]:
    return [RankResult(rank, stages, **kw) for rank in range(world_size)]


def test_an_accepted_refusal_is_rejected_only_after_the_rest_is_exact():
    refused = Stage("weight first 18x64: left out of the module", refused="ShardAlignmentError: x",
                    refusal_accepted=True)
    found = classify_results(_results(refused, _stage("weight aligned 64x64")))
    assert found.verdict is Verdict.REJECTED and found.reason.startswith("weight first 18x64")
    wrong = _stage("weight aligned 64x64", buffer_diffs=(BufferDiff("data", DiffProblem.BITS, 1, 4096),))
    assert classify_results(_results(refused, wrong)).verdict is Verdict.SILENT_MISMATCH
    degraded = WireSummary(collective_bytes=10_000, collectives=1, hook_calls=1, shard_numel=2048, param_itemsize=2,
                           packed_bytes=2048, wire_mode="packed", allowed_bytes=2253, label="weight aligned 64x64")
    found = classify_results(_results(refused, _stage("weight aligned 64x64"), wires=(degraded,)))
    assert found.verdict is Verdict.DEGRADED and found.reason.startswith("weight aligned 64x64: ")


def test_a_refusal_the_policy_does_not_accept_or_of_some_ranks_is_an_error():
    aligned = Stage("weight experts 4x16x64: left out of the module", refused="NoExperts: x", refusal_accepted=False)
    found = classify_results(_results(aligned, _stage("weight first 17x64")))
    assert found.verdict is Verdict.ERROR and "every shard of it is aligned" in found.reason
    partial = [RankResult(0, (Stage("w", refused="NoExperts: x", refusal_accepted=True),)),
               RankResult(1, (_stage("w"),))]
    assert classify_results(partial).verdict is Verdict.ERROR


# ------------------------------------------------------------------ cases on the rank pools
def test_reference_modules_are_exact_or_rejected_with_the_other_weights_judged():
    report = _run("reference:fp8_tensor:17x64:bf16:ws2:layers:s0")
    assert report.verdict is Verdict.EXACT and report.passed, report.render()
    assert sum("wire (weight" in d for d in report.details) == 3, report.render()
    report = _run("reference:nvfp4_2d:18x64:bf16:ws2:layers:s0")
    assert report.verdict is Verdict.REJECTED and report.passed, report.render()
    assert "weight first 18x64" in report.reason and "ShardAlignmentError" in report.reason


def test_a_wrong_gather_of_the_second_weight_alone_is_caught():
    report = _run(f"{ADAPTERS}:WrongAlignedWeight:fp8_tensor:17x64:bf16:ws2:layers:s0")
    assert report.verdict is Verdict.SILENT_MISMATCH, report.render()
    assert report.reason.startswith("weight aligned 64x64: its first unshard"), report.reason
    # the one-weight cases of the same adapter never gather that shape: EXACT
    assert _run(f"{ADAPTERS}:WrongAlignedWeight:fp8_tensor:17x64:bf16:ws2:steps:s0").verdict is Verdict.EXACT


def test_a_refused_weight_does_not_hide_a_wrong_gather_of_another():
    report = _run(f"{ADAPTERS}:WrongAlignedWeight:nvfp4_2d:18x64:bf16:ws2:layers:s0")
    assert report.verdict is Verdict.SILENT_MISMATCH and not report.passed, report.render()
    assert "weight aligned 64x64" in report.reason


def test_a_refusal_in_the_pre_all_gather_hook_leaves_that_weight_out():
    report = _run(f"{ADAPTERS}:RefusesInPreHook:nvfp4_2d:18x64:bf16:ws2:layers:s0")
    assert report.verdict is Verdict.REJECTED and report.passed, report.render()
    assert "pre-all-gather hook" in report.reason and "EXACT" in report.details[0]


def test_refusing_an_aligned_weight_fails_and_so_does_a_refusal_on_some_ranks():
    report = _run(f"{ADAPTERS}:RefusesExperts:fp8_tensor:17x64:bf16:ws2:layers:s0")
    assert report.verdict is Verdict.ERROR and not report.passed, report.render()
    assert report.reason.startswith("weight experts 4x16x64") and "NoExperts" in report.reason
    report = _run(f"{ADAPTERS}:RefusesExpertsOnRankZero:fp8_tensor:17x64:bf16:ws2:layers:s0")
    assert report.verdict is Verdict.ERROR and not report.passed, report.render()
    assert "NoExperts" in report.reason or "refused on ranks 0 only" in report.reason


def test_an_adapter_on_its_own_route_and_torchao_run_the_module():
    report = _run("tests._own_route_adapters:ConfiguredOwnRoute:nvfp4_1d:46x64:bf16:ws3:layers:s0")
    assert report.verdict is Verdict.EXACT, report.render()
    assert any("no single_device_output" in d for d in report.details), report.render()
    report = _run("torchao:precompute:fp8_tensor:128x64:bf16:ws2:layers:s0")
    assert report.verdict is Verdict.EXACT, report.render()
    assert any("weight experts 4x16x64 left out" in d for d in report.details), report.render()


def test_a_degraded_weight_is_named():
    report = _run("mutant:hp_fallback:nvfp4_2d:32x64:bf16:ws2:layers:s0")
    assert report.verdict is Verdict.DEGRADED and "weight" in report.reason, report.render()
