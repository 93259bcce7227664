"""End to end through the rank pools, and the one-line answers to bad input."""

import subprocess
import sys

import pytest

from qgather.engine.run import CaseInputError, RunOptions, run_case
from qgather.impls import UnknownImplementationError
from qgather.model.case import CaseSpec
from qgather.model.verdict import Verdict

CPU = RunOptions(backend="gloo", device="cpu")


@pytest.mark.parametrize("case_id, verdict", [
    ("reference:nvfp4_2d:128x64:bf16:ws2:gather:s0", Verdict.EXACT),
    ("reference:fp8_tensor:10x64:fp32:ws4:reshard:s1", Verdict.EXACT),   # uneven shards, out= path
    ("reference:fp8_block:255x128:bf16:ws2:steps:s0", Verdict.EXACT),    # uneven, partial 128-row tile
    ("reference:mxfp8:4x32x64:bf16:ws3:gather:s0", Verdict.EXACT),       # 3-D experts, uneven split
    ("reference:nvfp4_2d:136x64:bf16:ws8:gather:s0", Verdict.REJECTED),  # 17-row shards
    ("reference:nvfp4_1d:128x40:bf16:ws2:gather:s0", Verdict.REJECTED),  # K the format cannot hold
])
def test_reference_verdicts(case_id, verdict):
    report = run_case(CaseSpec.parse(case_id), CPU)
    assert report.verdict is verdict, report.render()
    assert report.passed


def test_rejection_names_the_constraint():
    report = run_case(CaseSpec.parse("reference:nvfp4_2d:136x64:bf16:ws8:gather:s0"), CPU)
    assert "starts at row 17" in report.reason and "16-row scale block" in report.reason


def test_nccl_without_gpus_is_skipped_with_a_reason():
    report = run_case(CaseSpec.parse("reference:fp8_tensor:8x64:bf16:ws2:gather:s0"),
                      RunOptions(backend="nccl", device="cpu"))
    assert report.verdict is Verdict.SKIPPED and "nccl" in report.reason.lower()


@pytest.mark.parametrize("case_id, error", [
    ("reference:fp7:8x64:bf16:ws2:gather:s0", CaseInputError),
    ("nosuch:fp8_tensor:8x64:bf16:ws2:gather:s0", UnknownImplementationError),
    ("reference:fp8_tensor:8x64:bf16:ws128:gather:s0", CaseInputError),
])
def test_bad_cases_raise_one_clear_error(case_id, error):
    with pytest.raises(error) as info:
        run_case(CaseSpec.parse(case_id), CPU)
    assert "\n" not in str(info.value)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "qgather", *args], capture_output=True, text=True, timeout=120)


def test_cli_case_reproduces_and_sets_the_exit_code():
    done = _cli("case", "reference:nvfp4_2d:64x64:bf16:ws2:virtual:s0")
    assert done.returncode == 0 and "EXACT" in done.stdout
    bad = _cli("case", "reference:fp7:8x64:bf16:ws2:gather:s0")
    assert bad.returncode == 4
    assert bad.stderr.strip().count("\n") == 0 and "unknown format 'fp7'" in bad.stderr
    assert "Traceback" not in bad.stderr


# Plain pytest's refusal of a bad option value (`pytest cases --formats fp7`: exit 4, the value named, no
# traceback, nothing run) is test_cli_ux's test_a_bad_selection_value_is_one_line_exit_4[pytest-...].


def test_a_dcp_case_starts_its_own_cuda_pool_while_the_save_runs(monkeypatch):
    from qgather.engine import run
    from qgather.runtime import PoolSpec, registry

    started = []
    monkeypatch.setattr(registry, "get_pool", lambda spec, say=None: registry.RankPool(spec))
    monkeypatch.setattr(registry.RankPool, "start_in_background", lambda self: started.append(self.spec.world_size))
    monkeypatch.setattr(PoolSpec, "validate", lambda self: self)  # no GPU here: the decision alone
    gpu = RunOptions(backend="gloo", device="cuda")
    run._start_own_pool_early(CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws4:gather:s0:dcp-ws2"), gpu)
    run._start_own_pool_early(CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws4:gather:s0:dcp-ws4"), gpu)
    run._start_own_pool_early(CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws4:gather:s0:dcp-ws2"), CPU)
    assert started == [4]  # not the save's own pool (same size), not a CPU pool (a start costs no CUDA contexts)


def test_a_pool_started_ahead_is_started_once(monkeypatch):
    from qgather.runtime import PoolSpec, registry

    spec = PoolSpec("gloo", 7, "cpu")  # a size no other test keeps a pool of
    launched = []

    def launch(pool) -> None:
        launched.append(pool)
        pool.restart.under_way = True  # as BackgroundRestart.launch leaves it until the start is done

    monkeypatch.setattr(registry.RankPool, "start_in_background", launch)
    try:
        registry.start_ahead(spec)
        registry.start_ahead(spec)  # starting already: not again
        assert len(launched) == 1 and launched[0] is registry.get_pool(spec)
    finally:
        registry._pools.pop(spec, None)
