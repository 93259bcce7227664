"""The block scenario (every parameter of a block in one fully_shard group): the parameters a case
derives, the suite's cases, a reference block on the rank pools, and a wrong gather caught in it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from qgather.cases.test_block import SWEEP, TORCHAO
from qgather.engine.run import RunOptions, run_case
from qgather.impls.base import Implementation
from qgather.model.block import block_params
from qgather.model.case import CaseSpec
from qgather.model.layers import layer_weights
from qgather.model.policy import expectation
from qgather.model.verdict import Verdict
from qgather.suite import coverage

CPU = RunOptions(backend="gloo", device="cpu")


def test_a_block_holds_the_layers_weights_with_plain_parameters_between_them():
    spec = CaseSpec.parse("reference:nvfp4_2d:18x64:bf16:ws2:block:s0")
    params = block_params(spec)
    first, aligned, experts = layer_weights(spec)
    assert params.quantized == (first, aligned, params.other, experts)
    assert (params.other.spec.fmt, params.other.spec.shape) == ("mxfp8", (128, 64))  # two formats in one group
    assert expectation(replace(spec, shape=(32, 64))).aligned  # the other format's weight is aligned too
    assert [(p.name, p.length, p.in_root) for p in params.plain] == [
        ("norm", 64, False), ("bias", params.aligned.spec.shape[0], False)]
    nested = block_params(CaseSpec.parse("reference:nvfp4_2d:18x64:bf16:ws2:block:s0:nested")).plain
    assert [(p.name, p.in_root) for p in nested] == [("norm", False), ("bias", False), ("scale", True)]
    assert len({p.seed for p in nested}) == 3
    # the policy reads every weight of the block, as for layers
    assert not expectation(spec).aligned and "weight first 18x64" in expectation(spec).reason
    assert {k[2] for k in coverage.measure([spec]).hits} >= {"3d", "rows:split", "rows:aligned"}


def test_the_suite_crosses_every_format_with_mp_raf_and_hsdp_and_compiles_three():
    cases = SWEEP.cases(["reference"])
    assert {c.scenario for c in cases} == {"block"}
    assert len({c.fmt for c in cases}) == 7
    by_config: dict[str, set[str]] = {}
    for c in cases:
        by_config.setdefault(c.config.token, set()).add(c.fmt)
    assert set(by_config) == {"", "compile", "mp-bf16", "raf-no", "hsdp-2x2", "nested"}
    # issue 46's depth: block crossed with mp-*, raf-* and hsdp on every format; compile and nested on three
    assert {token: len(fmts) for token, fmts in by_config.items()} == {
        "": 7, "mp-bf16": 7, "raf-no": 7, "hsdp-2x2": 7, "compile": 3, "nested": 3}
    assert any(not expectation(c).aligned for c in cases) and any(expectation(c).aligned for c in cases)
    assert {c.impl for c in TORCHAO.cases(["torchao", "torchao:precompute"])} == {"torchao", "torchao:precompute"}


def test_an_adapter_without_the_harness_route_is_skipped():
    class OwnRouteOnly(Implementation):
        name, formats = "own", ("fp8_tensor",)

        def make_sharded_module(self, ctx, spec, master, setup=None):
            return None

        def read_buffers(self, param):
            return {}

        def is_quantized(self, param):
            return True

    reason = OwnRouteOnly().skip_reason(CaseSpec.parse("own:fp8_tensor:32x64:bf16:ws2:block:s0"), torch.device("cpu"))
    assert reason and "make_param, make_module, make_block_layer" in reason


def test_a_reference_block_is_exact_and_a_wrong_gather_in_it_is_caught():
    report = run_case(CaseSpec.parse("reference:fp8_tensor:17x64:bf16:ws2:block:s0:nested"), CPU)
    assert report.verdict is Verdict.EXACT and report.passed, report.render()
    assert any(d.startswith("wire (the block's group: 4 quantized and 2 plain parameters)") for d in report.details)
    plain = run_case(CaseSpec.parse("tests._block_adapters:CorruptsThePlainNorm:fp8_tensor:17x64:bf16:ws2:block:s0"),
                     CPU)
    assert plain.verdict is Verdict.SILENT_MISMATCH and "plain norm 64: values:" in plain.reason, plain.render()
    wrong = run_case(CaseSpec.parse("mutant:nibble_swap:nvfp4_2d:32x64:bf16:ws2:block:s0"), CPU)
    assert wrong.verdict is Verdict.SILENT_MISMATCH and "first unshard" in wrong.reason, wrong.render()


@pytest.mark.parametrize("mutant", ["staged_wire", "class_wire_plan"])
def test_the_group_mutants_pass_a_group_of_one_weight(mutant):
    """The bugs only a group of several parameters shows (bug classes 25, 26; test_selftest proves their
    catching block cases): the same module with one group per weight (layers) is EXACT."""
    report = run_case(CaseSpec.parse(f"mutant:{mutant}:fp8_block:255x64:bf16:ws2:layers:s0"), CPU)
    assert report.verdict is Verdict.EXACT, report.render()


def test_a_layer_the_library_builds_itself_is_sharded_in_the_group_then_materialized():
    """The route TE's te.Linear takes in a block (make_block_layer, then materialize_block_layer after the
    block's fully_shard), emulated with reference layers whose shards are written only at materialization."""
    report = run_case(CaseSpec.parse("tests._block_adapters:MaterializedAfterSharding:fp8_tensor:17x64:bf16:ws2:"
                                     "block:s0"), CPU)
    assert report.verdict is Verdict.EXACT, report.render()
    assert not any("outputs not compared" in d for d in report.details), report.render()
    never = run_case(CaseSpec.parse("tests._block_adapters:NeverMaterialized:fp8_tensor:17x64:bf16:ws2:block:s0"), CPU)
    assert never.verdict is Verdict.SILENT_MISMATCH, never.render()


def test_the_block_forward_runs_without_autograd_as_its_twin_does():
    """A library whose forward context updates state on a grad-enabled exit (TE's DelayedScaling) would
    differ from its twin and its golden after step 1 if the block's forward built an autograd graph."""
    report = run_case(CaseSpec.parse("tests._block_adapters:StateOnGradForward:fp8_tensor:64x64:bf16:ws2:block:s0"),
                      CPU)
    assert report.verdict is Verdict.EXACT and report.passed, report.render()


def test_a_twin_that_widens_its_output_is_compared_as_the_sharded_layer_returns_it():
    """TE's one-device twin returns float32 while the sharded te.Linear returns bf16, to which the block
    adds its bf16 bias: the twin's outputs are rounded to the activations' dtype first (in float32
    the bias add rounds otherwise: the aligned TE block cases' SILENT_MISMATCH on 2 x H200)."""
    report = run_case(CaseSpec.parse("tests._block_adapters:TwinInFloat32:fp8_tensor:64x64:bf16:ws2:block:s0"), CPU)
    assert report.verdict is Verdict.EXACT and report.passed, report.render()
    assert not any("outputs not compared" in d for d in report.details), report.render()


@pytest.mark.parametrize("adapter, verdict, reason", [
    ("WrongAlignedWeight", Verdict.SILENT_MISMATCH, "weight aligned 64x64: data: 1 of 4096"),
    ("RefusesExperts", Verdict.ERROR, "weight experts 4x16x64: left out of the module: refused"),
    ("RefusesInPreHook", Verdict.REJECTED, "ShardAlignmentError: pre-all-gather hook"),
])
def test_a_wrong_weight_or_a_refusal_in_the_group(adapter, verdict, reason):
    """One wrong weight among the group's fails the case; a weight refused although aligned is an ERROR;
    a refusal of the misaligned first weight in the group's pre-all-gather pass refuses the block."""
    shape = "17x64" if adapter == "WrongAlignedWeight" else "18x64"
    fmt = "fp8_tensor" if adapter == "WrongAlignedWeight" else "nvfp4_2d"
    report = run_case(CaseSpec.parse(f"tests._layers_adapters:{adapter}:{fmt}:{shape}:bf16:ws2:block:s0"), CPU)
    assert report.verdict is verdict and reason in report.reason, report.render()
