"""The zoo's mutants 22 and 23 show only where their bug can: `shared_scale_cache` (a scale cached per
class, not per weight) is EXACT in every case of one weight and caught by a module of several;
`kept_out_scale` (the out= re-gather of a weight FSDP2 keeps after forward) is EXACT where no forward
keeps the weight and caught where one does (compile, raf-no), after steps too."""

from __future__ import annotations

import pytest

from qgather.engine.run import RunOptions, run_case
from qgather.model.case import CaseSpec
from qgather.model.verdict import Verdict

CPU = RunOptions(backend="gloo", device="cpu")


def _verdict(case_id: str) -> Verdict:
    report = run_case(CaseSpec.parse(case_id), CPU)
    return report.verdict


@pytest.mark.parametrize("scenario", ["gather:s0", "steps:s0", "reshard:s0", "gather:s0:compile",
                                      "steps:s0:raf-no", "hooks:s0", "virtual:s0", "gather:s0:dcp-ws4"])
def test_the_shared_scale_cache_is_exact_with_one_weight(scenario):
    assert _verdict(f"mutant:shared_scale_cache:nvfp4_2d:128x64:bf16:ws2:{scenario}") is Verdict.EXACT


def test_the_shared_scale_cache_is_caught_by_a_module_of_several_weights():
    assert _verdict("mutant:shared_scale_cache:nvfp4_2d:32x64:bf16:ws2:layers:s0") is Verdict.SILENT_MISMATCH


@pytest.mark.parametrize("scenario, verdict", [
    ("gather:s0", Verdict.EXACT), ("steps:s0", Verdict.EXACT), ("reshard:s0", Verdict.EXACT),
    ("gather:s0:dcp-ws2-trained", Verdict.EXACT),
    ("gather:s0:compile", Verdict.SILENT_MISMATCH), ("steps:s0:compile", Verdict.SILENT_MISMATCH),
    ("reshard:s0:raf-no", Verdict.SILENT_MISMATCH),
])
def test_the_kept_out_scale_shows_where_a_forward_keeps_the_weight(scenario, verdict):
    assert _verdict(f"mutant:kept_out_scale:fp8_tensor:128x64:bf16:ws2:{scenario}") is verdict
