"""Where a run's cases ran (qgather.pytest_plugin.placement): the per-world-size table, the grouped
skip reasons, and the GPU job's gate on a case that its GPUs could have run on NCCL."""

from __future__ import annotations

from qgather.model.case_record import CaseRecord
from qgather.model.report import UNPLACED
from qgather.model.verdict import Verdict
from qgather.pytest_plugin import placement


def record(ws: int, ran_on: str, reason: str = "") -> CaseRecord:
    verdict = Verdict.SKIPPED if ran_on in ("", UNPLACED) else Verdict.EXACT
    case = f"te:fp8_tensor:{40 + len(reason)}x64:bf16:ws{ws}:gather:s0"
    return CaseRecord(case=case, implementation="te", format="fp8_tensor", world_size=ws, shape_class="aligned",
                      scenario="gather", fsdp_config="default", configuration="", verdict=verdict, passed=True,
                      reason=reason, repro="", report="", ran_on=ran_on)


RECORDS = [record(1, "nccl/cuda"), record(2, "nccl/cuda"), record(2, "nccl/cuda"), record(8, "gloo/cuda"),
           record(2, "", "te: MXFP8 needs sm_100, this GPU is sm_90"),
           record(4, "", "te: MXFP8 needs sm_100, this GPU is sm_90"),
           record(4, UNPLACED, "nccl runs one rank per GPU: 4 ranks but 2 visible GPU(s)")]


def test_the_table_counts_each_case_once_per_world_size():
    table = placement.by_world_size(RECORDS)
    assert {size: dict(c) for size, c in table.items()} == {
        1: {"nccl/cuda": 1}, 2: {"nccl/cuda": 2, "skipped": 1}, 4: {"skipped": 1, UNPLACED: 1}, 8: {"gloo/cuda": 1}}
    lines = placement.table_lines(RECORDS)
    assert lines[1].split() == ["world", "size", "nccl/cuda", "gloo/cuda", UNPLACED, "skipped"]
    assert lines[3].split() == ["2", "2", "0", "0", "1"]


def test_skip_reasons_group_across_numbers():
    reasons = placement.skip_reasons([*RECORDS, record(2, "", "te: MXFP8 needs sm_101, this GPU is sm_89")])
    assert reasons == [(3, "te: MXFP8 needs sm_100, this GPU is sm_90")]


def test_a_case_the_gpus_could_run_but_did_not_fails_the_gpu_job():
    assert [r.world_size for r in placement.unplaced_on_gpus(RECORDS, 4)] == [4]
    assert placement.unplaced_on_gpus(RECORDS, 2) == []  # 4 ranks on 2 GPUs: not this host's to run on NCCL


def test_the_engine_says_where_a_case_ran_and_when_no_pool_of_its_size_can_exist():
    from qgather.engine.run import RunOptions, run_case
    from qgather.model.case import CaseSpec

    spec = CaseSpec.parse("reference:fp8_tensor:64x64:bf16:ws2:gather:s0")
    assert run_case(spec, RunOptions(backend="gloo", device="cpu")).ran_on == "gloo/cpu"
    # NCCL on a host without a GPU: the pool cannot exist, the case is SKIPPED and says so
    report = run_case(spec, RunOptions(backend="nccl", device="cuda"))
    assert (report.verdict, report.ran_on) == (Verdict.SKIPPED, UNPLACED), report.render()
    virtual = CaseSpec.parse("reference:fp8_tensor:64x64:bf16:ws4:virtual:s0")
    assert run_case(virtual, RunOptions(backend="gloo", device="cpu")).ran_on == "virtual"
