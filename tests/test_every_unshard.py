"""Every unshard's gathered weight is judged against the golden, not only the first: under `compile`
the eager and the compiled forward's own unshards (after the first unshard and after every
optimizer step), and the training forward of a `dcp-wsA-trained` save."""

from __future__ import annotations

from qgather.engine.run import RunOptions, run_case
from qgather.model.case import CaseSpec
from qgather.model.verdict import Verdict

CPU = RunOptions(backend="gloo", device="cpu")
ADAPTERS = "tests._unshard_adapters"


def _run(case_id: str):
    return run_case(CaseSpec.parse(case_id), CPU)


def test_the_compiled_forwards_own_unshard_is_judged():
    """The third gather of a compile case is the compiled forward's own; the eager and the compiled
    output agree (the forward never reads the wrong byte): only its comparison with the golden fails."""
    report = _run(f"{ADAPTERS}:WrongThirdGather:fp8_tensor:128x64:bf16:ws2:gather:s0:compile")
    assert report.verdict is Verdict.SILENT_MISMATCH, report.render()
    assert report.reason.startswith("torch.compile: the compiled forward's unshard"), report.reason
    assert _run(f"{ADAPTERS}:WrongThirdGather:fp8_tensor:128x64:bf16:ws2:gather:s0").verdict is Verdict.EXACT


def test_steps_under_compile_judge_each_steps_forwards():
    report = _run(f"{ADAPTERS}:WrongFifthGather:nvfp4_2d:128x64:bf16:ws2:steps:s0:compile")
    assert report.verdict is Verdict.SILENT_MISMATCH, report.render()
    assert report.reason.startswith("after step 1, torch.compile: the compiled forward's unshard"), report.reason
    assert _run("reference:nvfp4_2d:128x64:bf16:ws2:steps:s0:compile").verdict is Verdict.EXACT


def test_a_trained_checkpoints_forward_is_judged_where_it_was_saved():
    report = _run(f"{ADAPTERS}:WrongFirstGather:fp8_tensor:128x64:bf16:ws4:gather:s0:dcp-ws2-trained")
    assert report.verdict is Verdict.SILENT_MISMATCH, report.render()
    assert report.reason.startswith("checkpoint save at world size 2: the training forward's unshard"), report.reason
