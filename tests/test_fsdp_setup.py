"""qgather.scenarios.fsdp_setup: a configuration reaches fully_shard (dtype of the unsharded weight, 2-D mesh,
Shard(1) layout), the covering design covers every pair, and configs that cannot apply are SKIPPED."""

from __future__ import annotations

import itertools

import torch

from qgather.engine.run import RunOptions, run_case
from qgather.impls import get_impl
from qgather.model.case import CaseSpec, ColumnShardLayout, shard_layout
from qgather.model.policy import expectation
from qgather.model.verdict import Verdict
from qgather.scenarios import fsdp_setup
from qgather.suite.config_sweep import FSDP, TORCHAO_BESIDE, ConfigSweep
from qgather.suite.covering import pairwise

CPU = RunOptions(backend="gloo", device="cpu")


def test_pairwise_covers_every_pair():
    factors = (("a", "b", "c"), ("x", "y"), ("1", "2", "3", "4"), ("p", "q"))
    rows = pairwise(factors)
    for i, j in itertools.combinations(range(len(factors)), 2):
        assert {(r[i], r[j]) for r in rows} == set(itertools.product(factors[i], factors[j]))
    assert len(rows) < len(list(itertools.product(*factors)))


def test_sweep_covers_every_dimension_value():
    cases = ConfigSweep(FSDP, companions=TORCHAO_BESIDE).cases(["reference"])
    tokens = {t for c in cases for t in c.config.token.split("+")}
    assert {"mp-bf16", "mp-fp32", "raf-no", "dim1", "hsdp-2x2", "hsdp-1x2", "hsdp-2x1"} <= tokens
    assert {c.impl for c in cases} == {"reference", "torchao"}
    assert len(ConfigSweep(FSDP, product=True).cases(["reference"])) > 10 * len(cases)


def test_layouts_follow_the_shard_dimension():
    hsdp = CaseSpec.parse("reference:nvfp4_2d:160x64:bf16:ws4:gather:s0:hsdp-2x2")
    assert shard_layout(hsdp).world_size == 2 and expectation(hsdp).aligned  # 80-row shards split no block
    flat = CaseSpec.parse("reference:nvfp4_2d:160x64:bf16:ws4:gather:s0")
    assert not expectation(flat).aligned  # 40-row shards do
    dim1 = CaseSpec.parse("reference:mxfp8:128x64:bf16:ws4:gather:s0:dim1")
    assert not expectation(dim1).aligned and "column 16" in expectation(dim1).reason


def test_unappliable_configs_are_skipped():
    ref = get_impl("reference")
    for case_id in ("reference:nvfp4_2d:128x64:bf16:ws2:virtual:s0:mp-bf16",
                    "reference:nvfp4_2d:128x64:bf16:ws2:hooks:s0:dim1",
                    "reference:nvfp4_2d:4x16x64:bf16:ws2:gather:s0:dim1",
                    "reference:fp8_tensor:128x66:bf16:ws4:gather:s0:dim1",
                    "reference:nvfp4_2d:128x64:bf16:ws4:gather:s0:raf-2"):
        assert fsdp_setup.skip_reason(CaseSpec.parse(case_id), ref), case_id


def test_mixed_precision_gives_the_policy_dtype():
    """bf16 over fp32 masters: the unsharded weight must be bf16; a post-hook ignoring it is caught."""
    report = run_case(CaseSpec.parse("reference:nvfp4_2d:128x64:fp32:ws2:gather:s0:mp-bf16"), CPU)
    assert report.verdict is Verdict.EXACT, report.render()
    bad = run_case(CaseSpec.parse("mutant:ignores_param_dtype:nvfp4_2d:128x64:fp32:ws2:gather:s0:mp-bf16"), CPU)
    assert bad.verdict is Verdict.SILENT_MISMATCH and "bfloat16" in bad.reason, bad.render()


def test_hsdp_builds_a_2d_mesh_and_shards_over_its_shard_dim():
    """The HSDP-confused mutant (sizes its wire by the world) fails only because the mesh is 2-D."""
    assert run_case(CaseSpec.parse("reference:nvfp4_2d:128x64:bf16:ws4:steps:s0:hsdp-2x2"), CPU).verdict \
        is Verdict.EXACT
    bad = run_case(CaseSpec.parse("mutant:world_not_shard_mesh:nvfp4_2d:128x64:bf16:ws4:gather:s0:hsdp-2x2"), CPU)
    assert bad.verdict is Verdict.ERROR, bad.render()
    flat = run_case(CaseSpec.parse("mutant:world_not_shard_mesh:nvfp4_2d:128x64:bf16:ws4:gather:s0"), CPU)
    assert flat.verdict is Verdict.EXACT, flat.render()


def test_no_reshard_after_forward_regathers_into_the_kept_weight():
    """raf-no (and raf-1, which FSDP2 reads as False) re-gathers through the forward into the unsharded
    weight built by the first gather: hooks that take "not resharded after forward" for "gathered once"
    and keep that weight's layout are caught there, and only there (without the raf component, and
    with raf-2 = True at 2 ranks, FSDP2's flag says the weight is resharded after forward)."""
    case = "mutant:no_reshard_stale_layout:fp8_tensor:128x64:bf16:ws2:steps:s0"
    for token in (":raf-no", ":raf-1"):
        bad = run_case(CaseSpec.parse(case + token), CPU)
        assert bad.verdict is Verdict.SILENT_MISMATCH, bad.render()
        assert "(after step 1), in forward: scale_inv" in bad.reason, bad.render()
    for token in ("", ":raf-2"):
        assert run_case(CaseSpec.parse(case + token), CPU).verdict is Verdict.EXACT, token

def test_dim1_shards_along_k():
    """Shard(1): exact when the columns align, rejected when not; a dim-0-only post-hook is caught."""
    assert run_case(CaseSpec.parse("reference:nvfp4_1d:128x64:bf16:ws2:steps:s0:dim1"), CPU).verdict is Verdict.EXACT
    assert run_case(CaseSpec.parse("reference:mxfp8:128x64:bf16:ws4:gather:s0:dim1"), CPU).verdict \
        is Verdict.REJECTED
    bad = run_case(CaseSpec.parse("mutant:assumes_dim0:fp8_tensor:128x64:bf16:ws2:gather:s0:dim1"), CPU)
    assert bad.verdict is Verdict.SILENT_MISMATCH, bad.render()


def test_master_slice_follows_the_shard_dim():
    full = torch.arange(32.0).reshape(4, 8)
    setup = fsdp_setup.Setup({}, ColumnShardLayout(4, 8, 2), 1, torch.float32)
    assert torch.equal(setup.master_slice(full), full[:, 4:])


def test_an_own_route_gets_the_configuration_only_when_it_takes_setup():
    """An adapter's make_sharded_module with a `setup` parameter runs configured cases (the policy's
    dtype reaches the unsharded weight); one without it is SKIPPED, never run as the default."""
    configured = run_case(CaseSpec.parse(
        "tests._own_route_adapters:ConfiguredOwnRoute:nvfp4_2d:128x64:fp32:ws2:gather:s0:mp-bf16"), CPU)
    assert configured.verdict is Verdict.EXACT, configured.render()
    old = CaseSpec.parse("tests._own_route_adapters:UnconfiguredOwnRoute:nvfp4_2d:128x64:fp32:ws2:gather:s0:mp-bf16")
    report = run_case(old, CPU)
    assert report.verdict is Verdict.SKIPPED and "takes no FSDP2 configuration" in report.reason, report.render()
    default = run_case(CaseSpec.parse(
        "tests._own_route_adapters:UnconfiguredOwnRoute:nvfp4_2d:128x64:fp32:ws2:gather:s0"), CPU)
    assert default.verdict is Verdict.EXACT, default.render()


def test_a_narrowed_configuration_run_is_a_subset_of_the_full_run():
    """A baseline written from the full run must name the cases a run narrowed by world size,
    format or scenario has (the README splits the GPU gate by world size)."""
    full = {c.id for c in ConfigSweep(FSDP).cases(["reference"])}
    for narrowed in (ConfigSweep(FSDP).cases(["reference"], world_sizes=[2]),
                     ConfigSweep(FSDP).cases(["reference"], formats=["nvfp4_2d"], scenarios=["steps"])):
        assert narrowed and {c.id for c in narrowed} <= full
